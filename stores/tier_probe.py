"""What a client reads and writes around its submits, besides the turns themselves: the
tier's submit options (``ready_shards``, ``replica_acks``), whether the tier exists and has a
live worker, the pressure event that wakes the commander, and the wait for a reply.

Each works on a blocking or an asyncio client alike (the ``_async`` twins).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from protocol import keys
from protocol.codec import CodecError, as_str, decode
from protocol.groups import assign, pool_name, validate_group
from protocol.ids import InvalidId
from protocol.models import WorkerInfo
from protocol.policy import MAX_REPLICA_ACK_TIMEOUT_MS, MAX_REPLICA_ACKS
from protocol.policy_legacy import flat_view
from stores.replicas import ReplicaWait

PRESSURE_MAXLEN = 10_000


# --- the tier's submit options -----------------------------------------------------------
OPTIONS_TTL_S = 5.0  # a client reads the tier's submit options again after this long


@dataclass(frozen=True)
class SubmitOptions:
    """What a submit takes from the tier's policy: the ready shard count, and the ``WAIT``
    after the submit's writes (``replica_acks``; None: no WAIT, the commands of before)."""

    shards: int = 1
    wait: ReplicaWait | None = None
    groups: tuple[tuple[str, float], ...] = ()  # the tier's groups and weights (protocol.groups)
    rejected: frozenset[str] = frozenset()  # groups the commander rejected: weight 0 at submit


def queue_options_probe(pipe: Any, tier: str) -> None:
    """The tier's policy key, its last good copy and its rejected groups (one slot, the policy
    key's): :func:`submit_options_of` reads them."""
    pipe.get(keys.policy(tier))
    pipe.get(keys.policy_good(tier))
    pipe.hgetall(keys.groups_rejected(tier))  # (its fields: HGETALL is in the ACL of SECURITY.md, HKEYS not)


def _policy_fields(raw: Any, good: Any) -> dict[str, Any]:
    """The fields of the policy JSON ``raw``, else of ``good`` (the last valid one), else {}."""
    for blob in (raw, good):
        if not blob:
            continue
        try:
            fields = json.loads(blob)
        except (ValueError, RecursionError):
            continue
        if isinstance(fields, dict):
            return fields
    return {}


def _int_in(fields: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    n = fields.get(name, default)
    return n if isinstance(n, int) and not isinstance(n, bool) and low <= n <= high else default


def submit_options_of(raw: Any, good: Any, rejected: Iterable[Any] = ()) -> SubmitOptions:
    """The submit options of the policy JSON ``raw`` (else of ``good``). Lenient on purpose: a
    submit that uses a stale or odd value is still served (every worker of the tier reads every
    shard that exists, up to ``keys.MAX_READY_SHARDS``); an odd replica count means no WAIT; a
    turn sent to a group the user does not belong to is handed to the right one by the worker
    that meets it."""
    fields = flat_view(_policy_fields(raw, good))
    shards = _int_in(fields, "ready_shards", 1, 1, keys.MAX_READY_SHARDS)
    acks = _int_in(fields, "replica_acks", 0, 0, MAX_REPLICA_ACKS)
    timeout_ms = _int_in(fields, "replica_ack_timeout_ms", 100, 1, MAX_REPLICA_ACK_TIMEOUT_MS)
    return SubmitOptions(shards, ReplicaWait(acks, timeout_ms) if acks else None, _groups_of(fields),
                         frozenset(as_str(g) for g in rejected))


def _groups_of(fields: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """The (name, weight) of the policy's groups; () unless every one is well formed."""
    out: list[tuple[str, float]] = []
    groups = fields.get("groups")
    for g in groups if isinstance(groups, list) else ():
        name, weight = (g.get("name"), g.get("weight", 0)) if isinstance(g, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(weight, (int, float)) or isinstance(weight, bool):
            return ()
        try:
            out.append((validate_group(name), max(0.0, float(weight))))
        except InvalidId:
            return ()
    return tuple(out) if any(w > 0 for _, w in out) else ()


def split_by_pool(tier: str, built: list[Any], opts: SubmitOptions) -> list[tuple[str, list[Any]]]:
    """``built`` turns (``(Turn, payload)``) split by the pool each user's group is (by the hash
    against the weights; a pin is the worker's to honour: it hands the user over), in order: a
    user's turns all go to one pool, in their order. A tier without groups: one pool, itself."""
    if not opts.groups:
        return [(tier, built)]
    parts: dict[str, list[Any]] = {}
    for item in built:
        pool = pool_name(tier, assign(item[0].user, opts.groups, None, opts.rejected))
        parts.setdefault(pool, []).append(item)
    return list(parts.items())


def ready_shards_of(raw: Any, good: Any) -> int:
    """``ready_shards`` of :func:`submit_options_of`: 1..``keys.MAX_READY_SHARDS``, 1 when unnamed."""
    return submit_options_of(raw, good).shards


def read_submit_options(r: redis.Redis, tier: str) -> SubmitOptions:
    """The tier's :class:`SubmitOptions`, in one round trip."""
    pipe = r.pipeline(transaction=False)
    queue_options_probe(pipe, tier)
    return submit_options_of(*pipe.execute())


async def read_submit_options_async(r: aioredis.Redis, tier: str) -> SubmitOptions:
    """:func:`read_submit_options` on an asyncio client."""
    pipe = r.pipeline(transaction=False)
    queue_options_probe(pipe, tier)
    return submit_options_of(*await pipe.execute())


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
