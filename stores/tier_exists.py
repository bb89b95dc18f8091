"""Whether a tier exists, as a client checks before it submits: a turn for a tier that no
policy defines and no worker serves would wait forever.

A tier exists if its policy key exists, ``fleet:tiers`` names it, or a registered worker of the
tier has a live heartbeat (:func:`tier_exists`). The registry is read only when no policy
names the tier, and a role that may not read it (``fleet-client``) knows a tier by its policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from protocol import keys
from protocol.codec import CodecError, as_str, decode
from protocol.ids import InvalidId
from protocol.models import WorkerInfo
from stores.bad_state import readable, reject_wrong_type
from stores.roundtrips import Op, Pipelined, Single, operation


def queue_tier_probe(pipe: Any, tier: str) -> None:
    """``[has_policy, tiers]``: what :func:`tier_defined` reads."""
    pipe.exists(keys.policy(tier))
    pipe.smembers(keys.TIERS)


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


def queue_any_beating(pipe: Any, beats: list[str]) -> None:
    """One ``EXISTS`` per heartbeat key (each worker's key has its own slot)."""
    for beat in beats:
        pipe.exists(beat)


@operation
def read_tier_probe(tier: str) -> Op[list[Any]]:
    """``[has_policy, tiers]`` of :func:`queue_tier_probe`, in one round trip."""
    has_policy, tiers = yield Pipelined(lambda pipe: queue_tier_probe(pipe, tier), raise_on_error=False)
    return [readable(has_policy), readable(tiers, set())]  # (a tier set of another type: empty)


@operation
def tier_exists(tier: str) -> Op[bool]:
    """Whether ``tier`` exists: one round trip, and when no policy defines it, one for the
    registry and one for the heartbeats of the tier's registered workers (False if the
    connection's ACL user may not read the registry)."""
    has_policy, tiers = yield from read_tier_probe.steps(tier)
    if tier_defined(tier, has_policy, tiers):
        return True
    try:
        registry = yield Single(lambda r: r.hgetall(keys.WORKERS))
    except NoPermissionError:
        return False
    except ResponseError as exc:  # a registry of another type: no worker is known
        reject_wrong_type(exc)
        return False
    beats = heartbeats_of(tier, registry)
    if not beats:
        return False
    alive = yield Pipelined(lambda pipe: queue_any_beating(pipe, beats))
    return any(int(n) for n in alive)
