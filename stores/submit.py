"""A turn from the client's side: the submit's commands, its pressure check, the wait for its reply.

On one node the submit is one round trip of one script (``turn_submit.lua``: every inbox entry,
notification and active mark of the batch) and, now and then, the pressure check after it
(``submit_pressure.lua``). On Redis Cluster no script or transaction can span the user's slot
(inbox) and the tier's (ready stream, active set), so the submit is ordered: the inbox entries
first, and only once they are acknowledged their notifications (:func:`submit_ordered`). With
the tier's ``replica_acks`` (:class:`stores.submit_options.SubmitOptions`) a ``WAIT`` follows
the writes on their own connections (``stores.replicas``).

The client builds and validates the turns; every command it sends for them is here, as
operations that run on a blocking or an asyncio client alike (``stores.roundtrips``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
from redis.typing import EncodableT, FieldT

from protocol import keys
from protocol.codec import as_str
from protocol.models import Turn
from stores import functions, replicas
from stores.backlog import queue_submit_gauges
from stores.replicas import Command
from stores.replies import Row, raw_streams, rows
from stores.roundtrips import Op, Pipelined, Single, operation
from stores.submit_options import SubmitOptions

NO_OPTIONS = SubmitOptions()


PRESSURE_CHECK_S = 0.01  # a client checks a tier for pressure at most this often (see below)
PRESSURE_MAXLEN = 10_000  # entries a tier's pressure stream keeps (approximately)


@dataclass(frozen=True)
class Submitted:
    """What a submit read after its writes: on one node whether it ``posted`` a pressure event;
    on a Cluster the gauges (:func:`stores.backlog.no_free_slot` judges them; empty when the
    submit did not check) and, with a ``WAIT``, its reply: the replicas that acknowledged the
    writes (the fewest over the masters written), or the error it failed with; None: no WAIT."""

    gauges: list[Any]
    acked: Any = None
    posted: bool = False


def inbox_fields(turn: Turn, payload: bytes) -> tuple[Any, ...]:
    """A turn's inbox entry: the msgpack ``Turn`` (``m``), and its turn id and tier as plain
    fields, which the worker's scripts read without decoding msgpack (the plain-form fields of
    the same names; a worker decodes ``m`` and checks they agree)."""
    return ("m", payload, "turn_id", turn.turn_id, "tier", turn.tier)


def inbox_command(turn: Turn, payload: bytes) -> tuple[str, Command]:
    """The turn itself: its entry on the user's inbox (the user's slot), and that key."""
    key = keys.inbox(turn.user)
    return key, ("XADD", key, "*", *inbox_fields(turn, payload))


def queue_inbox(pipe: Any, turn: Turn, payload: bytes) -> None:
    pipe.execute_command(*inbox_command(turn, payload)[1])


NOTIFY_COMMANDS = 2  # per turn: the notification and the active mark


def notify_commands(turn: Turn, pool: str, shards: int = 1) -> list[tuple[str, Command]]:
    """What wakes a worker of ``pool`` (the turn's tier, or the pool of its user's group) and
    counts the user: the notification on the user's shard of the pool's ``shards`` ready
    streams (``keys.ready_shard``), the user in the pool's active set (the pool's slot); each
    with its key."""
    ready = keys.ready(pool, keys.ready_shard(turn.user, shards))
    active = keys.active(pool)
    return [(ready, ("XADD", ready, "*", "user", turn.user)), (active, ("ZADD", active, turn.ts, turn.user))]


def queue_notify(pipe: Any, turn: Turn, pool: str, shards: int = 1) -> None:
    for _key, cmd in notify_commands(turn, pool, shards):
        pipe.execute_command(*cmd)


# --- one node: one script, one round trip --------------------------------------------------
def submit_call(built: list[tuple[Turn, bytes]], tier: str, shards: int = 1,
                retention_ms: int = 0) -> Command:
    """The ``FCALL`` of ``turn_submit.lua`` for ``built`` (every inbox entry and notification,
    then the active marks, in one atomic call)."""
    ks = [keys.active(tier)] + [keys.inbox(t.user) for t, _ in built] + [
        keys.ready(tier, keys.ready_shard(t.user, shards)) for t, _ in built]
    args: list[Any] = [len(built)]
    for turn, payload in built:
        args += [turn.user, turn.ts, turn.turn_id, turn.tier, payload]
    if retention_ms > 0:
        args.append(retention_ms)
    return functions.command("turn_submit", ks, args)


def pressure_call(tier: str, shard: int, event: Mapping[str, str]) -> Command:
    """The ``FCALL`` of ``submit_pressure.lua``: a pressure event posted if the lag of ready
    shard ``shard`` exceeds the starting slots."""
    ks = [keys.ready(tier, shard), keys.starting(tier), keys.pressure(tier)]
    fields = [x for k, v in event.items() for x in (k, v)]
    return functions.command("submit_pressure", ks, [keys.GROUP, PRESSURE_MAXLEN, *fields])


def queue_round_trip(pipe: Any, built: list[tuple[Turn, bytes]], tier: str,
                     opts: SubmitOptions = NO_OPTIONS, pressure: Mapping[str, str] | None = None) -> None:
    """The single-node submit: the script; the ``WAIT`` if asked (on the script's connection:
    it counts its writes); the pressure check if ``pressure`` (the event to post) is given.

    The check is its own call after the submit, not inside it: Redis hands a new notification
    to a worker blocked in ``XREADGROUP`` when the command that wrote it ends, so only a lag
    read after it means no worker could take it. A client sends it at most once per
    ``PRESSURE_CHECK_S`` per tier (``fleet.client``): no ``XINFO`` on every submit; a burst the
    check misses is seen by the commander's next pass (its backlog), at most 0.5 s later."""
    pipe.execute_command(*submit_call(built, tier, opts.shards, opts.retention_ms))
    if opts.wait is not None:
        pipe.wait(opts.wait.replicas, opts.wait.timeout_ms)
    if pressure is not None and built:
        pipe.execute_command(*pressure_call(tier, keys.ready_shard(built[-1][0].user, opts.shards), pressure))


@operation
def submit_turns(built: list[tuple[Turn, bytes]], tier: str, opts: SubmitOptions = NO_OPTIONS,
                 pressure: Mapping[str, str] | None = None, *, cluster: bool) -> Op[Submitted]:
    """Submit ``built``; with ``pressure``, check the tier and post that event if it is due.

    On one node (:func:`submit_one_node`): one script and round trip (``WAIT`` after it, if
    asked). On Redis Cluster
    (``cluster``): the ordered submit of :func:`submit_ordered`, two round trips (three with a
    ``WAIT``), no script.
    """
    if cluster:
        return (yield from submit_ordered(built, tier, opts, pressure is not None))
    return (yield from submit_one_node(built, tier, opts, pressure))


def submit_one_node(built: list[tuple[Turn, bytes]], tier: str, opts: SubmitOptions = NO_OPTIONS,
                    pressure: Mapping[str, str] | None = None) -> Op[Submitted]:
    """The single-node submit (:func:`queue_round_trip`); :class:`~stores.functions.LibraryMissing`
    when Redis has not this version's functions library (nothing was written).

    With nothing to send beside the script (no ``WAIT``, no pressure check due: nearly every
    submit) the script goes out as one command: redis-py's pipeline costs the client more CPU
    than the command itself (``scripts/bench_client``). Its error reply is then taken as the
    pipeline hands one over (any other error is raised either way)."""
    if opts.wait is None and pressure is None:
        call = submit_call(built, tier, opts.shards, opts.retention_ms)
        try:
            results = [(yield Single(lambda r: r.execute_command(*call)))]
        except redis.ResponseError as exc:
            results = [exc]
    else:
        results = yield Pipelined(lambda pipe: queue_round_trip(pipe, built, tier, opts, pressure),
                                  raise_on_error=False)
    if any(functions.is_missing(res) for res in results):
        raise functions.LibraryMissing(functions.missing_line())
    return committed(results, opts.wait is not None, pressure is not None)


def committed(results: list[Any], waited: bool = False, checked: bool = False) -> Submitted:
    """Raise the submit's error, if any; return what was read after it.

    ``results`` are the round trip's replies: the script's (the entry ids, or its error: then
    nothing was written, the script checks its arguments first and a refused ``XADD`` is its
    first write), the ``WAIT``'s if ``waited``, the pressure check's if ``checked``.
    """
    applied = results[0]
    if isinstance(applied, Exception):
        raise applied
    acked = results[1] if waited else None
    posted = bool(checked and not isinstance(results[-1], Exception) and int(results[-1]) == 1)
    return Submitted([], acked, posted)


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


def submit_ordered(built: list[tuple[Turn, bytes]], tier: str, opts: SubmitOptions = NO_OPTIONS,
                   gauges: bool = True) -> Op[Submitted]:
    """The submit on Redis Cluster; return the gauges read after it.

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
      path raises an error of its script, the rest applied). Round trip 1 failing as a whole
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
        inboxed = yield Pipelined(lambda pipe: queue_inboxes(pipe, built), raise_on_error=False)
    else:
        inboxed, acked1 = yield from replicas.on_node([inbox_command(t, p) for t, p in built], wait)
    written, refused = inbox_written(inboxed, built)
    acked2: list[Any] = []
    try:
        if wait is None:
            def notify(pipe: Any) -> None:
                queue_notifications(pipe, written, tier, opts.shards, gauges)

            results = yield Pipelined(notify, raise_on_error=False)
        else:
            results, acked2 = yield from replicas.on_node(_notifications(written, tier, opts.shards), wait)
            if gauges:
                shard = _last_shard(written, opts.shards)
                results += (yield Pipelined(lambda pipe: queue_submit_gauges(pipe, tier, shard),
                                            raise_on_error=False))
    except Exception as exc:  # RedisClusterException is no RedisError: whatever it is, unnotified
        raise SubmitNotNotified(written, exc) from exc
    read = notified(results, written, refused, gauges)
    if opts.retention_ms > 0:  # the tier's retention: each inbox expires after its last submit
        yield Pipelined(lambda pipe: [pipe.pexpire(keys.inbox(t.user), opts.retention_ms) for t in written],
                        raise_on_error=False)
    return Submitted(read) if wait is None else Submitted(read, replicas.fewest(acked1 + acked2))


def _notifications(written: list[Turn], pool: str, shards: int) -> list[tuple[str, Command]]:
    return [cmd for turn in written for cmd in notify_commands(turn, pool, shards)]


def _last_shard(written: list[Turn], shards: int) -> int:
    """The ready shard of the batch's last turn: the gauges read its lag."""
    return keys.ready_shard(written[-1].user, shards) if written else 0


def queue_inboxes(pipe: Any, built: list[tuple[Turn, bytes]]) -> None:
    """Round trip 1 of the ordered submit: every inbox entry of the batch."""
    for turn, payload in built:
        queue_inbox(pipe, turn, payload)


def queue_notifications(pipe: Any, written: list[Turn], tier: str, shards: int = 1,
                        gauges: bool = True) -> None:
    """Round trip 2 of the ordered submit: the notifications and active marks, then the gauges
    (when this submit checks for pressure: at most every ``PRESSURE_CHECK_S``, see
    :func:`queue_round_trip`)."""
    for turn in written:
        queue_notify(pipe, turn, tier, shards)
    if gauges:
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


def notified(results: Any, written: list[Turn], refused: Exception | None,
             gauges: bool = True) -> list[Any]:
    """Check round trip 2 of the ordered submit and return its gauges.

    Raises :class:`SubmitNotNotified` if a notification or active mark failed, else the first
    inbox refusal of round trip 1 if there was one.
    """
    queued = NOTIFY_COMMANDS * len(written)
    if not isinstance(results, list) or len(results) != queued + (2 if gauges else 0):
        raise SubmitNotNotified(written, redis.ResponseError(
            f"unexpected replies to the submit's notifications: {results!r}"))
    failed = next((res for res in results[:queued] if isinstance(res, Exception)), None)
    if failed is not None:
        raise SubmitNotNotified(written, failed) from failed
    if refused is not None:
        raise refused
    return results[queued:]


# --- around the submit --------------------------------------------------------------------
@operation
def post_pressure(tier: str, fields: Mapping[str, str]) -> Op[None]:
    """Append a pressure event to the tier's stream (it wakes the commander): on a Cluster,
    where the submit reads the gauges and the client judges them."""
    entry: dict[FieldT, EncodableT] = {k: v for k, v in fields.items()}  # a dict is invariant in its key
    yield Single(lambda r: r.xadd(keys.pressure(tier), entry, maxlen=PRESSURE_MAXLEN, approximate=True))


@operation
def wait_reply(user: str, turn_id: str, timeout: float) -> Op[Any]:
    """The raw reply of a turn (``BLPOP`` up to ``timeout`` s), or None if none came."""
    got = yield Single(lambda r: r.blpop([keys.reply(user, turn_id)], timeout=max(timeout, 0.01)))
    return None if got is None else got[1]


@operation
def read_stream(user: str, turn_id: str, after: str, block_ms: int) -> Op[tuple[list[Row], Any]]:
    """A streamed turn's entries after ``after`` (``XREAD BLOCK`` up to ``block_ms``, at least 1)
    and, in the same round trip, its reply if it is there (``LPOP``: taken, as ``BLPOP`` takes
    it). The reply is written with the stream's ``end`` entry, so a reply found with no ``end``
    read yet means entries are left to read (:func:`read_stream_rest`), or that the turn was
    answered without one (a turn that never decoded as a streamed one)."""
    stream, reply = keys.stream(user, turn_id), keys.reply(user, turn_id)

    def queue(pipe: Any) -> None:
        pipe.xread({stream: after}, block=max(1, block_ms))
        pipe.lpop(reply)

    got, raw = yield Pipelined(queue)
    return [row for _name, entries in raw_streams(got) for row in rows(entries)], raw


@operation
def read_streams(after: Mapping[str, str], block_ms: int) -> Op[dict[str, list[Row]]]:
    """Several reply streams' entries, each after its own ``after`` id, in one ``XREAD BLOCK``
    (up to ``block_ms``, at least 1): stream key -> its new entries (streams with none are left
    out). One node only: the keys are in their users' slots, which a Cluster refuses in one
    read (there each stream reads on its own, :func:`read_stream`)."""
    got = yield Single(lambda r: r.xread(dict(after), block=max(1, block_ms)))
    return {as_str(name): rows(entries) for name, entries in raw_streams(got)}


@operation
def read_stream_rest(user: str, turn_id: str, after: str) -> Op[list[Row]]:
    """A streamed turn's entries after ``after``, without waiting."""
    return rows((yield Single(lambda r: r.xrange(keys.stream(user, turn_id), min=f"({after}", max="+"))))
