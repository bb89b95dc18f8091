"""Tier policies in Redis: read with fallback to the last good one, written only when valid.

``fleet:policy:{<tier>}`` is the user's key (edited by ``fleet policy set`` or a raw ``SET``).
Whoever reads it validates it, against its own handler registry too: a policy naming a
handler the reader cannot load is rejected *for that reader*, which runs the last good
policy instead. Only the tier's workers, which run its handler, record what they found
(``record=True``): a key they accept is copied to ``...:good``, a rejected one is noted in
``...:status`` with the reason and which worker found it. Everyone else only reads (the
commander checks the key against the handlers its live workers registered; ``fleet status``,
``policy get`` and ``top`` show what the workers recorded): a read never writes.

:func:`read_policy` and :func:`write_policy` run on a blocking or an asyncio client
(``stores.roundtrips``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from protocol import keys
from protocol.codec import as_str
from protocol.ids import InvalidId, validate_tier
from protocol.policy import Policy, PolicyError, TurnsPolicy, parse_policy
from stores.bad_state import DEFAULT, BadState, readable, reject_wrong_type
from stores.roundtrips import Op, Pipelined, Single, operation


@dataclass(frozen=True)
class PolicyRead:
    """The policy in force for a tier, and why."""

    tier: str
    policy: Policy
    source: str  # "key", "last-good" or "default"
    error: str | None = None  # why the key was rejected, if it was
    missing_handler: str | None = None  # the key is valid but names a handler this reader lacks


def _resolve(tier: str, raw: bytes | Exception | None, goods: Iterable[bytes | None],
             handlers: Iterable[str] | None, group: str | None = None) -> PolicyRead:
    """The policy in force; ``handlers`` are checked against ``group``'s handler (the reader's).
    ``raw``: the key, or the error reading it (a key of another type); ``goods``: the last good
    copies to fall back on, the reader's group's first."""
    if raw is None:
        return PolicyRead(tier, TurnsPolicy(), "default")
    missing = None
    try:
        if isinstance(raw, Exception):
            raise PolicyError(f"the key cannot be read as a policy: {reject_wrong_type(raw)}")
        return PolicyRead(tier, parse_policy(raw, handlers, group), "key")
    except PolicyError as exc:
        error = str(exc)
        if handlers is not None and not isinstance(raw, Exception):
            with contextlib.suppress(PolicyError):  # valid but for the handler: say which
                found = parse_policy(raw)
                missing = found.group_handler(group) if isinstance(found, TurnsPolicy) else None
    for good in goods:
        if good is None:
            continue
        try:
            return PolicyRead(tier, parse_policy(good, handlers, group), "last-good", error, missing)
        except PolicyError:
            continue  # the registry changed under the last good one: the next, else defaults
    return PolicyRead(tier, TurnsPolicy(), "default", error, missing)


def _verdict(read: PolicyRead) -> tuple[bytes, bytes]:
    return (read.source.encode(), (read.error or "").encode())


@dataclass(frozen=True)
class _Writes:
    """What a recording reader writes back: the new last good copies (the tier's, and its
    group's), and its verdict when it changed."""

    good: bytes | None = None
    group_good: bytes | None = None
    status: dict[str, str] | None = None


def _plan_writes(read: PolicyRead, raw: bytes | None, goods: tuple[bytes | None, bytes | None],
                 status: list[bytes | None] | Exception, reader: str, group: str | None) -> _Writes:
    """The key, once this reader accepts it, becomes the last good copy: the tier's (its
    structure: what submit and the commander read) and, for a group's worker, its group's."""
    accepted = read.source == "key"
    good, group_good = goods
    writes = _Writes(raw if accepted and raw != good else None,
                     raw if accepted and group and raw != group_good else None)
    if isinstance(status, Exception):  # the status key is of another type: not written over
        reject_wrong_type(status)
        return writes
    if tuple(status) == _verdict(read):
        return writes
    return replace(writes, status={"ok": "0" if read.error else "1", "error": read.error or "",
                                   "source": read.source, "by": reader, "ts": f"{time.time():.3f}"})


def _queue_reads(pipe: Any, tier: str, group: str | None) -> None:
    # GETs, not one MGET: redis-py's cluster pipeline refuses MGET (the keys share the tier's
    # slot, ``fleet:policy:{T}...``, so either would be single-slot)
    pipe.get(keys.policy(tier))
    pipe.get(keys.policy_good(tier))
    if group:  # (a tier's own reader has no copy of its own: no second read of the tier's)
        pipe.get(keys.policy_good(tier, group))
    pipe.hmget(keys.policy_status(tier, group or ""), ["source", "error"])


def _unpack(replies: list[Any], group: str | None) -> tuple[Any, Any, Any, Any]:
    """(key, the tier's good copy, the group's good copy or None, status) from ``_queue_reads``."""
    if group:
        raw, good, group_good, status = replies
        return raw, good, group_good, status
    raw, good, status = replies
    return raw, good, None, status


def _queue_writes(pipe: Any, tier: str, group: str | None, writes: _Writes) -> None:
    if writes.good is not None:
        pipe.set(keys.policy_good(tier), writes.good)
    if writes.group_good is not None and group:
        pipe.set(keys.policy_good(tier, group), writes.group_good)
    if writes.status is not None:
        pipe.hset(keys.policy_status(tier, group or ""), mapping=writes.status)


def _goods(good: bytes | None, group_good: bytes | None, group: str | None) -> tuple[bytes | None, ...]:
    """The last good copies a reader falls back on, its group's first."""
    return (group_good, good) if group else (good,)


@operation
def read_policy(tier: str, handlers: Iterable[str] | None = None, *, record: bool = False, reader: str = "",
                group: str | None = None) -> Op[PolicyRead]:
    """Read and validate a tier's policy; with ``record``, note a changed verdict and copy an
    accepted key to the last good one (for the tier's own processes). ``handlers`` are checked
    against the handler of ``group`` (the reader's pool)."""
    replies = yield Pipelined(lambda pipe: _queue_reads(pipe, tier, group), raise_on_error=False)
    raw, good, group_good, status = _unpack(replies, group)
    good, group_good = readable(good), readable(group_good)  # (a copy of another type: none)
    read = _resolve(tier, raw, _goods(good, group_good, group), handlers, group)
    if record:
        writes = _plan_writes(read, readable(raw), (good, group_good), status, reader, group)
        if writes != _Writes():
            with contextlib.suppress(NoPermissionError):  # a read-only user cannot record it
                yield Pipelined(lambda pipe: _queue_writes(pipe, tier, group, writes))
    return read


def read_policy_status(r: redis.Redis, tier: str, group: str = "") -> dict[str, str]:
    """What the tier's processes (a group's workers: ``group``) last recorded about its key:
    ok, error, source, by, ts."""
    try:
        raw = r.hgetall(keys.policy_status(tier, group))
    except ResponseError as exc:
        reject_wrong_type(exc)
        return {}
    return {as_str(k, errors="replace"): as_str(v, errors="replace") for k, v in raw.items()}


def _queue_policy_write(pipe: Any, tier: str, policy: Policy) -> None:
    """The key only: it becomes the last good copy once the tier's processes accept it (a
    handler they cannot load must not replace the policy they run).

    The key, then ``fleet:tiers``, in a plain pipeline: no transaction, because the two are in
    different slots (a Cluster refuses a cross-slot MULTI), and none is needed: whoever lists
    or probes tiers takes a tier from its policy key *or* from ``fleet:tiers``
    (``list_tiers``, the client's tier probe), so a write cut between the two still defines
    the tier, and the next ``ensure_policy``/``write_policy`` adds the name."""
    pipe.set(keys.policy(tier), policy.to_json())
    pipe.sadd(keys.TIERS, tier)


@operation
def write_policy(tier: str, policy: Policy) -> Op[None]:
    """Store a validated policy as the tier's key (its workers make it the last good copy).

    Its ``rollout.epoch`` never goes back, and goes up by one when the groups' weights change
    (``protocol.groups.settle``: a user's group is chosen once per epoch): whoever writes a
    policy need not know the epoch."""
    try:
        raw = yield Single(lambda r: r.get(keys.policy(tier)))
    except ResponseError:  # a key of another type: overwritten, as it always was
        raw = None
    policy = with_epoch(policy, raw)
    yield Pipelined(lambda pipe: _queue_policy_write(pipe, tier, policy))


def with_epoch(policy: Policy, stored: Any) -> Policy:
    """``policy`` with the epoch it takes over ``stored`` (the raw key; garbage counts as none)."""
    if not isinstance(policy, TurnsPolicy):
        return policy
    try:
        before = parse_policy(stored) if stored is not None else None
    except PolicyError:
        before = None
    if not isinstance(before, TurnsPolicy):
        return policy
    epoch = max(policy.rollout.epoch, before.rollout.epoch)
    if policy.rollout.weights() != before.rollout.weights() and policy.rollout.epoch <= before.rollout.epoch:
        epoch = before.rollout.epoch + 1
    if epoch == policy.rollout.epoch:
        return policy
    return policy.model_copy(update={"rollout": policy.rollout.model_copy(update={"epoch": epoch})})


def has_policy_key(r: redis.Redis, tier: str) -> bool:
    """Whether the tier's policy key exists (without reading it, so no verdict is recorded)."""
    return bool(r.exists(keys.policy(tier)))


def ensure_policy(r: redis.Redis, tier: str) -> None:
    """Write the default policy if the tier has no key; else make sure ``fleet:tiers`` names it."""
    if r.get(keys.policy(tier)) is None:
        write_policy(r, tier, TurnsPolicy())
    else:
        r.sadd(keys.TIERS, tier)


def read_good_policy(r: redis.Redis, tier: str) -> Any:
    """The tier's last good policy as stored (``keys.policy_good``), or None."""
    return r.get(keys.policy_good(tier))


def list_tiers(r: redis.Redis, bad: BadState = DEFAULT) -> list[str]:
    """Tiers known to the fleet: registered ones, and any with a policy key (even a raw ``SET``).
    A member of ``fleet:tiers`` no tier can have, or the set of another type, is told to ``bad``."""
    return sorted(registered_tiers(r, bad) | policy_key_tiers(r))


def registered_tiers(r: redis.Redis, bad: BadState = DEFAULT) -> set[str]:
    """The members of ``fleet:tiers`` (``write_policy`` adds each tier): one round trip. A member
    no tier can have, or the set of another type, is told to ``bad``."""
    names = set()
    try:
        members = r.smembers(keys.TIERS)
    except ResponseError as exc:
        bad.note("tier", keys.TIERS, "", reject_wrong_type(exc))
        members = set()
    for member in members:
        try:
            names.add(validate_tier(as_str(member, errors="replace")))
        except InvalidId as exc:
            bad.note("tier", keys.TIERS, member, exc)
    return names


def policy_key_tiers(r: redis.Redis) -> set[str]:
    """The tiers with a policy key, found by a ``SCAN`` of the whole keyspace: a round trip per
    500 keys in Redis (every user's keys too), so a commander does it only now and then."""
    names = set()
    prefix = keys.POLICY_PREFIX + "{"
    for key in r.scan_iter(match=prefix + "*}", count=500):
        name = as_str(key, errors="replace")[len(prefix):-1]
        if name:
            try:
                names.add(validate_tier(name))
            except InvalidId:
                continue  # a key no tier can have: not ours
    return names


def has_rq_tier(r: redis.Redis) -> bool:
    """Whether any tier's policy is kind rq: only then is RQ part of this fleet, and its keys
    (``rq:*``, outside the ``fleet:*`` of the documented ACL) worth reading."""
    return any(read_policy(r, tier).policy.kind == "rq" for tier in list_tiers(r))


async def tier_defined_async(r: aioredis.Redis, tier: str) -> bool:
    """Whether a policy defines ``tier``: every way of defining one writes its key."""
    return bool(await r.exists(keys.policy(tier)))
