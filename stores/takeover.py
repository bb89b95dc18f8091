"""Fast takeover of a dead worker's users, and removal of dead consumers.

When the commander knows a worker is dead (its process exited, or its heartbeat expired),
it does not wait for the lane lease to expire and for ``XAUTOCLAIM``'s idle rule: for every
notification pending on the dead worker's consumer it

1. reads the notification's user (``XRANGE nid nid``; an entry trimmed away is just acked),
2. clears the user's lane if the dead worker holds it (``lane_clear.lua``): every commit,
   renew and release checks the lane's ``<worker>|<token>``, so a worker that was only
   paused is *fenced* from then on,
3. posts a fresh notification ``{user: U}`` on the tier's ready stream (one per user),
4. and only then acks the old entries: the duty of serving U is never without a carrier.

Once the consumer has no pending entry left it is deleted from the group
(``consumer_drop.lua``: the check and the delete are atomic, because deleting a consumer
drops its pending entries). ``sweep`` does the same for every consumer of a tier's group
that is not a live worker (no heartbeat, not known to the caller as alive).

Plain blocking ``redis.Redis`` calls only, so the simulator runs the very same functions on a
``fakeredis.FakeRedis``. Every key comes from ``protocol.keys``; the lane script touches one
key, the stream commands one tier's stream.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import as_str
from protocol.ids import InvalidId, validate_token, validate_user_id
from stores import functions
from stores.backlog import existing_shards
from stores.functions import Functions

BATCH = 100  # pending entries handled per round of XPENDING


@dataclass(frozen=True)
class Takeover:
    """What one takeover of a worker's consumer did."""

    tier: str
    worker: str
    users: tuple[str, ...] = ()  # users handed on: one fresh notification each
    lanes_cleared: tuple[str, ...] = ()  # of those, the ones whose lane the dead worker held
    acked: int = 0  # its pending notifications acked, after the fresh ones were posted
    trimmed: int = 0  # of those, entries trimmed away from the stream (nothing to hand on)
    unreadable: int = 0  # of those, entries naming no valid user: re-posted as they were
    consumer_removed: bool = False  # deleted from the group (it had no pending entry left)
    pending_left: bool = False  # the consumer still has pending entries (kept; try again)

    @property
    def changed(self) -> bool:
        """Whether anything was handed on, acked or removed."""
        return bool(self.acked or self.consumer_removed)


@dataclass
class _Progress:
    users: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    cleared: list[str] = field(default_factory=list)
    acked: int = 0
    trimmed: int = 0
    unreadable: int = 0


def shard_streams(r: redis.Redis, tier: str) -> list[str]:
    """The tier's ready streams that exist: shard 0 always (it may be missing, the callers
    handle that), and each higher shard whose stream exists (``stores.backlog.existing_shards``)."""
    return [keys.ready(tier, k) for k in existing_shards(r, [tier])[tier]]


def take_over(r: redis.Redis, tier: str, worker: str, batch: int = BATCH) -> Takeover:
    """Hand on every notification pending on ``worker``'s consumer, then remove the consumer.

    Only for a worker known to be dead: its lanes are cleared (a paused one is fenced).
    Safe to repeat and to run concurrently (a lane re-taken by a live worker is not its own
    any more; a second fresh notification for a user costs one extra read). On every ready
    shard of the tier that exists, one fresh notification per user in all (any shard's carries
    the user's duty: every worker reads every shard), on the shard of one it replaces.
    """
    validate_token(worker, "worker id")
    done = _Progress()
    scripts = Functions(r)
    dropped = [_take_over_stream(r, scripts, stream, worker, batch, done)
               for stream in shard_streams(r, tier)]
    left = -1 in dropped
    return Takeover(tier, worker, tuple(done.users), tuple(done.cleared), done.acked, done.trimmed,
                    done.unreadable, consumer_removed=1 in dropped and not left, pending_left=left)


def _take_over_stream(r: redis.Redis, scripts: Functions, stream: str, worker: str, batch: int,
                      done: _Progress) -> int:
    """:func:`take_over` on one ready shard; ``consumer_drop.lua``'s answer (1 dropped, 0
    absent, -1 pending left)."""
    start = "-"
    try:
        while True:
            rows = r.xpending_range(stream, keys.GROUP, min=start, max="+", count=batch,
                                    consumername=worker)
            if not rows:
                break
            ids = [as_str(row["message_id"]) for row in rows]
            _hand_on(r, scripts, stream, worker, ids, done)
            start = f"({ids[-1]}"
            if len(rows) < batch:
                break
        return int(scripts.consumer_drop(keys=[stream], args=[keys.GROUP, worker]))
    except ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        return 0  # no stream or no group: nothing was ever pending there


def _hand_on(r: redis.Redis, scripts: Functions, stream: str, worker: str, ids: list[str],
             done: _Progress) -> None:
    """One batch: read the users, clear the dead worker's lanes, post fresh notifications, ack."""
    pipe = r.pipeline(transaction=False)
    for nid in ids:
        pipe.xrange(stream, min=nid, max=nid)
    users: list[str] = []
    raw: list[dict[Any, Any]] = []
    for rows in pipe.execute():
        if not rows:
            done.trimmed += 1
            continue
        fields = rows[0][1]
        user = _user(fields)
        if user is None:
            raw.append(fields)  # a worker dead-letters it with the reason, as it would have
        elif user not in done.seen:
            done.seen.add(user)
            users.append(user)
    # the lanes first: a fresh notification that met the dead worker's lane would be acked
    # as "the holder carries the duty", and then nobody would
    done.cleared += _clear_lanes(r, scripts, worker, users)
    pipe = r.pipeline(transaction=False)
    for user in users:
        pipe.xadd(stream, {"user": user})
    for fields in raw:
        pipe.xadd(stream, fields)
    if users or raw:
        pipe.execute()
    r.xack(stream, keys.GROUP, *ids)  # only now: the fresh notifications carry the duty
    done.users += users
    done.acked += len(ids)
    done.unreadable += len(raw)


def _clear_lanes(r: redis.Redis, scripts: Functions, worker: str, users: list[str]) -> list[str]:
    """Delete the lanes of ``users`` that ``worker`` holds; return whose lanes were deleted."""
    if not users:
        return []
    while True:  # all of them again when the library was missing: a lane cleared is not ours any more
        pipe = r.pipeline(transaction=False)
        for user in users:
            scripts.lane_clear(keys=[keys.lane(user)], args=[worker], client=pipe)
        replies = pipe.execute(raise_on_error=False)
        if not any(functions.is_missing(res) for res in replies):
            break
        if not functions.wait_for_library(r):
            raise functions.LibraryMissing(functions.missing_line())
    for res in replies:
        if isinstance(res, Exception):
            raise res
    return [u for u, res in zip(users, replies, strict=True) if int(res) == 1]


def consumers(r: redis.Redis, tier: str) -> dict[str, int]:
    """The consumers of the tier's group, on every ready shard, with their pending counts
    summed over the shards ({} if there is no group)."""
    out: dict[str, int] = {}
    for stream in shard_streams(r, tier):
        try:
            listed = r.xinfo_consumers(stream, keys.GROUP)
        except ResponseError as exc:
            if "NOGROUP" in str(exc) or "no such key" in str(exc).lower():
                continue
            raise
        for c in listed:
            name = as_str(c["name"])
            out[name] = out.get(name, 0) + int(c["pending"])
    return out


def sweep(r: redis.Redis, tier: str, live: Collection[str] = (), batch: int = BATCH) -> list[Takeover]:
    """Take over every consumer of the tier's group that is not a live worker.

    A consumer is live if its name is in ``live`` (workers the caller runs and knows alive)
    or its heartbeat key exists. The others are the consumers of dead workers (SIGKILLed,
    crashed, or gone while no commander looked): their pending notifications are handed on
    and the empty consumers removed. Consumers are listed *before* heartbeats are read: a
    worker beats before its first read creates its consumer, so a new worker is never taken
    for a dead one. Names that are not worker ids are not Fleet's and are left alone.
    """
    names = [n for n in consumers(r, tier) if n not in live and _is_worker_id(n)]
    if not names:
        return []
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.exists(keys.heartbeat(name))
    beats = pipe.execute()
    return [take_over(r, tier, name, batch) for name, beat in zip(names, beats, strict=True) if not beat]


def _user(fields: dict[Any, Any]) -> str | None:
    raw = fields.get(b"user", fields.get("user"))
    if raw is None:
        return None
    try:
        return validate_user_id(raw)
    except InvalidId:
        return None


def _is_worker_id(name: str) -> bool:
    try:
        validate_token(name, "worker id")
    except InvalidId:
        return False
    return True
