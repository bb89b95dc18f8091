"""Tier policies in Redis: read with fallback to the last good one, written only when valid.

``fleet:policy:<tier>`` is the user's key (edited by ``fleet policy set`` or a raw ``SET``).
Whoever reads it validates it; a valid one is copied to ``...:good``, an invalid one is
recorded in ``...:status`` with its reason and the last good policy is used instead.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from protocol import keys
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


def _status_fields(read: PolicyRead) -> dict[str, str]:
    return {"ok": "0" if read.error else "1", "error": read.error or "", "source": read.source,
            "ts": f"{time.time():.3f}"}


def read_policy(r: redis.Redis, tier: str, handlers: Iterable[str] | None = None) -> PolicyRead:
    """Read and validate a tier's policy (blocking client); record the verdict."""
    raw, good = r.mget(keys.policy(tier), keys.policy_good(tier))
    read = _resolve(tier, raw, good, handlers)
    pipe = r.pipeline(transaction=False)
    if read.source == "key" and raw != good:
        pipe.set(keys.policy_good(tier), raw)
    pipe.hset(keys.policy_status(tier), mapping=_status_fields(read))
    pipe.execute()
    return read


async def read_policy_async(r: aioredis.Redis, tier: str,
                            handlers: Iterable[str] | None = None) -> PolicyRead:
    """Read and validate a tier's policy (asyncio client); record the verdict."""
    raw, good = await r.mget(keys.policy(tier), keys.policy_good(tier))
    read = _resolve(tier, raw, good, handlers)
    pipe = r.pipeline(transaction=False)
    if read.source == "key" and raw != good:
        pipe.set(keys.policy_good(tier), raw)
    pipe.hset(keys.policy_status(tier), mapping=_status_fields(read))
    await pipe.execute()
    return read


def write_policy(r: redis.Redis, tier: str, policy: Policy) -> None:
    """Store a validated policy as the tier's key and its last good copy."""
    body = policy.to_json()
    pipe = r.pipeline(transaction=True)
    pipe.set(keys.policy(tier), body)
    pipe.set(keys.policy_good(tier), body)
    pipe.sadd(keys.TIERS, tier)
    pipe.hset(keys.policy_status(tier), mapping={"ok": "1", "error": "", "source": "key",
                                                 "ts": f"{time.time():.3f}"})
    pipe.execute()


def list_tiers(r: redis.Redis) -> list[str]:
    """Tiers known to the fleet (those with a policy written through Fleet)."""
    return sorted(t.decode() if isinstance(t, bytes) else t for t in r.smembers(keys.TIERS))
