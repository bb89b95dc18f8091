"""Tier policies in Redis: read with fallback to the last good one, written only when valid.

``fleet:policy:<tier>`` is the user's key (edited by ``fleet policy set`` or a raw ``SET``).
Whoever reads it validates it; a valid one is copied to ``...:good``, an invalid one is
recorded in ``...:status`` with its reason and the last good policy is used instead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from protocol import keys
from protocol.ids import InvalidId, validate_tier
from protocol.policy import Policy, PolicyError, parse_policy


@dataclass(frozen=True)
class PolicyRead:
    """The policy in force for a tier, and why."""

    tier: str
    policy: Policy
    source: str  # "key", "last-good" or "default"
    error: str | None = None  # why the key was rejected, if it was


def _resolve(tier: str, raw: bytes | None, good: bytes | None, handlers: Iterable[str] | None) -> PolicyRead:
    if raw is None:
        return PolicyRead(tier, Policy(), "default")
    try:
        return PolicyRead(tier, parse_policy(raw, handlers), "key")
    except PolicyError as exc:
        error = str(exc)
    if good is not None:
        try:
            return PolicyRead(tier, parse_policy(good, handlers), "last-good", error)
        except PolicyError:
            pass  # the registry changed under the last good one: fall through to defaults
    return PolicyRead(tier, Policy(), "default", error)


def _verdict(read: PolicyRead) -> tuple[bytes, bytes]:
    return (read.source.encode(), (read.error or "").encode())


def _plan_writes(tier: str, read: PolicyRead, raw: bytes | None, good: bytes | None,
                 status: list[bytes | None]) -> tuple[bytes | None, dict[str, str] | None]:
    """What to write back: the new last-good copy, and the status only when the verdict changed."""
    new_good = raw if read.source == "key" and raw != good else None
    if tuple(status) == _verdict(read):
        return new_good, None
    fields = {"ok": "0" if read.error else "1", "error": read.error or "", "source": read.source,
              "ts": f"{time.time():.3f}"}
    return new_good, fields


def _queue_reads(pipe: Any, tier: str) -> None:
    pipe.mget(keys.policy(tier), keys.policy_good(tier))
    pipe.hmget(keys.policy_status(tier), ["source", "error"])


def _queue_writes(pipe: Any, tier: str, new_good: bytes | None, status: dict[str, str] | None) -> bool:
    if new_good is not None:
        pipe.set(keys.policy_good(tier), new_good)
    if status is not None:
        pipe.hset(keys.policy_status(tier), mapping=status)
    return new_good is not None or status is not None


def read_policy(r: redis.Redis, tier: str, handlers: Iterable[str] | None = None) -> PolicyRead:
    """Read and validate a tier's policy (blocking client); record a changed verdict."""
    pipe = r.pipeline(transaction=False)
    _queue_reads(pipe, tier)
    (raw, good), status = pipe.execute()
    read = _resolve(tier, raw, good, handlers)
    pipe = r.pipeline(transaction=False)
    if _queue_writes(pipe, tier, *_plan_writes(tier, read, raw, good, status)):
        with contextlib.suppress(NoPermissionError):  # a read-only observer cannot record it
            pipe.execute()
    return read


async def read_policy_async(r: aioredis.Redis, tier: str,
                            handlers: Iterable[str] | None = None) -> PolicyRead:
    """Read and validate a tier's policy (asyncio client); record a changed verdict."""
    pipe = r.pipeline(transaction=False)
    _queue_reads(pipe, tier)
    (raw, good), status = await pipe.execute()
    read = _resolve(tier, raw, good, handlers)
    pipe = r.pipeline(transaction=False)
    if _queue_writes(pipe, tier, *_plan_writes(tier, read, raw, good, status)):
        with contextlib.suppress(NoPermissionError):  # a read-only user cannot record it
            await pipe.execute()
    return read


def _queue_policy_write(pipe: Any, tier: str, policy: Policy) -> None:
    body = policy.to_json()
    pipe.set(keys.policy(tier), body)
    pipe.set(keys.policy_good(tier), body)
    pipe.sadd(keys.TIERS, tier)
    pipe.hset(keys.policy_status(tier), mapping={"ok": "1", "error": "", "source": "key",
                                                 "ts": f"{time.time():.3f}"})


def write_policy(r: redis.Redis, tier: str, policy: Policy) -> None:
    """Store a validated policy as the tier's key and its last good copy."""
    pipe = r.pipeline(transaction=True)
    _queue_policy_write(pipe, tier, policy)
    pipe.execute()


async def write_policy_async(r: aioredis.Redis, tier: str, policy: Policy) -> None:
    """The asyncio twin of ``write_policy``."""
    pipe = r.pipeline(transaction=True)
    _queue_policy_write(pipe, tier, policy)
    await pipe.execute()


def list_tiers(r: redis.Redis) -> list[str]:
    """Tiers known to the fleet: registered ones, and any with a policy key (even a raw ``SET``)."""
    names = {t.decode() if isinstance(t, bytes) else t for t in r.smembers(keys.TIERS)}
    prefix = keys.POLICY_PREFIX + "{"
    for key in r.scan_iter(match=prefix + "*}", count=500):
        name = (key.decode() if isinstance(key, bytes) else key)[len(prefix):-1]
        if name:
            try:
                names.add(validate_tier(name))
            except InvalidId:
                continue  # a key no tier can have: not ours
    return sorted(names)


async def tier_defined_async(r: aioredis.Redis, tier: str) -> bool:
    """Whether a policy defines ``tier``: every way of defining one writes its key."""
    return bool(await r.exists(keys.policy(tier)))
