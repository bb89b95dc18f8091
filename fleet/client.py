"""The Python client: submit turns, wait for replies.

**Submit** is ``XADD`` the turn to the user's inbox, ``XADD`` a notification to
the tier's ready stream, ``ZADD`` the user to the tier's active set. On one node the client
sends them as one script call (``turn_submit.lua``, every turn of a ``submit_many`` in the
same call) in one round trip. What that buys: the writes are applied together with no other
client's command in between, and a script that is refused or fails on its arguments writes
nothing; a connection lost before the call applies none of it; a retried round trip applies
the batch once. What it does not buy: Redis never rolls back, so a command that fails *while*
the script runs (a key of the wrong type, out of memory) leaves the writes before it applied;
the client raises that error. The inbox entry is the msgpack ``Turn`` (field ``m``) with plain
copies of its ``turn_id`` and ``tier``, which the worker's scripts read. The reply arrives on
``fleet:u:{U}:reply:<turn_id>`` for a ``BLPOP``.

**On Redis Cluster** (``stores.cluster.is_cluster`` of the client) no transaction can span the
user's slot (inbox) and the tier's (ready, active), and the cluster pipeline sends each node's
batch concurrently, so the submit is *ordered* instead: one round trip writes the inbox entries
(all of them, for ``submit_many``) and waits for their acknowledgement, a second writes the
notifications and active marks and, when it checks for pressure, reads the gauges
(``stores.submit.submit_ordered``). One
extra round trip, only there. An inbox entry refused is a turn not submitted: no notification,
and its error is raised (after the batch's other turns are notified). If the second round trip
fails, the turns are in their inboxes without a notification: ``SubmitNotNotified`` names them.
Nothing is lost or reordered: the user's next submit wakes a worker that serves the inbox in
order, oldest first; and a retry with the same ``turn_id`` is answered once, because the worker
skips a turn id already in the user's done-set (``fleet:u:{U}:done``, the last ``done_keep``
ids; ``turn_commit.lua`` answers ``dup``). A retry under a new turn id is a second turn.

**Replicas.** With the tier's ``replica_acks`` N (the policy; read with ``ready_shards`` and
again every ``OPTIONS_TTL_S``), the submit sends ``WAIT N replica_ack_timeout_ms`` after its
writes, on their connection: on one node after the script in the same round trip; on a Cluster
after each master's share of the inbox entries (before any notification is written) and again
after the notifications, one more round trip for the gauges. Once the submit returns with N
acknowledgements, a failover to one of those replicas keeps the turn. A WAIT that gets fewer
(its timeout) is counted in ``acks`` (``waits``, ``acked``, ``short``) and logged; the turn
stays submitted, queued on the master, as without the option.

**Tiers.** A turn for a tier that no policy defines and no worker serves would wait forever,
so it is refused with ``UnknownTier`` before anything is written, unless ``create_tier=True``
writes the tier's default policy (the commander then starts its workers). A tier exists if
``fleet:policy:{tier}`` exists, ``fleet:tiers`` names it, or a worker of the tier has a live
heartbeat. The client checks each tier once and remembers the tiers it found (a refused tier is
checked again on the next submit), so a submit stays one round trip.

**Pressure.** The same round trip may carry, after the submit's script, the pressure check
(``submit_pressure.lua``): the tier's consumer-group lag against the slots of workers already
starting. Redis hands a new notification to a worker blocked in ``XREADGROUP`` once the command
(here: the submit's script) that wrote it is done, before it runs the next one, so a lag left
after it means no worker had a free slot. (Read inside the submit, the lag would always count
our own notification.) If the lag is more than the starting workers will absorb, the check
appends a pressure event itself, which wakes the commander at once. A client checks a tier at
most once every ``PRESSURE_CHECK_S`` (10 ms): no ``XINFO`` on every submit; a burst the checks
miss is in the backlog the commander reads every pass (0.5 s). Both gauges are recomputed from
live state (the lag) or expire (``starting``), so neither drifts. (On a Cluster the gauges are
read in round trip 2, when checking, and the client posts the event.)
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from protocol.codec import decode, encode
from protocol.ids import validate_tier, validate_user_id
from protocol.models import MAX_TEXT_CHARS, Reply, Turn
from protocol.policy import TurnsPolicy
from stores.backlog import no_free_slot
from stores.connection import connect_async, connect_sync
from stores.policies import write_policy, write_policy_async
from stores.replicas import ReplicaAcks
from stores.submit import (
    PRESSURE_CHECK_S,
    SubmitNotNotified,
    Submitted,
    submit_round_trip,
    submit_round_trip_async,
)
from stores.tier_probe import (
    OPTIONS_TTL_S,
    SubmitOptions,
    any_beating,
    any_beating_async,
    heartbeats_of,
    post_pressure,
    post_pressure_async,
    read_submit_options,
    read_submit_options_async,
    read_tier_probe,
    read_tier_probe_async,
    split_by_pool,
    tier_defined,
    wait_reply,
    wait_reply_async,
)

__all__ = ["AsyncFleet", "Fleet", "SubmitNotNotified", "TurnHandle", "TurnTimeout", "TurnTooLarge",
           "UnknownTier"]

DEFAULT_MAX_TURN_BYTES = 64 * 1024
DEFAULT_MAX_REPLY_BYTES = 1024 * 1024
UNREPLICATED_KEEP = 10_000  # turn ids of submits whose WAIT came back short, newest kept


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


def _build_turn(user: str, text: str, tier: str, meta: Mapping[str, Any] | None,
                turn_id: str | None, max_bytes: int) -> tuple[Turn, bytes]:
    if len(text) > MAX_TEXT_CHARS:  # checked here, not by pydantic: a documented error, not a ValidationError
        raise TurnTooLarge(f"turn text of {len(text)} characters is over the limit of "
                           f"{MAX_TEXT_CHARS} characters")
    turn = Turn(turn_id=turn_id or uuid.uuid4().hex, user=validate_user_id(user),
                tier=validate_tier(tier), text=text, ts=time.time(), meta=dict(meta or {}))
    payload = encode(turn)
    if len(payload) > max_bytes:
        raise TurnTooLarge(f"turn of {len(payload)} bytes (encoded, with its meta) is over the limit "
                           f"of {max_bytes} bytes")
    return turn, payload


def _pressure_fields(tier: str, user: str) -> dict[str, str]:
    return {"tier": tier, "user": user, "ts": f"{time.time():.3f}"}


def _pressure_due(client: Fleet | AsyncFleet, tier: str, user: str) -> dict[str, str] | None:
    """The pressure event a submit should check for, or None: a client checks a tier at most
    once per ``PRESSURE_CHECK_S`` (no ``XINFO`` per submit; the commander's pass sees a backlog
    the checks miss)."""
    now = time.monotonic()
    if now - client._checked.get(tier, float("-inf")) < PRESSURE_CHECK_S:
        return None
    client._checked[tier] = now
    return _pressure_fields(tier, user)


def _needs_pressure(done: Submitted) -> bool:
    """Whether the client must still post the pressure event: on a Cluster (one node: the
    check posted it itself), the gauges it read show no free slot."""
    return not done.posted and bool(done.gauges) and no_free_slot(*done.gauges)


def _count_wait(client: Fleet | AsyncFleet, opts: SubmitOptions, done: Submitted,
                built: list[tuple[Turn, bytes]]) -> None:
    """Count a submit's WAIT (the tier's ``replica_acks``). A shortfall is logged and its turn
    ids kept in ``client.unreplicated`` (the last ``UNREPLICATED_KEEP``: the turns a failover
    may lose, for a caller that resubmits them); the turns stay submitted, queued on the
    master, as without a WAIT (docs/guide/redis-cluster.md, "Failover and replica_acks")."""
    if opts.wait is None:
        return
    short = client.acks.short.get("submit", 0)
    client.acks.count("submit", opts.wait, done.acked, time.monotonic())
    if client.acks.short.get("submit", 0) > short:
        client.unreplicated.extend(t.turn_id for t, _ in built)


def _decode_reply(raw: bytes, max_bytes: int) -> Reply:
    return decode(Reply, raw, max_bytes=max_bytes)


class Fleet:
    """Blocking client. ``Fleet(url).submit("alice", "hi").result(10).text``."""

    def __init__(self, url: str | None = None, *, client: redis.Redis | None = None,
                 max_turn_bytes: int = DEFAULT_MAX_TURN_BYTES,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> None:
        self.r = client or connect_sync(url)
        self.max_turn_bytes = max_turn_bytes
        self.max_reply_bytes = max_reply_bytes
        self._tiers: set[str] = set()  # tiers found to exist: not checked again
        self._options: dict[str, tuple[SubmitOptions, float]] = {}  # tier -> (options, read at, monotonic)
        self._checked: dict[str, float] = {}  # tier -> when a submit last checked it for pressure
        self.acks = ReplicaAcks.of("submit")  # the submits' WAITs (a tier's replica_acks)
        self.unreplicated: deque[str] = deque(maxlen=UNREPLICATED_KEEP)  # turn ids of short WAITs

    def reread_policies(self) -> None:
        """Forget the tiers' submit options read so far (``ready_shards``, ``replica_acks``): the
        next submit reads its tier's again (they are read again every ``OPTIONS_TTL_S`` anyway)."""
        self._options.clear()

    def _submit_options(self, tier: str) -> SubmitOptions:
        """The tier's ``ready_shards`` and ``replica_acks``, read again every ``OPTIONS_TTL_S``
        (a stale shard count is still served: workers read every shard that exists)."""
        opts, at = self._options.get(tier, (SubmitOptions(), -OPTIONS_TTL_S))
        if time.monotonic() - at >= OPTIONS_TTL_S:
            opts = read_submit_options(self.r, tier)
            self._options[tier] = (opts, time.monotonic())
        return opts

    def submit(self, user: str, text: str, tier: str = "chat", meta: Mapping[str, Any] | None = None,
               turn_id: str | None = None, *, create_tier: bool = False) -> TurnHandle:
        """Enqueue one turn; raises ``InvalidId`` / ``TurnTooLarge`` / ``UnknownTier`` before
        writing anything."""
        return self.submit_many([(user, text)], tier=tier, meta=meta, turn_ids=[turn_id],
                                create_tier=create_tier)[0]

    def submit_many(self, turns: Iterable[tuple[str, str]], tier: str = "chat",
                    meta: Mapping[str, Any] | None = None,
                    turn_ids: list[str | None] | None = None, *,
                    create_tier: bool = False) -> list[TurnHandle]:
        """Enqueue many ``(user, text)`` turns in one script call and round trip, in the given order
        (on Redis Cluster: every inbox entry, then every notification, see the module docstring).

        ``create_tier=True`` writes the default policy of a tier that does not exist yet.
        """
        built = [_build_turn(u, t, tier, meta, (turn_ids or [])[i] if turn_ids else None,
                             self.max_turn_bytes) for i, (u, t) in enumerate(turns)]
        if not built:
            return []
        tier = built[0][0].tier
        self._ensure_tier(tier, create_tier)
        opts = self._submit_options(tier)
        for pool, part in split_by_pool(tier, built, opts):  # a tier with groups: one per group
            pressure = _pressure_due(self, pool, part[-1][0].user)
            done = submit_round_trip(self.r, part, pool, opts, pressure)
            _count_wait(self, opts, done, part)
            if pressure is not None and _needs_pressure(done):
                post_pressure(self.r, pool, pressure)
        return [TurnHandle(self, t.user, t.tier, t.turn_id, t.ts) for t, _ in built]

    def _ensure_tier(self, tier: str, create: bool) -> None:
        if tier in self._tiers:
            return
        if not self._tier_exists(tier):
            if not create:
                raise UnknownTier(tier)
            write_policy(self.r, tier, TurnsPolicy())
        self._tiers.add(tier)

    def _tier_exists(self, tier: str) -> bool:
        has_policy, tiers, registry = read_tier_probe(self.r, tier)
        if tier_defined(tier, has_policy, tiers):
            return True
        return any_beating(self.r, heartbeats_of(tier, registry))

    def results(self, handles: Iterable[TurnHandle], timeout: float = 30.0) -> list[Reply]:
        """Wait for every handle, sharing one deadline."""
        deadline = time.monotonic() + timeout
        return [h.result(max(0.01, deadline - time.monotonic())) for h in handles]

    def _wait(self, user: str, turn_id: str, timeout: float) -> Reply:
        raw = wait_reply(self.r, user, turn_id, timeout)
        if raw is None:
            raise TurnTimeout(f"no reply to turn {turn_id} of {user} within {timeout:g}s "
                              "(is a worker running for its tier? `fleet status`)")
        return _decode_reply(raw, self.max_reply_bytes)

    def close(self) -> None:
        self.r.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncFleet:
    """The asyncio twin of ``Fleet``: ``await fleet.ask(user, text)``."""

    def __init__(self, url: str | None = None, *, client: aioredis.Redis | None = None,
                 max_turn_bytes: int = DEFAULT_MAX_TURN_BYTES,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> None:
        self.r = client or connect_async(url)
        self.max_turn_bytes = max_turn_bytes
        self.max_reply_bytes = max_reply_bytes
        self._tiers: set[str] = set()  # tiers found to exist: not checked again
        self._options: dict[str, tuple[SubmitOptions, float]] = {}  # tier -> (options, read at, monotonic)
        self._checked: dict[str, float] = {}  # tier -> when a submit last checked it for pressure
        self.acks = ReplicaAcks.of("submit")  # the submits' WAITs (a tier's replica_acks)
        self.unreplicated: deque[str] = deque(maxlen=UNREPLICATED_KEEP)  # turn ids of short WAITs

    def reread_policies(self) -> None:
        """``Fleet.reread_policies``."""
        self._options.clear()

    async def _submit_options(self, tier: str) -> SubmitOptions:
        """``Fleet._submit_options`` on asyncio."""
        opts, at = self._options.get(tier, (SubmitOptions(), -OPTIONS_TTL_S))
        if time.monotonic() - at >= OPTIONS_TTL_S:
            opts = await read_submit_options_async(self.r, tier)
            self._options[tier] = (opts, time.monotonic())
        return opts

    async def submit(self, user: str, text: str, tier: str = "chat",
                     meta: Mapping[str, Any] | None = None, turn_id: str | None = None, *,
                     create_tier: bool = False) -> Turn:
        """Enqueue one turn; returns it (its ``turn_id`` is what ``wait`` needs)."""
        turn, payload = _build_turn(user, text, tier, meta, turn_id, self.max_turn_bytes)
        await self._ensure_tier(turn.tier, create_tier)
        return (await self._submit_built([(turn, payload)], turn.tier))[0]

    async def _submit_built(self, built: list[tuple[Turn, bytes]], tier: str) -> list[Turn]:
        opts = await self._submit_options(tier)
        for pool, part in split_by_pool(tier, built, opts):  # a tier with groups: one per group
            pressure = _pressure_due(self, pool, part[-1][0].user)
            done = await submit_round_trip_async(self.r, part, pool, opts, pressure)
            _count_wait(self, opts, done, part)
            if pressure is not None and _needs_pressure(done):
                await post_pressure_async(self.r, pool, pressure)
        return [t for t, _ in built]

    async def submit_many(self, turns: Iterable[tuple[str, str]], tier: str = "chat",
                          meta: Mapping[str, Any] | None = None,
                          turn_ids: list[str | None] | None = None, *,
                          create_tier: bool = False) -> list[Turn]:
        """``Fleet.submit_many`` on asyncio: the turns, in the given order (one script call and
        round trip; on Redis Cluster every inbox entry, then every notification)."""
        built = [_build_turn(u, t, tier, meta, (turn_ids or [])[i] if turn_ids else None,
                             self.max_turn_bytes) for i, (u, t) in enumerate(turns)]
        if not built:
            return []
        tier = built[0][0].tier
        await self._ensure_tier(tier, create_tier)
        return await self._submit_built(built, tier)

    async def _ensure_tier(self, tier: str, create: bool) -> None:
        if tier in self._tiers:
            return
        if not await self._tier_exists(tier):
            if not create:
                raise UnknownTier(tier)
            await write_policy_async(self.r, tier, TurnsPolicy())
        self._tiers.add(tier)

    async def _tier_exists(self, tier: str) -> bool:
        has_policy, tiers, registry = await read_tier_probe_async(self.r, tier)
        if tier_defined(tier, has_policy, tiers):
            return True
        return await any_beating_async(self.r, heartbeats_of(tier, registry))

    async def wait(self, user: str, turn_id: str, timeout: float = 30.0) -> Reply:
        """The reply of a submitted turn; ``TurnTimeout`` if none in time."""
        raw = await wait_reply_async(self.r, user, turn_id, timeout)
        if raw is None:
            raise TurnTimeout(f"no reply to turn {turn_id} of {user} within {timeout:g}s")
        return _decode_reply(raw, self.max_reply_bytes)

    async def ask(self, user: str, text: str, tier: str = "chat", timeout: float = 30.0,
                  meta: Mapping[str, Any] | None = None, *, create_tier: bool = False) -> Reply:
        """Submit and wait."""
        turn = await self.submit(user, text, tier, meta, create_tier=create_tier)
        return await self.wait(user, turn.turn_id, timeout)

    async def aclose(self) -> None:
        await self.r.aclose()
