"""The submit's commands (DESIGN §3, ``fleet/client.py`` explains them): on one node one round
trip of ``MULTI`` .. ``EXEC`` then the gauges; on Redis Cluster two round trips, the inbox
entries first and only then their notifications (:func:`submit_ordered`); the tier probe,
pressure events and the reply wait.

The client builds and validates the turns; every Redis command it sends is queued or sent
here, on a blocking or an asyncio client alike (the pipeline functions take either).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from protocol import keys
from protocol.codec import CodecError, as_str, decode
from protocol.ids import InvalidId
from protocol.models import Turn, WorkerInfo
from stores.backlog import queue_submit_gauges
from stores.cluster import is_cluster

PRESSURE_MAXLEN = 10_000


def queue_inbox(pipe: Any, turn: Turn, payload: bytes) -> None:
    """The turn itself: its entry on the user's inbox (the user's slot)."""
    pipe.xadd(keys.inbox(turn.user), {"m": payload})


NOTIFY_COMMANDS = 2  # per turn: the notification and the active mark


def queue_notify(pipe: Any, turn: Turn, shards: int = 1) -> None:
    """What wakes a worker and counts the user: the notification on the user's shard of the
    tier's ``shards`` ready streams (``keys.ready_shard``), the user in the tier's active set
    (tier-wide, the tier's slot)."""
    pipe.xadd(keys.ready(turn.tier, keys.ready_shard(turn.user, shards)), {"user": turn.user})
    pipe.zadd(keys.active(turn.tier), {turn.user: turn.ts})


def queue_submit(pipe: Any, turn: Turn, payload: bytes, shards: int = 1) -> None:
    queue_inbox(pipe, turn, payload)
    queue_notify(pipe, turn, shards)


SUBMIT_COMMANDS = 1 + NOTIFY_COMMANDS  # per turn, inside the transaction


def submit_pipeline(r: Any) -> Any:
    """A plain pipeline to carry ``MULTI`` .. ``EXEC`` and then the gauges, in one round trip.

    redis-py's ``transaction=True`` would put the gauges inside the transaction too (see the
    module docstring). Inside ``MULTI`` every reply is ``+QUEUED`` and the real ones come in
    ``EXEC``'s array, so no response callback may parse them (redis-py's RESP2 ``ZADD`` one
    would choke on ``QUEUED``): only the gauge that needs one keeps it.
    """
    pipe = r.pipeline(transaction=False)
    pipe.response_callbacks = {name: r.response_callbacks[name] for name in ("XINFO GROUPS",)
                               if name in r.response_callbacks}
    return pipe


def queue_round_trip(pipe: Any, built: list[tuple[Turn, bytes]], tier: str, shards: int = 1) -> None:
    pipe.execute_command("MULTI")
    for turn, payload in built:
        queue_submit(pipe, turn, payload, shards)
    pipe.execute_command("EXEC")
    queue_submit_gauges(pipe, tier, keys.ready_shard(built[-1][0].user, shards) if built else 0)


def submit_round_trip(r: redis.Redis, built: list[tuple[Turn, bytes]], tier: str,
                      shards: int = 1) -> list[Any]:
    """Submit ``built``; return the gauges read after it.

    On one node: one transaction and round trip. On Redis Cluster (:func:`is_cluster`): the
    ordered submit of :func:`submit_ordered`, two round trips, no ``MULTI``.
    """
    if is_cluster(r):
        return submit_ordered(r, built, tier, shards)
    pipe = submit_pipeline(r)
    queue_round_trip(pipe, built, tier, shards)
    return committed(pipe.execute(raise_on_error=False), len(built))


async def submit_round_trip_async(r: aioredis.Redis, built: list[tuple[Turn, bytes]],
                                  tier: str, shards: int = 1) -> list[Any]:
    """:func:`submit_round_trip` on an asyncio client."""
    if is_cluster(r):
        return await submit_ordered_async(r, built, tier, shards)
    pipe = submit_pipeline(r)
    queue_round_trip(pipe, built, tier, shards)
    return committed(await pipe.execute(raise_on_error=False), len(built))


def committed(results: list[Any], turns: int) -> list[Any]:
    """Raise the first error of the submit transaction; return the gauges read after it.

    ``results`` are the round trip's replies: ``MULTI``, one ``QUEUED`` per command, ``EXEC``,
    then the gauges. A command refused when queued (``NOPERM``, a syntax error) makes Redis
    discard the whole transaction (``EXECABORT``): that first refusal is the one raised.
    """
    queued = 1 + SUBMIT_COMMANDS * turns
    _raise_first_error(results[:queued])
    applied = results[queued]
    if isinstance(applied, Exception):
        raise applied
    if not isinstance(applied, list) or len(applied) != queued - 1:
        raise redis.ResponseError(f"unexpected reply to the submit's EXEC: {applied!r}")
    _raise_first_error(applied)
    return results[queued + 1:]


# --- the ordered submit (Redis Cluster) --------------------------------------------------
class SubmitNotNotified(redis.RedisError):
    """An ordered submit (Redis Cluster) wrote ``turns`` to their users' inboxes, but writing
    their notifications failed, or its outcome is unknown: the turns are queued, unannounced.

    Each is served, in its user's order, as soon as anything notifies its user: the user's next
    submit (a worker woken for the user reads the whole inbox after the cursor, oldest first),
    or the caller's retry. A retry with the same ``turn_id`` (``submit(..., turn_id=t.turn_id)``)
    is answered once: the worker's write-back skips a turn id that is already in the user's
    done-set (``turn_commit.lua`` returns ``dup``, moves the cursor past the copy, writes no
    second reply or session entry); the done-set keeps the last ``done_keep`` turn ids of the
    user. A retry with a new turn id is a second turn. The underlying error is ``__cause__``.
    """

    def __init__(self, turns: list[Turn], cause: BaseException) -> None:
        self.turns = turns
        super().__init__(f"{len(turns)} turn(s) written to the inbox but not notified "
                         f"({type(cause).__name__}: {cause}); "
                         "the user's next submit serves them in order, or retry with the same "
                         "turn_id (answered once)")


def submit_ordered(r: Any, built: list[tuple[Turn, bytes]], tier: str, shards: int = 1) -> list[Any]:
    """The submit on Redis Cluster; return the gauges read after it (DESIGN §3).

    A turn's inbox entry lives in the user's slot, its notification and active mark in the
    tier's: no transaction can hold both, and redis-py's async cluster pipeline sends each
    node's batch concurrently, so a notification could overtake its turn (the worker finds the
    inbox empty, acks, and the turn waits for the user's next submit). So round trip 1 writes
    every inbox entry of the batch and waits for their replies; round trip 2 writes the
    notifications and active marks of the turns whose entry was acknowledged, then reads the
    gauges (the lag of the last turn's ready shard: on that shard's node, after our
    notification there, in order, as on one node). No ``MULTI``: a cluster pipeline refuses it.

    - An inbox ``XADD`` refused: that turn is not submitted and gets no notification; the
      others of the batch are notified, then the first refusal is raised (as the single-node
      path raises an error of its ``EXEC``, the rest applied). Round trip 1 failing as a whole
      (a connection lost) raises it and notifies nothing; an entry that did land in spite of it
      waits, in order, for its user's next submit.
    - Round trip 2 failing (inbox written, notification not): :class:`SubmitNotNotified`,
      naming the turns; it says what becomes of them.
    """
    pipe = r.pipeline(transaction=False)
    queue_inboxes(pipe, built)
    written, refused = inbox_written(pipe.execute(raise_on_error=False), built)
    pipe = r.pipeline(transaction=False)
    queue_notifications(pipe, written, tier, shards)
    try:
        results = pipe.execute(raise_on_error=False)
    except Exception as exc:  # RedisClusterException is no RedisError: whatever it is, unnotified
        raise SubmitNotNotified(written, exc) from exc
    return notified(results, written, refused)


async def submit_ordered_async(r: Any, built: list[tuple[Turn, bytes]], tier: str,
                               shards: int = 1) -> list[Any]:
    """:func:`submit_ordered` on an asyncio client."""
    pipe = r.pipeline(transaction=False)
    queue_inboxes(pipe, built)
    written, refused = inbox_written(await pipe.execute(raise_on_error=False), built)
    pipe = r.pipeline(transaction=False)
    queue_notifications(pipe, written, tier, shards)
    try:
        results = await pipe.execute(raise_on_error=False)
    except Exception as exc:
        raise SubmitNotNotified(written, exc) from exc
    return notified(results, written, refused)


def queue_inboxes(pipe: Any, built: list[tuple[Turn, bytes]]) -> None:
    """Round trip 1 of the ordered submit: every inbox entry of the batch."""
    for turn, payload in built:
        queue_inbox(pipe, turn, payload)


def queue_notifications(pipe: Any, written: list[Turn], tier: str, shards: int = 1) -> None:
    """Round trip 2 of the ordered submit: the notifications and active marks, then the gauges."""
    for turn in written:
        queue_notify(pipe, turn, shards)
    queue_submit_gauges(pipe, tier, keys.ready_shard(written[-1].user, shards) if written else 0)


def inbox_written(results: Any, built: list[tuple[Turn, bytes]]) -> tuple[list[Turn], Exception | None]:
    """The turns of ``built`` whose inbox ``XADD`` was acknowledged, in order, and the first
    refusal; if every entry was refused, that refusal is raised (there is nothing to notify)."""
    if not isinstance(results, list) or len(results) != len(built):
        raise redis.ResponseError(f"unexpected replies to the submit's inbox entries: {results!r}")
    written = [turn for (turn, _), res in zip(built, results, strict=True) if not isinstance(res, Exception)]
    refused = next((res for res in results if isinstance(res, Exception)), None)
    if refused is not None and not written:
        raise refused
    return written, refused


def notified(results: Any, written: list[Turn], refused: Exception | None) -> list[Any]:
    """Check round trip 2 of the ordered submit and return its gauges.

    Raises :class:`SubmitNotNotified` if a notification or active mark failed, else the first
    inbox refusal of round trip 1 if there was one.
    """
    queued = NOTIFY_COMMANDS * len(written)
    if not isinstance(results, list) or len(results) != queued + 2:
        raise SubmitNotNotified(written, redis.ResponseError(
            f"unexpected replies to the submit's notifications: {results!r}"))
    failed = next((res for res in results[:queued] if isinstance(res, Exception)), None)
    if failed is not None:
        raise SubmitNotNotified(written, failed) from failed
    if refused is not None:
        raise refused
    return results[queued:]


# --- how many ready shards? ---------------------------------------------------------------
SHARDS_TTL_S = 5.0  # a client reads the tier's ready_shards again after this long


def queue_shards_probe(pipe: Any, tier: str) -> None:
    """The tier's policy key and its last good copy: :func:`ready_shards_of` reads them."""
    pipe.get(keys.policy(tier))
    pipe.get(keys.policy_good(tier))


def ready_shards_of(raw: Any, good: Any) -> int:
    """``ready_shards`` of the policy JSON ``raw`` (else of ``good``, the last valid one), in
    1..``keys.MAX_READY_SHARDS``; 1 when neither names it. Lenient on purpose: a submit that
    uses a stale or odd count is still served (every worker of the tier reads every shard that
    exists, up to the bound), only its shard may differ from the policy's."""
    for blob in (raw, good):
        if not blob:
            continue
        try:
            n = json.loads(blob).get("ready_shards", 1)
        except (ValueError, AttributeError, RecursionError):
            continue
        if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= keys.MAX_READY_SHARDS:
            return n
    return 1


def read_ready_shards(r: redis.Redis, tier: str) -> int:
    """The tier's ``ready_shards`` (:func:`ready_shards_of`), in one round trip."""
    pipe = r.pipeline(transaction=False)
    queue_shards_probe(pipe, tier)
    return ready_shards_of(*pipe.execute())


async def read_ready_shards_async(r: aioredis.Redis, tier: str) -> int:
    """:func:`read_ready_shards` on an asyncio client."""
    pipe = r.pipeline(transaction=False)
    queue_shards_probe(pipe, tier)
    return ready_shards_of(*await pipe.execute())


# --- does the tier exist? ---------------------------------------------------------------
def queue_tier_probe(pipe: Any, tier: str) -> None:
    pipe.exists(keys.policy(tier))
    pipe.smembers(keys.TIERS)  # not SISMEMBER: the documented ACL (SECURITY.md) grants SMEMBERS
    pipe.hgetall(keys.WORKERS)


def read_tier_probe(r: redis.Redis, tier: str) -> list[Any]:
    """``[has_policy, tiers, registry]`` of :func:`queue_tier_probe`, in one round trip."""
    pipe = r.pipeline(transaction=False)
    queue_tier_probe(pipe, tier)
    return pipe.execute()


async def read_tier_probe_async(r: aioredis.Redis, tier: str) -> list[Any]:
    """:func:`read_tier_probe` on an asyncio client."""
    pipe = r.pipeline(transaction=False)
    queue_tier_probe(pipe, tier)
    return await pipe.execute()


def tier_defined(tier: str, has_policy: Any, tiers: Iterable[Any]) -> bool:
    """Whether the tier has a policy key or ``fleet:tiers`` names it."""
    return bool(has_policy) or tier in {as_str(t) for t in tiers}


def heartbeats_of(tier: str, registry: Mapping[Any, Any]) -> list[str]:
    """Heartbeat keys of the registered workers of ``tier`` (``fleet:workers``, as in
    ``stores.registry``: the worker is live while its key exists); unreadable entries are skipped."""
    beats = []
    for blob in registry.values():
        try:
            info = decode(WorkerInfo, blob)
            if info.tier == tier:
                beats.append(keys.heartbeat(info.worker))
        except (CodecError, InvalidId):
            continue
    return beats


def _raise_first_error(results: list[Any]) -> None:
    for res in results:
        if isinstance(res, Exception):
            raise res


def post_pressure(r: redis.Redis, tier: str, fields: Mapping[str, str]) -> None:
    """Append a pressure event to the tier's stream (it wakes the commander)."""
    entry: dict[FieldT, EncodableT] = {k: v for k, v in fields.items()}  # a dict is invariant in its key
    r.xadd(keys.pressure(tier), entry, maxlen=PRESSURE_MAXLEN, approximate=True)


async def post_pressure_async(r: aioredis.Redis, tier: str, fields: Mapping[str, str]) -> None:
    """:func:`post_pressure` on an asyncio client."""
    entry: dict[FieldT, EncodableT] = {k: v for k, v in fields.items()}  # a dict is invariant in its key
    await r.xadd(keys.pressure(tier), entry, maxlen=PRESSURE_MAXLEN, approximate=True)


def any_beating(r: redis.Redis, beats: list[str]) -> bool:
    """Whether any of the heartbeat keys ``beats`` exists: one ``EXISTS`` per key (each worker's
    key has its own slot), pipelined in one round trip."""
    if not beats:
        return False
    pipe = r.pipeline(transaction=False)
    for beat in beats:
        pipe.exists(beat)
    return any(int(n) for n in pipe.execute())


async def any_beating_async(r: aioredis.Redis, beats: list[str]) -> bool:
    """:func:`any_beating` on an asyncio client."""
    if not beats:
        return False
    pipe = r.pipeline(transaction=False)
    for beat in beats:
        pipe.exists(beat)
    return any(int(n) for n in await pipe.execute())


def wait_reply(r: redis.Redis, user: str, turn_id: str, timeout: float) -> Any:
    """The raw reply of a turn (``BLPOP`` up to ``timeout`` s), or None if none came."""
    got = r.blpop([keys.reply(user, turn_id)], timeout=max(timeout, 0.01))
    return None if got is None else got[1]


async def wait_reply_async(r: aioredis.Redis, user: str, turn_id: str, timeout: float) -> Any:
    """:func:`wait_reply` on an asyncio client."""
    got = await r.blpop([keys.reply(user, turn_id)], timeout=max(timeout, 0.01))
    return None if got is None else got[1]
