"""The streams the commander reads each pass: workers' occupancy reports (``fleet:reports``)
and the tiers' pressure events (``fleet:{T}:pressure``), with their ids as text; and the
workers' append of their reports."""

from __future__ import annotations

from collections.abc import Mapping

import redis
import redis.asyncio as aioredis

from protocol import keys
from protocol.codec import as_str, encode
from protocol.models import OccupancyReport
from stores.replies import Row, raw_rows, raw_streams, rows

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


def wait_pressure(r: redis.Redis, after: Mapping[str, str], count: int, block_ms: int) -> dict[str, Rows]:
    """Block up to ``block_ms`` for pressure events after ``after[tier]``; the new ones per tier."""
    resp = raw_streams(r.xread({keys.pressure(tier): last for tier, last in after.items()}, count=count,
                               block=block_ms))
    return {as_str(stream).split("{", 1)[1].split("}", 1)[0]: rows(entries) for stream, entries in resp}


async def post_report_async(r: aioredis.Redis, report: OccupancyReport, maxlen: int) -> None:
    """Append a worker's occupancy report to ``fleet:reports``, kept to about ``maxlen``."""
    await r.xadd(keys.REPORTS, {"m": encode(report)}, maxlen=maxlen, approximate=True)
