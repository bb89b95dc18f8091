"""The streams the commander reads each pass: workers' occupancy reports (``fleet:reports``)
and the tiers' pressure events (``fleet:{T}:pressure``), with their ids as text; and the
workers' append of their reports."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio as aioredis

from protocol import keys
from protocol.codec import as_str, encode
from protocol.models import OccupancyReport
from stores import cluster
from stores.replies import RawRow, Row, raw_rows, raw_streams, rows

Rows = list[Row]  # (entry id, fields)


def reports_after(r: redis.Redis, last_id: str, count: int) -> Rows:
    """Up to ``count`` reports after ``last_id``, oldest first."""
    resp = raw_streams(r.xread({keys.REPORTS: last_id}, count=count))
    return rows(resp[0][1] if resp else [])


def newest_reports(r: redis.Redis, count: int) -> Rows:
    """The newest ``count`` reports, newest first."""
    return rows(r.xrevrange(keys.REPORTS, count=count))


def last_pressure_id(r: redis.Redis, tier: str) -> str:
    """The id of the tier's newest pressure event, or ``0-0`` if there is none."""
    last = raw_rows(r.xrevrange(keys.pressure(tier), count=1))
    return as_str(last[0][0]) if last else "0-0"


CLUSTER_POLL_MS = 50  # on a Cluster with several tiers: how often the pressure streams are read


def wait_pressure(r: redis.Redis, after: Mapping[str, str], count: int, block_ms: int) -> dict[str, Rows]:
    """Block up to ``block_ms`` for pressure events after ``after[tier]``; the new ones per tier.

    On one node: one blocking ``XREAD`` over every tier's stream. On a Cluster the streams are
    in the tiers' slots and a multi-key ``XREAD`` is refused, so: one tier blocks as on one node;
    several are read without blocking (one ``XREAD`` per stream, pipelined: each goes to its
    node) every ``CLUSTER_POLL_MS`` until an event or ``block_ms``, so the commander still wakes
    on a pressure event within about ``CLUSTER_POLL_MS``."""
    streams: dict[Any, Any] = {keys.pressure(tier): last for tier, last in after.items()}
    if len(streams) > 1 and cluster.is_cluster(r):
        return _poll_pressure(r, streams, count, block_ms)
    resp = raw_streams(r.xread(streams, count=count, block=block_ms))
    return _by_tier(resp)


def _poll_pressure(r: redis.Redis, streams: dict[Any, Any], count: int, block_ms: int) -> dict[str, Rows]:
    deadline = time.monotonic() + block_ms / 1000
    while True:
        pipe = r.pipeline(transaction=False)
        for stream, last in streams.items():
            pipe.xread({stream: last}, count=count)
        resp = [item for reply in pipe.execute() for item in raw_streams(reply)]
        left = deadline - time.monotonic()
        if resp or left <= 0:
            return _by_tier(resp)
        time.sleep(min(left, CLUSTER_POLL_MS / 1000))


def _by_tier(resp: list[tuple[bytes, list[RawRow]]]) -> dict[str, Rows]:
    return {as_str(stream).split("{", 1)[1].split("}", 1)[0]: rows(entries) for stream, entries in resp}


async def post_report_async(r: aioredis.Redis, report: OccupancyReport, maxlen: int) -> None:
    """Append a worker's occupancy report to ``fleet:reports``, kept to about ``maxlen``."""
    await r.xadd(keys.REPORTS, {"m": encode(report)}, maxlen=maxlen, approximate=True)
