"""A worker's own Redis commands on its tier's ready stream and the registry.

Each function sends exactly the commands the worker's loops send (same order, same pipelines,
one await per round trip), so the data plane's schedule is the same whoever calls them:
joining the consumer group, registering and deregistering, the blocking read of new
notifications, the reclaim scan, the acks, the renew's touch and heartbeat, housekeeping's trim, and a
fresh notification (a hand-over).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import as_str, encode
from protocol.models import WorkerInfo
from stores import cluster
from stores.replies import RawRow, raw_streams
from stores.scripts import Scripts


async def join_ready_group(r: aioredis.Redis, tier: str) -> None:
    """Create the workers' group on the tier's ready stream (with the stream) unless it exists.
    From id 0: turns parked before any worker existed are served."""
    try:
        await r.xgroup_create(keys.ready(tier), keys.GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def register_worker(r: aioredis.Redis, info: WorkerInfo, heartbeat_ttl_ms: int) -> None:
    """Write the worker's registry entry and beat its heartbeat (one round trip)."""
    pipe = r.pipeline(transaction=False)
    pipe.hset(keys.WORKERS, info.worker, encode(info))
    pipe.set(keys.heartbeat(info.worker), "1", px=heartbeat_ttl_ms)
    await pipe.execute()


async def deregister_worker(r: aioredis.Redis, tier: str, worker_id: str) -> None:
    """Leave the registry: entry, heartbeat and control stream; and the group's consumer, when
    it has no pending entries (deleting a consumer drops them)."""
    ready = keys.ready(tier)
    info = await r.xpending_range(ready, keys.GROUP, "-", "+", 1, consumername=worker_id)
    pipe = r.pipeline(transaction=False)
    pipe.hdel(keys.WORKERS, worker_id)
    pipe.delete(keys.heartbeat(worker_id))  # one DEL per key: a cluster pipeline refuses a
    pipe.delete(keys.control(worker_id))  # multi-key DEL (the two share the worker's slot)
    if not info:
        pipe.xgroup_delconsumer(ready, keys.GROUP, worker_id)
    await pipe.execute()


async def read_ready(r: aioredis.Redis, tier: str, worker_id: str, count: int,
                     block_ms: int) -> list[tuple[bytes, list[RawRow]]]:
    """One XREADGROUP of new notifications for ``worker_id`` (``[]`` when the block ends empty)."""
    return raw_streams(await r.xreadgroup(keys.GROUP, worker_id, {keys.ready(tier): ">"},
                                          count=count, block=block_ms))


async def reclaim_idle(r: aioredis.Redis, tier: str, worker_id: str, min_idle_ms: int, start_id: str,
                       count: int) -> tuple[str, list[tuple[bytes, dict[bytes, bytes] | None]]]:
    """One XAUTOCLAIM from ``start_id``: the next cursor ("0-0" = wrapped) and the claimed
    entries (fields ``None`` or empty for one trimmed away under its consumer)."""
    nxt, claimed, *_deleted = await r.xautoclaim(keys.ready(tier), keys.GROUP, worker_id, min_idle_ms,
                                                 start_id=start_id, count=count)
    return as_str(nxt), cast("list[tuple[bytes, dict[bytes, bytes] | None]]", claimed)


async def ack_notifications(scripts: Scripts, tier: str, worker_id: str, nids: Sequence[str]) -> None:
    """Ack those of ``nids`` still pending under ``worker_id`` (``notification_ack.lua``)."""
    await scripts.notification_ack(keys=[keys.ready(tier)], args=[keys.GROUP, worker_id, *nids])


async def ack_covered(scripts: Scripts, tier: str, worker_id: str, holder_worker: str, user: str,
                      nids: Sequence[str]) -> int:
    """Ack ``nids`` if ``holder_worker`` has one of ``user``'s notifications pending
    (``notification_ack_covered.lua``); negative when it has none and they stay pending."""
    return int(await scripts.notification_ack_covered(
        keys=[keys.ready(tier)], args=[keys.GROUP, worker_id, holder_worker, user, *nids]))


async def touch_and_beat(r: aioredis.Redis, scripts: Scripts, tier: str, worker_id: str,
                         nids: Sequence[str], heartbeat_ttl_ms: int) -> None:
    """Touch the notifications still pending under us (resetting their idle time, so no one
    reclaims a live holder's) and beat the heartbeat, in one round trip (on a Cluster, two
    requests sent concurrently: its pipeline refuses ``EVALSHA``)."""
    if cluster.is_cluster(r):
        calls = [r.set(keys.heartbeat(worker_id), "1", px=heartbeat_ttl_ms)]
        if nids:
            calls.insert(0, scripts.notification_touch(keys=[keys.ready(tier)],
                                                       args=[keys.GROUP, worker_id, *nids]))
        await asyncio.gather(*calls)
        return
    async with r.pipeline(transaction=False) as pipe:  # (a failed script load left
        # the pipeline holding its connection: the context gives it back)
        if nids:
            await scripts.notification_touch(
                keys=[keys.ready(tier)], args=[keys.GROUP, worker_id, *nids], client=pipe)
        pipe.set(keys.heartbeat(worker_id), "1", px=heartbeat_ttl_ms)
        await pipe.execute()


async def trim_ready(r: aioredis.Redis, tier: str, forget_after_s: float) -> None:
    """Trim the ready stream below what is pending or undelivered, and forget users inactive
    for ``forget_after_s``; nothing when the group is missing."""
    ready = keys.ready(tier)
    groups = await r.xinfo_groups(ready)
    group = next((g for g in groups if as_str(g["name"]) == keys.GROUP), None)
    if group is None:
        return
    summary = await r.xpending(ready, keys.GROUP)
    floor = as_str(summary["min"]) if summary["pending"] else _next_id(as_str(group["last-delivered-id"]))
    pipe = r.pipeline(transaction=False)
    pipe.xtrim(ready, minid=floor, approximate=True)
    horizon = time.time() - forget_after_s
    pipe.zremrangebyscore(keys.active(tier), "-inf", horizon)
    await pipe.execute()


async def notify_ready(r: aioredis.Redis, tier: str, user: str) -> None:
    """Post a fresh notification for ``user`` on ``tier``'s ready stream."""
    await r.xadd(keys.ready(tier), {"user": user})


def _next_id(stream_id: str) -> str:
    ms, _, seq = stream_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"
