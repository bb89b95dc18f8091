"""The Python client: ``Fleet`` (blocking) and ``AsyncFleet`` (asyncio) submit turns and wait
for their replies.

A submit checks once per client that its tier exists (``UnknownTier`` otherwise, before
anything is written, unless ``create_tier=True`` writes the tier's default policy), takes the
tier's submit options (ready shards, replica acks, groups; read again every ``OPTIONS_TTL_S``),
and sends the turns with ``stores.submit``: one script call on one node, inbox entries before
their notifications on Redis Cluster. Both classes run the same :class:`_ClientCore`, whose
operations yield their round trips: ``Fleet`` sends them on a blocking client, ``AsyncFleet``
on an asyncio one (``stores.roundtrips``).

``stream`` submits a streamed turn and reads its reply stream (:class:`TurnStream`): the text
as the handler emits it, a :class:`Restart` when an attempt starts over, then the ``Reply``.

A submit that meets a transient error (Redis away, a Cluster failover: :func:`transient`) is
sent again, with the same turn ids, for up to ``retry_s`` (10 s): a turn id is answered once
however often it was submitted, so the caller sees an error only when the outcome stays unknown
after that. A reply wait cut by a lost connection waits on until its own timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError
from tenacity import AsyncRetrying, Retrying, retry_if_exception, stop_after_delay

from fleet.stream_hub import StreamHub
from protocol import keys
from protocol.codec import as_str, decode, encode
from protocol.ids import validate_tier, validate_user_id
from protocol.models import MAX_TEXT_CHARS, Reply, Turn
from protocol.policy import TurnsPolicy
from stores.backlog import no_free_slot
from stores.cancel import Cancel, cancel_turn
from stores.cluster import is_cluster
from stores.connection import HandshakeTimeout, NoFleetFound, connect_async, connect_sync
from stores.erase import Erased, connection_user, delete_user, who
from stores.policies import write_policy
from stores.redis_errors import error_kind
from stores.replicas import ReplicaAcks
from stores.retry import TRANSIENT, Backoff
from stores.roles import process_url
from stores.roundtrips import Op, arun, run
from stores.submit import (
    PRESSURE_CHECK_S,
    SubmitNotNotified,
    Submitted,
    post_pressure,
    read_stream,
    read_stream_rest,
    submit_turns,
    wait_reply,
)
from stores.submit_options import OPTIONS_TTL_S, SubmitOptions, read_submit_options, split_by_pool
from stores.tier_exists import tier_exists

__all__ = ["AsyncFleet", "Cancel", "Erased", "Fleet", "Restart", "SubmitNotNotified", "TurnHandle",
           "TurnStream", "TurnTimeout", "TurnTooLarge", "UnknownTier"]

log = logging.getLogger("fleet.client")

DEFAULT_MAX_TURN_BYTES = 64 * 1024
DEFAULT_MAX_REPLY_BYTES = 1024 * 1024
UNREPLICATED_KEEP = 10_000  # turn ids of submits whose WAIT came back short, newest kept
Built = list[tuple[Turn, bytes]]  # turns with their encoded payloads
STREAM_POLL_S = 1.0  # a stream read blocks at most this long before it looks for the reply again
STREAM_POLL_MIN_S = 0.001  # ... and then reads on its own that long (with the reply, if it is there)
RETRY_S = 10.0  # how long a submit rides out Redis away or a Cluster failover, by default
_RETRY_BACKOFF = Backoff(base=0.05, cap=1.0)
T = TypeVar("T")
# the errors a submit sent again may outlast: the network, Redis restarting or refusing writes
# for a while, a Cluster between two topologies (not a refusal by the ACL, a bad argument, ...)
_RETRIED = frozenset({"connection", "timeout", "loading", "busy", "readonly", "masterdown", "tryagain",
                      "clusterdown", "moved"})


def transient(exc: BaseException) -> bool:
    """Whether a submit (or a reply wait) that failed with ``exc`` is sent again: a transient
    error, not a final one (refused credentials, no Redis named, a port that speaks no TLS)."""
    if isinstance(exc, SubmitNotNotified):  # queued, unannounced: sent again if what failed was transient
        return exc.__cause__ is not None and transient(exc.__cause__)
    if isinstance(exc, (AuthenticationError, NoFleetFound, HandshakeTimeout)):
        return False
    return isinstance(exc, TRANSIENT) and error_kind(exc) in _RETRIED


def _retrying(seconds: float) -> dict[str, Any]:
    """tenacity's options for a submit's or a wait's retries over ``seconds``: capped, jittered
    waits; the last error raised as it is once the time is up."""
    return {"retry": retry_if_exception(transient), "wait": _RETRY_BACKOFF.wait,
            "stop": stop_after_delay(seconds), "reraise": True}


# A call of the client is tried once as it is, and only after a transient error under
# tenacity's retries (after a first wait), until ``seconds`` from the first try are up: nearly
# every call succeeds at once, and tenacity's retry state costs more CPU than a submit itself.
def _first_failed(exc: Exception, seconds: float, start: float) -> float:
    """The wait before the retries of a first try that raised ``exc`` (raised again if it is not
    transient or the time is up)."""
    left = seconds - (time.monotonic() - start)
    if not transient(exc) or left <= 0:
        raise exc
    return min(_RETRY_BACKOFF.compute(1), left)


def _retried(seconds: float, call: Callable[[], T]) -> T:
    """``call()``, retried on a transient error for up to ``seconds`` (see above)."""
    start = time.monotonic()
    try:
        return call()
    except Exception as exc:  # raised again unless transient
        time.sleep(_first_failed(exc, seconds, start))
    for attempt in Retrying(**_retrying(max(0.0, seconds - (time.monotonic() - start)))):
        with attempt:
            return call()
    raise AssertionError("unreachable: tenacity returns or raises")


async def _aretried(seconds: float, call: Callable[[], Awaitable[T]]) -> T:
    """:func:`_retried` on asyncio."""
    start = time.monotonic()
    try:
        return await call()
    except Exception as exc:  # raised again unless transient
        await asyncio.sleep(_first_failed(exc, seconds, start))
    async for attempt in AsyncRetrying(**_retrying(max(0.0, seconds - (time.monotonic() - start)))):
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity returns or raises")


class TurnTimeout(TimeoutError):
    """No reply within the timeout. The turn stays queued and may still be answered."""


class TurnTooLarge(ValueError):
    """The turn's text is over ``MAX_TEXT_CHARS``, or the encoded turn (with its meta) over the
    client's ``max_turn_bytes``: it was not submitted. The message names the limit."""


class UnknownTier(ValueError):
    """The tier has no policy and no live worker: nothing would serve the turn, so it was not submitted."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        super().__init__(f"tier {tier!r} does not exist (no policy and no live worker), so nothing "
                         f"would serve the turn; nothing was submitted (create the tier with "
                         f"`fleet policy set {tier} ...`, or submit with create_tier=True)")


@dataclass
class TurnHandle:
    """A submitted turn; ``result()`` waits for its reply."""

    client: Fleet = field(repr=False)
    user: str
    tier: str
    turn_id: str
    submitted_at: float
    _reply: Reply | None = field(default=None, repr=False)

    def result(self, timeout: float = 30.0) -> Reply:
        """The reply (ok or error), waiting up to ``timeout`` seconds; ``TurnTimeout`` if none."""
        if self._reply is None:
            self._reply = self.client._wait(self.user, self.turn_id, timeout)
        return self._reply


def deadline_of(deadline: float | None, timeout_s: float | None) -> float | None:
    """A turn's deadline (unix seconds) from an absolute ``deadline`` or a ``timeout_s`` from now
    (at most one of them); None: no limit."""
    if deadline is not None and timeout_s is not None:
        raise ValueError("give a turn a deadline or timeout_s, not both")
    if timeout_s is not None:
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, not {timeout_s!r}")
        return time.time() + timeout_s
    return deadline


def _streamed_turn(user: str, text: str, tier: str, meta: Mapping[str, Any] | None, turn_id: str | None,
                   max_bytes: int, timeout: float, deadline: float | Literal["timeout"] | None) -> Built:
    """A streamed turn, built: its deadline the end of ``timeout`` unless ``deadline`` says otherwise."""
    due = deadline_of(None, timeout) if deadline == "timeout" else deadline
    return [_build_turn(user, text, tier, meta, turn_id, max_bytes, stream=True, deadline=due)]


def _build_turn(user: str, text: str, tier: str, meta: Mapping[str, Any] | None,
                turn_id: str | None, max_bytes: int, stream: bool = False,
                deadline: float | None = None) -> tuple[Turn, bytes]:
    if len(text) > MAX_TEXT_CHARS:  # checked here, not by pydantic: a documented error, not a ValidationError
        raise TurnTooLarge(f"turn text of {len(text)} characters is over the limit of "
                           f"{MAX_TEXT_CHARS} characters")
    turn = Turn(turn_id=turn_id or uuid.uuid4().hex, user=validate_user_id(user),
                tier=validate_tier(tier), text=text, ts=time.time(), meta=dict(meta or {}), stream=stream,
                deadline=deadline)
    payload = encode(turn)
    if len(payload) > max_bytes:
        raise TurnTooLarge(f"turn of {len(payload)} bytes (encoded, with its meta) is over the limit "
                           f"of {max_bytes} bytes")
    return turn, payload


@dataclass(frozen=True)
class Restart:
    """The turn's text starts over (a new attempt, or the same one sent again whole): drop what
    was shown of it so far; the text that follows replaces it."""

    attempt: int


StreamItem = str | Restart | Reply  # what a TurnStream yields


class _StreamRead:
    """The reading of one streamed turn, sans I/O: :meth:`step` is one round trip (the stream's
    new entries, and the reply if it is there) and what it yields to the caller. The reply is
    read from the reply list, as ``wait`` reads it: taken once."""

    def __init__(self, user: str, turn_id: str, max_reply_bytes: int) -> None:
        self.user, self.turn_id, self.max_reply_bytes = user, turn_id, max_reply_bytes
        self.after = "0-0"  # the last entry read
        self.attempt = 0  # the attempt whose text is being read
        self.ended = False  # the 'end' entry was read
        self.skipped = 0  # entries that were not Fleet's (warned about, not shown)
        self.got: list[StreamItem] = []  # read, not handed to the caller yet
        self.raw: Any = None  # the reply, once taken from its list

    def step(self, block_s: float, left_s: float) -> Op[list[StreamItem]]:
        """Read on for up to ``block_s`` seconds; the items read (ending with the ``Reply``
        once it came). ``TurnTimeout`` if the stream ended but the reply is not there within
        ``left_s`` (another reader took it). A step that failed midway is sent again as it
        stands: what it read and the reply it took are kept for it."""
        if self.raw is None:
            raw = None
            if not self.ended:  # (once it is, the reply is all there is left to read)
                block_ms = round(block_s * 1000)
                rows, raw = yield from read_stream.steps(self.user, self.turn_id, self.after, block_ms)
                self.got += self._items(rows)
            if raw is None and self.ended:  # written with the end: someone else has taken it
                raw = yield from wait_reply.steps(self.user, self.turn_id, left_s)
                if raw is None:
                    raise TurnTimeout(f"turn {self.turn_id} of {self.user} ended, but its reply was taken "
                                      f"by another reader")
            if raw is None:
                items, self.got = self.got, []
                return items
            self.raw = raw
        if not self.ended:  # the entries written with the reply (or none: a turn not streamed)
            self.got += self._items((yield from read_stream_rest.steps(self.user, self.turn_id, self.after)))
        items, self.got = [*self.got, decode(Reply, self.raw, max_bytes=self.max_reply_bytes)], []
        return items

    def feed(self, rows: list[tuple[str, dict[bytes, bytes]]]) -> list[StreamItem]:
        """The items of entries read for this stream by someone else (the client's hub)."""
        return self._items(rows)

    def _items(self, rows: list[tuple[str, dict[bytes, bytes]]]) -> list[StreamItem]:
        items: list[StreamItem] = []
        for entry, fields in rows:
            self.after = entry
            try:
                items += self._item(fields)
            except (KeyError, ValueError) as exc:  # not an entry a worker wrote
                self.skipped += 1
                log.warning("entry %s of the stream of turn %s skipped: %s", entry, self.turn_id, exc)
        return items

    def _item(self, fields: dict[bytes, bytes]) -> list[StreamItem]:
        kind = fields[b"k"]
        if kind == b"end":
            self.ended = True
            return []
        attempt = int(fields[b"a"])
        if kind == b"restart":
            self.attempt = max(self.attempt, attempt)
            return [Restart(attempt)]
        if kind != b"chunk":
            raise ValueError(f"unknown kind {as_str(kind)[:40]!r}")
        text = fields[b"t"].decode()
        if attempt < self.attempt:  # (a fenced-out worker cannot write one: never shown)
            raise ValueError(f"a chunk of attempt {attempt} after attempt {self.attempt}'s")
        restart: list[StreamItem] = [Restart(attempt)] if self.attempt and attempt > self.attempt else []
        self.attempt = attempt
        return [*restart, text]


class TurnStream:
    """A streamed turn: iterate it (``async for`` on an ``AsyncFleet``'s, ``for`` on a
    ``Fleet``'s) for its text as the handler emits it (``str`` pieces), a :class:`Restart`
    whenever the text starts over (drop what you showed of it), and last the ``Reply`` (the one
    a non-streaming ``wait`` would get: its ``text`` is the whole answer).

    ``turn_id`` is known at once; the turn is submitted when the iteration starts. The whole
    iteration ends within ``timeout`` seconds, or raises ``TurnTimeout`` (the turn stays queued
    and may still be answered). The reply is then in ``reply`` too."""

    def __init__(self, client: Fleet | AsyncFleet, built: Built, timeout: float, create_tier: bool) -> None:
        self._client, self._built, self.timeout, self._create_tier = client, built, timeout, create_tier
        self.turn = built[0][0]
        self._read = _StreamRead(self.turn.user, self.turn.turn_id, client.max_reply_bytes)
        self.reply: Reply | None = None

    @property
    def turn_id(self) -> str:
        return self.turn.turn_id

    def _next(self, deadline: float) -> tuple[float, float]:
        """How long the next read may block, and how long is left; ``TurnTimeout`` once over."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TurnTimeout(f"no reply to turn {self.turn_id} of {self.turn.user} within {self.timeout:g}s")
        return min(left, STREAM_POLL_S), left

    def _seen(self, items: list[StreamItem]) -> bool:
        last = items[-1] if items else None
        if isinstance(last, Reply):
            self.reply = last
        return self.reply is not None

    def __iter__(self) -> Iterator[StreamItem]:
        client = self._client
        if not isinstance(client, Fleet):
            raise TypeError("a stream of an AsyncFleet is read with `async for`")
        deadline = time.monotonic() + self.timeout
        client._send(self._built, self._create_tier)
        while self.reply is None:
            block, left = self._next(deadline)

            def read(block_s: float = block, left_s: float = left) -> list[StreamItem]:
                return run(client.r, self._read.step(block_s, left_s))
            items = _retried(left, read)
            self._seen(items)
            yield from items

    async def __aiter__(self) -> AsyncIterator[StreamItem]:
        client = self._client
        if not isinstance(client, AsyncFleet):
            raise TypeError("a stream of a Fleet is read with `for`")
        deadline = time.monotonic() + self.timeout
        await client._send(self._built, self._create_tier)
        key = keys.stream(self.turn.user, self.turn_id)
        sub = client._hub.join(key, self._read.after) if client._hub is not None else None
        try:
            while self.reply is None:
                block, left = self._next(deadline)
                items: list[StreamItem] = []
                if sub is not None and sub.covered and not self._read.ended:
                    items = self._read.feed(await sub.take(block))  # what the hub read
                    if items or not sub.covered or self._read.ended:
                        self._seen(items)
                        for item in items:
                            yield item
                        continue
                    block = STREAM_POLL_MIN_S  # nothing for a while: is the reply there (no 'end')?

                async def read(block_s: float = block, left_s: float = left) -> list[StreamItem]:
                    return await arun(client.r, self._read.step(block_s, left_s))
                items = await _aretried(left, read)
                if sub is not None:
                    sub.read_to(self._read.after)
                self._seen(items)
                for item in items:
                    yield item
        finally:
            if client._hub is not None:
                client._hub.leave(key)


class _ClientCore:
    """What ``Fleet`` and ``AsyncFleet`` share: what the client remembers of its tiers, the WAIT
    counters, and the operations of a submit and a reply wait (each yields its round trips to
    the caller's runner)."""

    def __init__(self, cluster: bool) -> None:
        self.cluster = cluster  # a Redis Cluster client: the ordered submit
        self.tiers: set[str] = set()  # tiers found to exist: not checked again
        self.options: dict[str, tuple[SubmitOptions, float]] = {}  # tier -> (options, read at, monotonic)
        self.checked: dict[str, float] = {}  # tier -> when a submit last checked it for pressure
        self.acks = ReplicaAcks.of("submit")  # the submits' WAITs (a tier's replica_acks)
        self.unreplicated: deque[str] = deque(maxlen=UNREPLICATED_KEEP)  # turn ids of short WAITs

    @staticmethod
    def build(turns: Iterable[tuple[str, str]], tier: str, meta: Mapping[str, Any] | None,
              turn_ids: list[str | None] | None, max_bytes: int, deadline: float | None = None,
              stream: bool = False) -> Built:
        """The turns, validated and encoded; raises ``InvalidId`` / ``TurnTooLarge`` (and
        ``ValueError`` for a bad deadline)."""
        return [_build_turn(u, t, tier, meta, (turn_ids or [])[i] if turn_ids else None, max_bytes,
                            stream=stream, deadline=deadline)
                for i, (u, t) in enumerate(turns)]

    def submit(self, built: Built, create_tier: bool) -> Op[None]:
        """Submit ``built`` (one tier's turns, at least one): the tier check, its options, then
        per group's pool one submit and, when due, its pressure event."""
        tier = built[0][0].tier
        yield from self._ensure_tier(tier, create_tier)
        opts = yield from self._submit_options(tier)
        for pool, part in split_by_pool(tier, built, opts):  # a tier with groups: one per group
            pressure = self._pressure_due(pool, part[-1][0].user)
            done = yield from submit_turns.steps(part, pool, opts, pressure, cluster=self.cluster)
            self._count_wait(opts, done, part)
            if pressure is not None and _needs_pressure(done):
                yield from post_pressure.steps(pool, pressure)

    @staticmethod
    def reply(user: str, turn_id: str, timeout: float, max_bytes: int, hint: str = "") -> Op[Reply]:
        """The reply of a turn; ``TurnTimeout`` (its message ending with ``hint``) if none in time."""
        raw = yield from wait_reply.steps(user, turn_id, timeout)
        if raw is None:
            raise TurnTimeout(f"no reply to turn {turn_id} of {user} within {timeout:g}s{hint}")
        return decode(Reply, raw, max_bytes=max_bytes)

    @staticmethod
    def delete_user(user: str, role: str) -> Op[Erased]:
        """Erase every key of ``user``, fenced against a turn in flight, and record who did it
        in the ledger (``stores.erase``)."""
        return (yield from delete_user.steps(validate_user_id(user), who(), role, time.time()))

    def _ensure_tier(self, tier: str, create: bool) -> Op[None]:
        if tier in self.tiers:
            return
        if not (yield from tier_exists.steps(tier)):
            if not create:
                raise UnknownTier(tier)
            yield from write_policy.steps(tier, TurnsPolicy())
        self.tiers.add(tier)

    def _submit_options(self, tier: str) -> Op[SubmitOptions]:
        """The tier's ``ready_shards`` and ``replica_acks``, read again every ``OPTIONS_TTL_S``
        (a stale shard count is still served: workers read every shard that exists)."""
        opts, at = self.options.get(tier, (SubmitOptions(), -OPTIONS_TTL_S))
        if time.monotonic() - at >= OPTIONS_TTL_S:
            opts = yield from read_submit_options.steps(tier)
            self.options[tier] = (opts, time.monotonic())
        return opts

    def _pressure_due(self, tier: str, user: str) -> dict[str, str] | None:
        """The pressure event a submit should check for, or None: a client checks a tier at most
        once per ``PRESSURE_CHECK_S`` (no ``XINFO`` per submit; the commander's pass sees a
        backlog the checks miss)."""
        now = time.monotonic()
        if now - self.checked.get(tier, float("-inf")) < PRESSURE_CHECK_S:
            return None
        self.checked[tier] = now
        return {"tier": tier, "user": user, "ts": f"{time.time():.3f}"}

    def _count_wait(self, opts: SubmitOptions, done: Submitted, built: Built) -> None:
        """Count a submit's WAIT (the tier's ``replica_acks``). A shortfall is logged and its
        turn ids kept in ``unreplicated`` (the last ``UNREPLICATED_KEEP``: the turns a failover
        may lose, for a caller that resubmits them); the turns stay submitted, queued on the
        master, as without a WAIT."""
        if opts.wait is None:
            return
        short = self.acks.short.get("submit", 0)
        self.acks.count("submit", opts.wait, done.acked, time.monotonic())
        if self.acks.short.get("submit", 0) > short:
            self.unreplicated.extend(t.turn_id for t, _ in built)


def _needs_pressure(done: Submitted) -> bool:
    """Whether the client must still post the pressure event: on a Cluster (one node: the
    check posted it itself), the gauges it read show no free slot."""
    return not done.posted and bool(done.gauges) and no_free_slot(*done.gauges)


class Fleet:
    """Blocking client. ``Fleet(url).submit("alice", "hi").result(10).text``."""

    def __init__(self, url: str | None = None, *, client: redis.Redis | None = None,
                 max_turn_bytes: int = DEFAULT_MAX_TURN_BYTES,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES, retry_s: float = RETRY_S) -> None:
        """``retry_s``: how long a submit is sent again, with the same turn ids, while Redis is
        away or a Cluster fails over (a turn id is answered once however often it is submitted);
        0 sends it once. The error is raised once that time is up, or at once if it is final."""
        self.r = client or connect_sync(url or process_url(None, "fleet-client"))
        self._core = _ClientCore(is_cluster(self.r))
        self.max_turn_bytes = max_turn_bytes
        self.max_reply_bytes = max_reply_bytes
        self.retry_s = retry_s
        self.acks = self._core.acks  # the submits' WAITs (a tier's replica_acks)
        self.unreplicated = self._core.unreplicated  # turn ids of short WAITs

    def reread_policies(self) -> None:
        """Forget the tiers' submit options read so far (``ready_shards``, ``replica_acks``): the
        next submit reads its tier's again (they are read again every ``OPTIONS_TTL_S`` anyway)."""
        self._core.options.clear()

    def submit(self, user: str, text: str, tier: str = "chat", meta: Mapping[str, Any] | None = None,
               turn_id: str | None = None, *, create_tier: bool = False, deadline: float | None = None,
               timeout_s: float | None = None, stream: bool = False) -> TurnHandle:
        """Enqueue one turn; raises ``InvalidId`` / ``TurnTooLarge`` / ``UnknownTier`` before
        writing anything.

        ``deadline`` (unix seconds) or ``timeout_s`` (seconds from now), at most one: a worker
        that reaches the turn later answers it ``expired`` without running the handler, and a
        running handler sees it as ``ctx.deadline``. Neither: no limit. ``stream=True`` submits
        it as streamed: its text goes to its reply stream as the handler emits it, for any
        reader (``stream`` submits and reads one; the raw protocol's ``XREAD``)."""
        return self.submit_many([(user, text)], tier=tier, meta=meta, turn_ids=[turn_id],
                                create_tier=create_tier, deadline=deadline, timeout_s=timeout_s,
                                stream=stream)[0]

    def submit_many(self, turns: Iterable[tuple[str, str]], tier: str = "chat",
                    meta: Mapping[str, Any] | None = None,
                    turn_ids: list[str | None] | None = None, *,
                    create_tier: bool = False, deadline: float | None = None,
                    timeout_s: float | None = None, stream: bool = False) -> list[TurnHandle]:
        """Enqueue many ``(user, text)`` turns in one script call and round trip, in the given order
        (on Redis Cluster: every inbox entry, then every notification).

        ``create_tier=True`` writes the default policy of a tier that does not exist yet;
        ``deadline`` / ``timeout_s`` / ``stream`` as ``submit``'s, the same for every turn.
        """
        built = self._core.build(turns, tier, meta, turn_ids, self.max_turn_bytes,
                                 deadline_of(deadline, timeout_s), stream)
        if built:
            self._send(built, create_tier)
        return [TurnHandle(self, t.user, t.tier, t.turn_id, t.ts) for t, _ in built]

    def stream(self, user: str, text: str, tier: str = "chat", timeout: float = 30.0,
               meta: Mapping[str, Any] | None = None, turn_id: str | None = None, *,
               create_tier: bool = False,
               deadline: float | Literal["timeout"] | None = "timeout") -> TurnStream:
        """A streamed turn: ``for item in fleet.stream("alice", "hi")`` yields the text as the
        handler emits it, a :class:`Restart` when it starts over, then the ``Reply``
        (:class:`TurnStream`). Raises ``InvalidId`` / ``TurnTooLarge`` at once; the turn is
        submitted when the iteration starts. Its deadline is the end of the ``timeout`` (as
        ``ask``'s), unless ``deadline`` gives one (unix seconds) or None (no limit)."""
        return TurnStream(self, _streamed_turn(user, text, tier, meta, turn_id, self.max_turn_bytes, timeout,
                                               deadline), timeout, create_tier)

    def _send(self, built: Built, create_tier: bool) -> None:
        """Submit ``built``, sent again on a transient error for up to ``retry_s``."""
        _retried(self.retry_s, lambda: run(self.r, self._core.submit(built, create_tier)))

    def results(self, handles: Iterable[TurnHandle], timeout: float = 30.0) -> list[Reply]:
        """Wait for every handle, sharing one deadline."""
        deadline = time.monotonic() + timeout
        return [h.result(max(0.01, deadline - time.monotonic())) for h in handles]

    def cancel(self, user: str, turn_id: str) -> Cancel:
        """Stop ``user``'s turn ``turn_id``: a queued turn is answered ``cancelled`` without
        running; a running one has its handler stopped (an async handler's task is cancelled, a
        sync handler sees ``ctx.cancelled``) and is answered ``cancelled`` with what it had
        streamed (in the session, marked ``cut``, when it streamed anything). The user's next
        turn is served at once. Exactly one reply per turn: a turn answered already is left as
        it is (``outcome`` ``answered``, with its reply's ``status`` if still unread), an unknown
        id says so (``unknown``). ``str()`` of the result is a sentence for a person. Sent
        again, like a submit, while Redis is away (a cancel recorded twice is one cancel)."""
        return _retried(self.retry_s, lambda: cancel_turn(self.r, user, turn_id))

    def delete_user(self, user: str) -> Erased:
        """Erase every key of ``user`` (inbox, lane, state, session, memory, profile, usage,
        done-set, outbox, pins, pending replies), fenced against a turn in flight: nothing of a
        turn being served is written back. Recorded in the ledger (who, when, the user id).
        Needs the ``fleet-operator`` role's credentials: ``Fleet(operator_url)``; on the client
        role Redis refuses it (``NoPermissionError``) and nothing is erased."""
        return run(self.r, self._core.delete_user(user, connection_user(self.r)))

    def _wait(self, user: str, turn_id: str, timeout: float) -> Reply:
        deadline = time.monotonic() + timeout
        return _retried(timeout, lambda: run(self.r, self._core.reply(
            user, turn_id, max(0.01, deadline - time.monotonic()), self.max_reply_bytes,
            " (is a worker running for its tier? `fleet status`)")))

    def close(self) -> None:
        self.r.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncFleet:
    """The asyncio client: ``await fleet.ask(user, text)``."""

    def __init__(self, url: str | None = None, *, client: aioredis.Redis | None = None,
                 max_turn_bytes: int = DEFAULT_MAX_TURN_BYTES,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES, retry_s: float = RETRY_S) -> None:
        """As ``Fleet``'s."""
        self.r = client or connect_async(url or process_url(None, "fleet-client"))
        self._core = _ClientCore(is_cluster(self.r))
        self.max_turn_bytes = max_turn_bytes
        self.max_reply_bytes = max_reply_bytes
        self.retry_s = retry_s
        self.acks = self._core.acks  # the submits' WAITs (a tier's replica_acks)
        self.unreplicated = self._core.unreplicated  # turn ids of short WAITs
        # the streams read at once, in one XREAD (one node; on a Cluster each reads on its own)
        self._hub = None if self._core.cluster else StreamHub(self.r)

    def reread_policies(self) -> None:
        """``Fleet.reread_policies``."""
        self._core.options.clear()

    async def submit(self, user: str, text: str, tier: str = "chat",
                     meta: Mapping[str, Any] | None = None, turn_id: str | None = None, *,
                     create_tier: bool = False, deadline: float | None = None,
                     timeout_s: float | None = None, stream: bool = False) -> Turn:
        """Enqueue one turn; returns it (its ``turn_id`` is what ``wait`` needs). ``deadline`` /
        ``timeout_s`` / ``stream`` as ``Fleet.submit``'s."""
        return (await self.submit_many([(user, text)], tier, meta, [turn_id], create_tier=create_tier,
                                        deadline=deadline, timeout_s=timeout_s, stream=stream))[0]

    async def submit_many(self, turns: Iterable[tuple[str, str]], tier: str = "chat",
                          meta: Mapping[str, Any] | None = None,
                          turn_ids: list[str | None] | None = None, *,
                          create_tier: bool = False, deadline: float | None = None,
                          timeout_s: float | None = None, stream: bool = False) -> list[Turn]:
        """``Fleet.submit_many`` on asyncio: the turns, in the given order (one script call and
        round trip; on Redis Cluster every inbox entry, then every notification)."""
        built = self._core.build(turns, tier, meta, turn_ids, self.max_turn_bytes,
                                 deadline_of(deadline, timeout_s), stream)
        if built:
            await self._send(built, create_tier)
        return [t for t, _ in built]

    def stream(self, user: str, text: str, tier: str = "chat", timeout: float = 30.0,
               meta: Mapping[str, Any] | None = None, turn_id: str | None = None, *,
               create_tier: bool = False,
               deadline: float | Literal["timeout"] | None = "timeout") -> TurnStream:
        """``Fleet.stream`` on asyncio: ``async for item in fleet.stream("alice", "hi")``."""
        return TurnStream(self, _streamed_turn(user, text, tier, meta, turn_id, self.max_turn_bytes, timeout,
                                               deadline), timeout, create_tier)

    async def _send(self, built: Built, create_tier: bool) -> None:
        """``Fleet._send`` on asyncio."""
        await _aretried(self.retry_s, lambda: arun(self.r, self._core.submit(built, create_tier)))

    async def wait(self, user: str, turn_id: str, timeout: float = 30.0) -> Reply:
        """The reply of a submitted turn; ``TurnTimeout`` if none in time."""
        deadline = time.monotonic() + timeout
        return await _aretried(timeout, lambda: arun(self.r, self._core.reply(
            user, turn_id, max(0.01, deadline - time.monotonic()), self.max_reply_bytes)))

    async def ask(self, user: str, text: str, tier: str = "chat", timeout: float = 30.0,
                  meta: Mapping[str, Any] | None = None, *, create_tier: bool = False,
                  deadline: float | Literal["timeout"] | None = "timeout") -> Reply:
        """Submit and wait up to ``timeout`` seconds. The turn's deadline is the end of that wait
        (nobody reads a reply after it: a worker that reaches the turn later answers it
        ``expired``), unless ``deadline`` gives one (unix seconds) or None (no limit)."""
        if deadline == "timeout":
            turn = await self.submit(user, text, tier, meta, create_tier=create_tier, timeout_s=timeout)
        else:
            turn = await self.submit(user, text, tier, meta, create_tier=create_tier, deadline=deadline)
        return await self.wait(user, turn.turn_id, timeout)

    async def cancel(self, user: str, turn_id: str) -> Cancel:
        """``Fleet.cancel`` on asyncio."""
        return await _aretried(self.retry_s, lambda: cancel_turn(self.r, user, turn_id))

    async def delete_user(self, user: str) -> Erased:
        """``Fleet.delete_user`` on asyncio (the ``fleet-operator`` role's credentials)."""
        return await arun(self.r, self._core.delete_user(user, connection_user(self.r)))

    async def aclose(self) -> None:
        if self._hub is not None:
            await self._hub.close()
        await self.r.aclose()
