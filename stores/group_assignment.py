"""Group assignment in Redis: users' pins, the groups the commander rejected, the pools a
tier's users were served on, and the policy a group's pool runs.

A pin (``fleet group pin U green``) is a field of the user's ``fleet:u:{U}:pins`` hash (tier ->
group), in the user's slot. Rejected groups (their interpreter is missing, or cannot import
their handler) are fields of ``fleet:policy:{T}:rejected``, in the slot of the tier's policy
key, so they are read with it. Who resolves a user's group (the client at submit, the worker
that meets the turn) calls :func:`protocol.groups.assign` with what these return.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import as_str
from protocol.groups import GroupRecord, pool_name, split_pool, validate_group, validate_pool
from protocol.ids import InvalidId, validate_tier
from protocol.policy import TurnsPolicy
from stores.bad_state import DEFAULT, BadState, reject_wrong_type
from stores.functions import Functions
from stores.policies import PolicyRead, read_policy
from stores.roundtrips import Op, Pipelined, Single, operation


def pin_group(r: redis.Redis, user: str, tier: str, group: str) -> None:
    """Pin ``user`` to ``group`` of ``tier``: its next turn is served there (the one in progress
    finishes where it is)."""
    r.hset(keys.pins(user), validate_tier(tier), validate_group(group))


def unpin_group(r: redis.Redis, user: str, tier: str) -> bool:
    """Remove ``user``'s pin on ``tier``; whether there was one."""
    return bool(r.hdel(keys.pins(user), validate_tier(tier)))


def user_pins(r: redis.Redis, user: str) -> dict[str, str]:
    """Every pin of ``user``: tier -> group (not the groups recorded for it: ``record_field``)."""
    return {as_str(k): as_str(v) for k, v in r.hgetall(keys.pins(user)).items()
            if not as_str(k).startswith(RECORD_MARK)}


# --- the group recorded for a user: chosen once per epoch of the weights (protocol.groups.settle)
RECORD_MARK = "@"  # a record's field in the pins hash is "@<tier>" (no tier name holds an "@")


def record_field(tier: str) -> str:
    return f"{RECORD_MARK}{tier}"


def _record(user: str, tier: str, raw: Any, bad: BadState) -> GroupRecord | None:
    """A record as read ("<group>|<epoch>"), or None when there is none or it is bad (told to ``bad``)."""
    if raw is None or isinstance(raw, Exception):
        return None  # (a pins key of another type is told by the pin's reading)
    text = as_str(raw, errors="replace")
    group, _, epoch = text.rpartition("|")
    try:
        if not epoch.isdigit() or len(epoch) > 12:
            raise InvalidId(f"not <group>|<epoch>: {text[:60]!r}")
        return validate_group(group), int(epoch)
    except InvalidId as exc:
        bad.note("pin", keys.pins(user), record_field(tier), exc)
        return None


async def read_pin_and_record(r: aioredis.Redis, user: str, tier: str,
                              bad: BadState = DEFAULT) -> tuple[str | None, GroupRecord | None, Any]:
    """``user``'s pin on ``tier``, the group recorded for it (None: none, or bad: told to
    ``bad``), and the record's raw value (what ``record_group`` compares with), in one round trip."""
    raw: list[Any]
    try:
        raw = await r.hmget(keys.pins(user), [tier, record_field(tier)])
    except ResponseError as exc:
        raw = [exc, None]
    return _pin(user, tier, raw[0], bad), _record(user, tier, raw[1], bad), raw[1]


async def record_group(r: aioredis.Redis, user: str, tier: str, read: Any, new: GroupRecord,
                       bad: BadState = DEFAULT) -> GroupRecord:
    """Record ``new`` for ``user`` on ``tier`` if the record is still ``read`` (as
    ``read_pin_and_record`` gave it); the record in force (``new`` if the key cannot hold one)."""
    found = await Functions(r).group_record(
        keys=[keys.pins(user)], args=[record_field(tier), as_str(read) if read is not None else "",
                                      f"{new[0]}|{new[1]}"])
    if not found:  # the key holds another type (nothing written), or the record went meanwhile
        return new
    return _record(user, tier, found, bad) or new


def _pin(user: str, tier: str, raw: Any, bad: BadState) -> str | None:
    """A pin as read (its reply, or the error of a pins key of another type): the group, or None
    when there is none or it is bad (told to ``bad``)."""
    if raw is None:
        return None
    try:
        if isinstance(raw, Exception):
            raise InvalidId(reject_wrong_type(raw))
        return validate_group(as_str(raw, errors="replace"))
    except InvalidId as exc:
        bad.note("pin", keys.pins(user), tier, exc)
        return None


def read_pins(r: redis.Redis, users: list[str], tier: str, bad: BadState = DEFAULT) -> dict[str, str | None]:
    """Each of ``users``' pin on ``tier`` (None: none, or a bad one: told to ``bad``), in one
    round trip."""
    pipe = r.pipeline(transaction=False)
    for user in users:
        pipe.hget(keys.pins(user), tier)
    replies = pipe.execute(raise_on_error=False)
    return {u: _pin(u, tier, raw, bad) for u, raw in zip(users, replies, strict=True)}


def remember_pools(r: redis.Redis, tier: str, pools: Iterable[str]) -> None:
    """Add ``pools`` to the pools the tier's users have been served on (:func:`keys.pools`)."""
    pools = [validate_pool(p) for p in pools]
    if pools:
        r.sadd(keys.pools(tier), *pools)


@operation
def known_pools(tier: str, bad: BadState = DEFAULT) -> Op[set[str]]:
    """The pools the tier's users have been served on and that are not forgotten yet (a member
    that is no pool, or a key of another type, is told to ``bad``: never a key)."""
    members, = yield Pipelined(lambda pipe: pipe.smembers(keys.pools(tier)), raise_on_error=False)
    if isinstance(members, Exception):  # (another error than another type is raised)
        bad.note("pool", keys.pools(tier), "", reject_wrong_type(members))
        return set()
    out = set()
    for raw in members:
        try:
            out.add(validate_pool(as_str(raw, errors="replace")))
        except InvalidId as exc:
            bad.note("pool", keys.pools(tier), raw, exc)
    return out


def forget_pool(r: redis.Redis, tier: str, pool: str) -> None:
    """A removed pool with nothing left queued on it: no longer looked at."""
    r.srem(keys.pools(tier), pool)


@operation
def rejected_groups(tier: str) -> Op[dict[str, str]]:
    """The tier's rejected groups: group -> reason."""
    try:
        raw = yield Single(lambda r: r.hgetall(keys.groups_rejected(tier)))
    except ResponseError as exc:  # a key of another type: no group is known rejected
        DEFAULT.note("pool", keys.groups_rejected(tier), "", reject_wrong_type(exc))
        return {}
    return {as_str(k, errors="replace"): as_str(v, errors="replace") for k, v in raw.items()}


def reject_group(r: redis.Redis, tier: str, group: str, reason: str) -> None:
    """Record that ``group``'s workers cannot start, and why (assignment skips it)."""
    r.hset(keys.groups_rejected(tier), validate_group(group), reason[:500])


def accept_group(r: redis.Redis, tier: str, group: str) -> bool:
    """Forget a rejection of ``group`` (its workers start now); whether there was one."""
    return bool(r.hdel(keys.groups_rejected(tier), group))


def pool_policy(read: PolicyRead, pool: str) -> PolicyRead:
    """The policy read of ``pool`` from its tier's ``read``: a group's pool runs its group's
    policy (the tier's, for the tier itself or a group the policy no longer names)."""
    group = split_pool(pool)[1]
    policy = read.policy
    if group and isinstance(policy, TurnsPolicy) and any(g.name == group for g in policy.rollout.groups):
        return replace(read, tier=pool, policy=policy.for_group(group))
    return replace(read, tier=pool)


def read_pool_policy(r: redis.Redis, pool: str, handlers: Iterable[str] | None = None) -> PolicyRead:
    """:func:`stores.policies.read_policy` of a tier or of a group's pool (:func:`pool_policy`)."""
    tier, group = split_pool(pool)
    return pool_policy(read_policy(r, tier, handlers, group=group or None), pool)


def with_group_pools(r: redis.Redis, tiers: Iterable[str]) -> list[str]:
    """``tiers``, each followed by its groups' pools (``chat``, ``chat.blue``, ``chat.green``)."""
    out: list[str] = []
    for tier in tiers:
        out.append(tier)
        out += [pool_name(tier, g.name) for g in read_policy(r, tier).policy.rollout.groups]
    return out
