"""The submit's commands (DESIGN §3, ``fleet/client.py`` explains them): on one node one round
trip of ``MULTI`` .. ``EXEC`` then the gauges; on Redis Cluster two round trips, the inbox
entries first and only then their notifications (:func:`submit_ordered`). With the tier's
``replica_acks`` (:class:`stores.tier_probe.SubmitOptions`), a ``WAIT`` follows the writes on
their own connections (``stores.replicas``). The tier probe, pressure events and the reply
wait are in ``stores.tier_probe``.

The client builds and validates the turns; every Redis command it sends is queued or sent
here, on a blocking or an asyncio client alike (the pipeline functions take either).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from protocol import keys
from protocol.models import Turn
from stores import replicas
from stores.backlog import queue_submit_gauges
from stores.cluster import is_cluster
from stores.replicas import Command
from stores.tier_probe import SubmitOptions

NO_OPTIONS = SubmitOptions()


@dataclass(frozen=True)
class Submitted:
    """What a submit read after its writes: the gauges (:func:`stores.backlog.no_free_slot`
    judges them) and, with a ``WAIT``, its reply: the replicas that acknowledged the writes
    (the fewest over the masters written), or the error it failed with; None: no WAIT sent."""

    gauges: list[Any]
    acked: Any = None

def inbox_command(turn: Turn, payload: bytes) -> tuple[str, Command]:
    """The turn itself: its entry on the user's inbox (the user's slot), and that key."""
    key = keys.inbox(turn.user)
    return key, ("XADD", key, "*", "m", payload)


def queue_inbox(pipe: Any, turn: Turn, payload: bytes) -> None:
    pipe.execute_command(*inbox_command(turn, payload)[1])


NOTIFY_COMMANDS = 2  # per turn: the notification and the active mark


def notify_commands(turn: Turn, shards: int = 1) -> list[tuple[str, Command]]:
    """What wakes a worker and counts the user: the notification on the user's shard of the
    tier's ``shards`` ready streams (``keys.ready_shard``), the user in the tier's active set
    (tier-wide, the tier's slot); each with its key."""
    ready = keys.ready(turn.tier, keys.ready_shard(turn.user, shards))
    active = keys.active(turn.tier)
    return [(ready, ("XADD", ready, "*", "user", turn.user)), (active, ("ZADD", active, turn.ts, turn.user))]


def queue_notify(pipe: Any, turn: Turn, shards: int = 1) -> None:
    for _key, cmd in notify_commands(turn, shards):
        pipe.execute_command(*cmd)


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


def queue_round_trip(pipe: Any, built: list[tuple[Turn, bytes]], tier: str,
                     opts: SubmitOptions = NO_OPTIONS) -> None:
    pipe.execute_command("MULTI")
    for turn, payload in built:
        queue_submit(pipe, turn, payload, opts.shards)
    pipe.execute_command("EXEC")
    if opts.wait is not None:  # on the transaction's connection: WAIT counts its writes
        pipe.wait(opts.wait.replicas, opts.wait.timeout_ms)
    queue_submit_gauges(pipe, tier, keys.ready_shard(built[-1][0].user, opts.shards) if built else 0)


def submit_round_trip(r: redis.Redis, built: list[tuple[Turn, bytes]], tier: str,
                      opts: SubmitOptions = NO_OPTIONS) -> Submitted:
    """Submit ``built``; return what was read after it.

    On one node: one transaction and round trip (``WAIT`` after ``EXEC`` in it, if asked). On
    Redis Cluster (:func:`is_cluster`): the ordered submit of :func:`submit_ordered`, two
    round trips (three with a ``WAIT``), no ``MULTI``.
    """
    if is_cluster(r):
        return submit_ordered(r, built, tier, opts)
    pipe = submit_pipeline(r)
    queue_round_trip(pipe, built, tier, opts)
    return committed(pipe.execute(raise_on_error=False), len(built), opts.wait is not None)


async def submit_round_trip_async(r: aioredis.Redis, built: list[tuple[Turn, bytes]],
                                  tier: str, opts: SubmitOptions = NO_OPTIONS) -> Submitted:
    """:func:`submit_round_trip` on an asyncio client."""
    if is_cluster(r):
        return await submit_ordered_async(r, built, tier, opts)
    pipe = submit_pipeline(r)
    queue_round_trip(pipe, built, tier, opts)
    return committed(await pipe.execute(raise_on_error=False), len(built), opts.wait is not None)


def committed(results: list[Any], turns: int, waited: bool = False) -> Submitted:
    """Raise the first error of the submit transaction; return what was read after it.

    ``results`` are the round trip's replies: ``MULTI``, one ``QUEUED`` per command, ``EXEC``,
    the ``WAIT`` if ``waited``, then the gauges. A command refused when queued (``NOPERM``, a
    syntax error) makes Redis discard the whole transaction (``EXECABORT``): that first refusal
    is the one raised.
    """
    queued = 1 + SUBMIT_COMMANDS * turns
    _raise_first_error(results[:queued])
    applied = results[queued]
    if isinstance(applied, Exception):
        raise applied
    if not isinstance(applied, list) or len(applied) != queued - 1:
        raise redis.ResponseError(f"unexpected reply to the submit's EXEC: {applied!r}")
    _raise_first_error(applied)
    after = results[queued + 1:]
    return Submitted(after[1:], after[0]) if waited else Submitted(after)


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


def submit_ordered(r: Any, built: list[tuple[Turn, bytes]], tier: str,
                   opts: SubmitOptions = NO_OPTIONS) -> Submitted:
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

    With ``opts.wait`` (the tier's ``replica_acks``), each round trip's writes go to each
    master down one of its connections followed by ``WAIT`` (``stores.replicas.on_node``):
    the inbox entries reach their replicas before any notification is written, and the
    notifications theirs before the gauges are read (a third round trip: the gauges cannot
    ride a node's own pipeline). ``Submitted.acked`` is the fewest replicas any WAIT got.
    """
    wait, acked1 = opts.wait, list[Any]()
    if wait is None:
        pipe = r.pipeline(transaction=False)
        queue_inboxes(pipe, built)
        inboxed = pipe.execute(raise_on_error=False)
    else:
        inboxed, acked1 = replicas.on_node(r, [inbox_command(t, p) for t, p in built], wait)
    written, refused = inbox_written(inboxed, built)
    acked2: list[Any] = []
    try:
        pipe = r.pipeline(transaction=False)
        if wait is None:
            queue_notifications(pipe, written, tier, opts.shards)
            results = pipe.execute(raise_on_error=False)
        else:
            notes, acked2 = replicas.on_node(r, _notifications(written, opts.shards), wait)
            queue_submit_gauges(pipe, tier, _last_shard(written, opts.shards))
            results = notes + pipe.execute(raise_on_error=False)
    except Exception as exc:  # RedisClusterException is no RedisError: whatever it is, unnotified
        raise SubmitNotNotified(written, exc) from exc
    gauges = notified(results, written, refused)
    return Submitted(gauges) if wait is None else Submitted(gauges, replicas.fewest(acked1 + acked2))


async def submit_ordered_async(r: Any, built: list[tuple[Turn, bytes]], tier: str,
                               opts: SubmitOptions = NO_OPTIONS) -> Submitted:
    """:func:`submit_ordered` on an asyncio client (each master's share sent concurrently)."""
    wait, acked1 = opts.wait, list[Any]()
    if wait is None:
        pipe = r.pipeline(transaction=False)
        queue_inboxes(pipe, built)
        inboxed = await pipe.execute(raise_on_error=False)
    else:
        inboxed, acked1 = await replicas.on_node_async(r, [inbox_command(t, p) for t, p in built], wait)
    written, refused = inbox_written(inboxed, built)
    acked2: list[Any] = []
    try:
        pipe = r.pipeline(transaction=False)
        if wait is None:
            queue_notifications(pipe, written, tier, opts.shards)
            results = await pipe.execute(raise_on_error=False)
        else:
            notes, acked2 = await replicas.on_node_async(r, _notifications(written, opts.shards), wait)
            queue_submit_gauges(pipe, tier, _last_shard(written, opts.shards))
            results = notes + await pipe.execute(raise_on_error=False)
    except Exception as exc:
        raise SubmitNotNotified(written, exc) from exc
    gauges = notified(results, written, refused)
    return Submitted(gauges) if wait is None else Submitted(gauges, replicas.fewest(acked1 + acked2))


def _notifications(written: list[Turn], shards: int) -> list[tuple[str, Command]]:
    return [cmd for turn in written for cmd in notify_commands(turn, shards)]


def _last_shard(written: list[Turn], shards: int) -> int:
    """The ready shard of the batch's last turn: the gauges read its lag."""
    return keys.ready_shard(written[-1].user, shards) if written else 0


def queue_inboxes(pipe: Any, built: list[tuple[Turn, bytes]]) -> None:
    """Round trip 1 of the ordered submit: every inbox entry of the batch."""
    for turn, payload in built:
        queue_inbox(pipe, turn, payload)


def queue_notifications(pipe: Any, written: list[Turn], tier: str, shards: int = 1) -> None:
    """Round trip 2 of the ordered submit: the notifications and active marks, then the gauges."""
    for turn in written:
        queue_notify(pipe, turn, shards)
    queue_submit_gauges(pipe, tier, _last_shard(written, shards))


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


def _raise_first_error(results: list[Any]) -> None:
    for res in results:
        if isinstance(res, Exception):
            raise res
