"""Re-notify users whose queued turns have no notification: after a failover, and when a
group's pool is removed (the commander moves its queued users, ``notify_on``).

Redis Cluster replicates asynchronously. The ordered submit writes a turn's inbox entry (the
user's slot) and only then its notification (the tier's slot), so a failover of the tier's
master can keep the entry and lose the notification written after it; a takeover's fresh
notification, or a worker's pending entry, can be lost the same way. Such a turn is
*stranded*: its entry waits after the user's cursor with nothing to wake a worker for it,
until the user submits again, which may be never.

So the commander watches the Cluster's ``cluster_current_epoch``, which every failover raises.
When it grew past the last recovery's (:data:`protocol.keys.RECOVERED` remembers it across
commanders), every user of the tier's active set whose inbox holds an entry after its cursor
gets one fresh notification on its ready shard (:func:`renotify_unserved`). A spare
notification costs a worker one lane acquire and ack; a missing one costs the user its turn:
the sweep does not try to tell the two apart.

The window that remains: a user whose *first* submit within the active set's memory
(``10 × active_window_s``) lost both its notification and its active mark (the two sit in the
tier's slot, written together) is not in the set; that turn waits for the user's next submit
or the client's resubmit under the same turn id. With the tier's ``replica_acks`` only a
submit whose ``WAIT`` came back short can meet this (``Fleet.unreplicated`` names them).

One node has no failover, and Fleet's submit there is one transaction: nothing to sweep (a
raw client's two plain ``XADD``s on a node with ``appendfsync everysec`` could lose the second
in a crash: on one node such a client should send its three commands in one ``MULTI``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from protocol import keys
from protocol.codec import as_str
from protocol.ids import InvalidId, validate_user_id
from stores.replies import entry_id

BATCH = 500  # users checked per pipelined round trip


def cluster_epoch(r: redis.Redis) -> int | None:
    """The Cluster's current epoch as a random node reports it (``CLUSTER INFO``: every
    failover raises it; a node that has not heard of the last one yet reports less); None on
    one node, which has no failover (its submit is one transaction)."""
    if not isinstance(r, redis.RedisCluster):
        return None
    return int(r.cluster_info()["cluster_current_epoch"])


def read_recovered(r: redis.Redis) -> int | None:
    """The cluster epoch of the last recovery (any commander's); None if none is recorded."""
    raw = r.get(keys.RECOVERED)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def write_recovered(r: redis.Redis, epoch: int) -> None:
    r.set(keys.RECOVERED, epoch)


def unserved(cursor: Any, newest: Any) -> bool:
    """Whether an inbox holds a turn after the cursor, from ``HGET state cursor`` and the
    inbox's newest entry (``XREVRANGE + - COUNT 1``): a served entry is deleted by its commit,
    so an entry newer than the cursor is one still to serve."""
    if not newest:
        return False
    if not cursor:
        return True
    return entry_id(newest[0][0]) > entry_id(cursor)


def unserved_users(r: redis.Redis, users: list[str]) -> list[str]:
    """Those of ``users`` whose inbox holds a turn after their cursor (one round trip)."""
    return list(unserved_newest(r, users))


def unserved_newest(r: redis.Redis, users: list[str]) -> dict[str, str]:
    """Those of ``users`` whose inbox holds a turn after their cursor, with their inbox's newest
    entry id (one round trip)."""
    pipe = r.pipeline(transaction=False)
    for user in users:
        pipe.hget(keys.state(user), "cursor")
        pipe.xrevrange(keys.inbox(user), "+", "-", count=1)
    replies = pipe.execute()
    return {u: as_str(replies[2 * i + 1][0][0]) for i, u in enumerate(users)
            if unserved(replies[2 * i], replies[2 * i + 1])}


def active_users(r: redis.Redis, pool: str, batch: int = BATCH) -> Iterator[list[str]]:
    """The users of ``pool``'s active set, in lists of ``batch`` (``ZSCAN``: a user in the set
    throughout is seen at least once)."""
    yield from _batches(r.zscan_iter(keys.active(pool), count=batch), batch)


def active_since(r: redis.Redis, pool: str, since: float) -> int:
    """How many users submitted on ``pool`` at or after ``since`` (unix seconds)."""
    return int(r.zcount(keys.active(pool), since, "+inf"))


def notify_on(r: redis.Redis, placed: Mapping[str, tuple[str, int]], now: float) -> None:
    """One fresh notification for each user on its (pool, ready shard), and the user marked
    active there, as a submit does (one round trip)."""
    pipe = r.pipeline(transaction=False)
    for user, (pool, shard) in placed.items():
        pipe.xadd(keys.ready(pool, shard), {"user": user})
        pipe.zadd(keys.active(pool), {user: now})
    pipe.execute()


def _batches(members: Iterable[Any], size: int) -> Iterable[list[str]]:
    """The user ids of a ``ZSCAN``'s (member, score) pairs in lists of ``size``, each once; a
    member that is no valid user id (a raw client's typo) is skipped, never a key."""
    batch: list[str] = []
    seen: set[str] = set()
    for member, _score in members:
        try:
            user = validate_user_id(as_str(member))
        except InvalidId:
            continue
        if user in seen:
            continue
        seen.add(user)
        batch.append(user)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass(frozen=True)
class Renotified:
    """What one tier's recovery did."""

    tier: str
    checked: int = 0  # users of the active set looked at
    users: tuple[str, ...] = ()  # those with a turn after the cursor: one notification each


def renotify_unserved(r: redis.Redis, tier: str, shards: int = 1, batch: int = BATCH) -> Renotified:
    """Post one fresh notification on its ready shard for every user of ``tier``'s active set
    whose inbox holds a turn after the cursor (``ZSCAN``: a user in the set throughout is seen
    at least once). Per batch, one round trip of reads and one of notifications."""
    checked, found = 0, list[str]()
    for users in active_users(r, tier, batch):
        checked += len(users)
        stuck = unserved_users(r, users)
        if not stuck:
            continue
        pipe = r.pipeline(transaction=False)
        for user in stuck:
            pipe.xadd(keys.ready(tier, keys.ready_shard(user, shards)), {"user": user})
        pipe.execute()
        found += stuck
    return Renotified(tier, checked, tuple(found))
