"""A worker's own Redis commands on its tier's ready stream and the registry.

Each function sends exactly the commands the worker's loops send (same order, same pipelines,
one await per round trip), so the data plane's schedule is the same whoever calls them:
joining the consumer group, registering and deregistering, the blocking read of new
notifications, the reclaim scan, the acks, the renew's touch and heartbeat, housekeeping's trim, and a
fresh notification (a hand-over).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import as_str, encode
from protocol.models import WorkerInfo
from stores import cluster, functions
from stores.batch import ScriptBatcher
from stores.functions import Functions
from stores.registry import raise_unless_bumped
from stores.replies import raw_streams

log = logging.getLogger("fleet.worker")


# --- ready shards ---------------------------------------------------------------------
# A notification is named by its stream id on shard 0 and by "<k>/<id>" on shard k >= 1: the
# worker's jobs carry these names as they are; only the functions here read the shard out of them.
def nid_of(shard: int, stream_id: str) -> str:
    """The name a worker's jobs carry for notification ``stream_id`` of ready shard ``shard``."""
    return stream_id if shard == 0 else f"{shard}/{stream_id}"


def split_nid(nid: str) -> tuple[int, str]:
    """``(shard, stream id)`` of a notification name made by :func:`nid_of`."""
    shard, sep, stream_id = nid.partition("/")
    return (int(shard), stream_id) if sep else (0, nid)


def by_shard(nids: Sequence[str]) -> dict[int, list[str]]:
    """Stream ids grouped by ready shard, in the order given."""
    out: dict[int, list[str]] = {}
    for nid in nids:
        shard, stream_id = split_nid(nid)
        out.setdefault(shard, []).append(stream_id)
    return out


async def shards_in_use(r: aioredis.Redis, tier: str, want: int) -> int:
    """How many ready shards a worker of ``tier`` must read: the policy's ``want``, or more while
    a stream of a higher shard exists (a tier that shrank, or a client that still writes the
    old count): one ``EXISTS`` per possible shard, pipelined. Shard streams are never deleted
    by Fleet (each holds the workers' group), so a shrink never strands a notification."""
    pipe = r.pipeline(transaction=False)
    for k in range(1, keys.MAX_READY_SHARDS):
        pipe.exists(keys.ready(tier, k))
    found = [k for k, n in zip(range(1, keys.MAX_READY_SHARDS), await pipe.execute(), strict=True)
             if int(n)]
    return max(want, 1, (found[-1] + 1) if found else 1)


async def more_shards(r: aioredis.Redis, tier: str, want: int, have: int) -> int:
    """The ready shards a worker reading ``have`` must read now (:func:`shards_in_use`, never
    fewer: a shrink must not strand what is there); the group is joined on a new shard before
    it is read."""
    shards = await shards_in_use(r, tier, want)
    if shards <= have:
        return have
    await join_ready_group(r, tier, shards)
    log.info("reading %d ready shards of %s (policy: %d)", shards, tier, want)
    return shards


async def join_ready_group(r: aioredis.Redis, tier: str, shards: int = 1) -> None:
    """Create the workers' group on each of the tier's ``shards`` ready streams (with the
    stream) unless it exists. From id 0: turns parked before any worker existed are served."""
    for k in range(shards):
        try:
            await r.xgroup_create(keys.ready(tier, k), keys.GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


async def register_worker(r: aioredis.Redis, info: WorkerInfo, heartbeat_ttl_ms: int) -> None:
    """Write the worker's registry entry and beat its heartbeat (one round trip)."""
    pipe = r.pipeline(transaction=False)
    pipe.hset(keys.WORKERS, info.worker, encode(info))
    pipe.set(keys.heartbeat(info.worker), "1", px=heartbeat_ttl_ms)
    pipe.incr(keys.WORKERS_VERSION)  # (after the entry: a reader of this version reads it)
    raise_unless_bumped(await pipe.execute(raise_on_error=False), log)


async def deregister_worker(r: aioredis.Redis, tier: str, worker_id: str, shards: int = 1) -> None:
    """Leave the registry: entry, heartbeat and control stream; and the group's consumer on
    each ready shard where it has no pending entries (deleting a consumer drops them)."""
    idle = []
    for k in range(shards):
        ready = keys.ready(tier, k)
        if not await r.xpending_range(ready, keys.GROUP, "-", "+", 1, consumername=worker_id):
            idle.append(ready)
    pipe = r.pipeline(transaction=False)
    pipe.hdel(keys.WORKERS, worker_id)
    pipe.delete(keys.heartbeat(worker_id))  # one DEL per key: a cluster pipeline refuses a
    pipe.delete(keys.control(worker_id))  # multi-key DEL (the two share the worker's slot)
    pipe.delete(keys.cancels(worker_id))
    for ready in idle:
        pipe.xgroup_delconsumer(ready, keys.GROUP, worker_id)
    pipe.incr(keys.WORKERS_VERSION)
    raise_unless_bumped(await pipe.execute(raise_on_error=False), log)


Delivered = list[tuple[str, dict[bytes, bytes]]]  # (notification name, fields), as read


def _delivered(tier: str, reply: object) -> Delivered:
    return [(nid_of(keys.shard_of_ready(tier, stream), as_str(nid)), fields)
            for stream, entries in raw_streams(reply) for nid, fields in entries]


CLUSTER_SHARD_BLOCK_MS = 100  # on a Cluster, the blocking read of one shard: the others' latency


async def read_ready(r: aioredis.Redis, tier: str, worker_id: str, count: int, block_ms: int,
                     shards: int = 1, turn: int = 0) -> Delivered:
    """New notifications for ``worker_id`` from the tier's ``shards`` ready streams, named as
    :func:`nid_of` (``[]`` when the block ends empty).

    On one node: one ``XREADGROUP`` over every shard. On a Cluster (the shards sit in different
    slots, so on different masters): a non-blocking read of every shard, sent concurrently
    (``COUNT`` shared out), and only if they all come back empty a blocking read of shard
    ``turn % shards`` for at most ``CLUSTER_SHARD_BLOCK_MS``: the caller rotates ``turn``.
    """
    streams = {keys.ready(tier, k): ">" for k in range(shards)}
    if shards == 1 or not cluster.is_cluster(r):
        return _delivered(tier, await r.xreadgroup(keys.GROUP, worker_id, streams,  # type: ignore[arg-type]
                                                   count=count, block=block_ms))
    names = list(streams)
    share = {names[(turn + i) % shards]: count // shards + (1 if i < count % shards else 0)
             for i in range(shards)}  # COUNT shared out, the remainder rotating: never more in all
    replies = await asyncio.gather(*(r.xreadgroup(keys.GROUP, worker_id, {name: ">"}, count=n)
                                     for name, n in share.items() if n > 0))
    got = [row for reply in replies for row in _delivered(tier, reply)]
    if got:
        return got
    name = keys.ready(tier, turn % shards)
    return _delivered(tier, await r.xreadgroup(keys.GROUP, worker_id, {name: ">"}, count=count,
                                               block=min(block_ms, CLUSTER_SHARD_BLOCK_MS)))


Claimed = list[tuple[str, dict[bytes, bytes] | None, int]]  # (name, fields, times delivered)


async def reclaim_idle(r: aioredis.Redis, tier: str, worker_id: str, min_idle_ms: int, start_id: str,
                       count: int, shard: int = 0) -> tuple[str, Claimed]:
    """One XAUTOCLAIM of ready shard ``shard`` from ``start_id``: the next cursor ("0-0" =
    wrapped) and the claimed entries, named as :func:`nid_of` (fields ``None`` or empty for one
    trimmed away under its consumer), each with the times it was delivered (this claim
    included; read by one more round trip when any was claimed)."""
    ready = keys.ready(tier, shard)
    nxt, claimed, *_deleted = await r.xautoclaim(ready, keys.GROUP, worker_id, min_idle_ms,
                                                 start_id=start_id, count=count)
    rows = cast("list[tuple[bytes, dict[bytes, bytes] | None]]", claimed)
    deliveries = [1] * len(rows)
    if rows:
        pipe = r.pipeline(transaction=False)
        for nid, _fields in rows:
            pipe.xpending_range(ready, keys.GROUP, nid, nid, 1)
        deliveries = [int(p[0]["times_delivered"]) if p else 1 for p in await pipe.execute()]
    return as_str(nxt), [(nid_of(shard, as_str(nid)), fields, n)
                         for (nid, fields), n in zip(rows, deliveries, strict=True)]


async def ack_notifications(scripts: Functions, tier: str, worker_id: str, nids: Sequence[str],
                            batcher: ScriptBatcher | None = None) -> None:
    """Ack those of ``nids`` still pending under ``worker_id`` (``notification_ack.lua``, one
    call per ready shard). With a ``batcher``, the call joins those of the same loop pass,
    merged with other jobs' acks of the same shard: one call acks many users' ids."""
    calls = []
    for shard, ids in by_shard(nids).items():
        keys_, args = [keys.ready(tier, shard)], [keys.GROUP, worker_id, *ids]
        if batcher is not None:
            calls.append(batcher.call(scripts.notification_ack, keys_, args, merge_from=2))
        else:
            await scripts.notification_ack(keys=keys_, args=args)
    if calls:
        await asyncio.gather(*calls)


async def ack_covered(scripts: Functions, tier: str, worker_id: str, holder_worker: str, user: str,
                      nids: Sequence[str]) -> int:
    """Ack ``nids`` if ``holder_worker`` has one of ``user``'s notifications pending
    (``notification_ack_covered.lua``); negative when it has none and they stay pending.

    Per ready shard, atomically: the ids on shard k are acked only if the holder has one of
    the user's notifications pending on shard k. A user's notifications all sit on one shard
    while the tier's shard count stays; after a change the holder's may sit on the old shard
    and ours on the new one: then ours stay pending, and are reclaimed once idle (safe, late).
    """
    acked, carried = 0, False
    for shard, ids in by_shard(nids).items():
        n = int(await scripts.notification_ack_covered(
            keys=[keys.ready(tier, shard)], args=[keys.GROUP, worker_id, holder_worker, user, *ids]))
        if n >= 0:
            acked, carried = acked + n, True
    return acked if carried else -1


async def touch_and_beat(r: aioredis.Redis, scripts: Functions, tier: str, worker_id: str,
                         nids: Sequence[str], heartbeat_ttl_ms: int) -> None:
    """Touch the notifications still pending under us (resetting their idle time, so no one
    reclaims a live holder's; one script call per ready shard) and beat the heartbeat, in one
    round trip (on a Cluster, one per master, sent concurrently)."""
    shards = by_shard(nids)

    async def round_trip(indexes: list[int]) -> list[Any]:  # all of it (touching twice is harmless):
        async with r.pipeline(transaction=False) as pipe:  # gives its connection back on error
            for shard, ids in shards.items():
                scripts.notification_touch(keys=[keys.ready(tier, shard)], args=[keys.GROUP, worker_id, *ids],
                                           client=pipe)
            pipe.set(keys.heartbeat(worker_id), "1", px=heartbeat_ttl_ms)
            replies = list(await pipe.execute(raise_on_error=False))
        return [replies[i] for i in indexes]  # the replies asked for

    for res in await functions.resend_missing(await round_trip(list(range(len(shards) + 1))), r, round_trip):
        if isinstance(res, Exception):
            raise res


async def trim_ready(r: aioredis.Redis, tier: str, forget_after_s: float, shards: int = 1) -> None:
    """Trim each ready shard below what is pending or undelivered there, and forget users
    inactive for ``forget_after_s`` (the active set is tier-wide); a shard without the group
    is left alone."""
    pipe = r.pipeline(transaction=False)
    for k in range(shards):
        ready = keys.ready(tier, k)
        try:
            groups = await r.xinfo_groups(ready)
        except ResponseError as exc:
            if "no such key" not in str(exc).lower():
                raise
            continue
        group = next((g for g in groups if as_str(g["name"]) == keys.GROUP), None)
        if group is None:
            continue
        summary = await r.xpending(ready, keys.GROUP)
        floor = as_str(summary["min"]) if summary["pending"] else _next_id(as_str(group["last-delivered-id"]))
        pipe.xtrim(ready, minid=floor, approximate=True)
    horizon = time.time() - forget_after_s
    pipe.zremrangebyscore(keys.active(tier), "-inf", horizon)
    await pipe.execute()


async def notify_ready(r: aioredis.Redis, tier: str, user: str, shards: int = 1) -> None:
    """Post a fresh notification for ``user`` on its shard of ``tier``'s ``shards`` ready
    streams (any shard would do: every worker of the tier reads every shard)."""
    await r.xadd(keys.ready(tier, keys.ready_shard(user, shards)), {"user": user})


def _next_id(stream_id: str) -> str:
    ms, _, seq = stream_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"
