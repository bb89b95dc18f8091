"""The submit's commands (DESIGN §3, ``fleet/client.py`` explains them): one round trip of
``MULTI`` .. ``EXEC`` then the gauges, the tier probe, pressure events and the reply wait.

The client builds and validates the turns; every Redis command it sends is queued or sent
here, on a blocking or an asyncio client alike (the pipeline functions take either).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from protocol import keys
from protocol.codec import CodecError, as_str, decode
from protocol.ids import InvalidId
from protocol.models import Turn, WorkerInfo
from stores.backlog import queue_submit_gauges

PRESSURE_MAXLEN = 10_000


def queue_submit(pipe: Any, turn: Turn, payload: bytes) -> None:
    pipe.xadd(keys.inbox(turn.user), {"m": payload})
    pipe.xadd(keys.ready(turn.tier), {"user": turn.user})
    pipe.zadd(keys.active(turn.tier), {turn.user: turn.ts})


SUBMIT_COMMANDS = 3  # per turn, inside the transaction


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


def queue_round_trip(pipe: Any, built: list[tuple[Turn, bytes]], tier: str) -> None:
    pipe.execute_command("MULTI")
    for turn, payload in built:
        queue_submit(pipe, turn, payload)
    pipe.execute_command("EXEC")
    queue_submit_gauges(pipe, tier)


def submit_round_trip(r: redis.Redis, built: list[tuple[Turn, bytes]], tier: str) -> list[Any]:
    """Submit ``built`` in one transaction and round trip; the gauges read after it."""
    pipe = submit_pipeline(r)
    queue_round_trip(pipe, built, tier)
    return committed(pipe.execute(raise_on_error=False), len(built))


async def submit_round_trip_async(r: aioredis.Redis, built: list[tuple[Turn, bytes]],
                                  tier: str) -> list[Any]:
    """:func:`submit_round_trip` on an asyncio client."""
    pipe = submit_pipeline(r)
    queue_round_trip(pipe, built, tier)
    return committed(await pipe.execute(raise_on_error=False), len(built))


def committed(results: list[Any], turns: int) -> list[Any]:
    """Raise the first error of the submit transaction; return the gauges read after it.

    ``results`` are the round trip's replies: ``MULTI``, one ``QUEUED`` per command, ``EXEC``,
    then the gauges. A command refused when queued (``NOPERM``, a syntax error) makes Redis
    discard the whole transaction (``EXECABORT``): that first refusal is the one raised.
    """
    queued = 1 + SUBMIT_COMMANDS * turns
    _raise_first_error(results[:queued])
    applied = results[queued]
    if isinstance(applied, Exception):
        raise applied
    if not isinstance(applied, list) or len(applied) != queued - 1:
        raise redis.ResponseError(f"unexpected reply to the submit's EXEC: {applied!r}")
    _raise_first_error(applied)
    return results[queued + 1:]


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


def _raise_first_error(results: list[Any]) -> None:
    for res in results:
        if isinstance(res, Exception):
            raise res


def post_pressure(r: redis.Redis, tier: str, fields: Mapping[str, str]) -> None:
    """Append a pressure event to the tier's stream (it wakes the commander)."""
    entry: dict[FieldT, EncodableT] = {k: v for k, v in fields.items()}  # a dict is invariant in its key
    r.xadd(keys.pressure(tier), entry, maxlen=PRESSURE_MAXLEN, approximate=True)


async def post_pressure_async(r: aioredis.Redis, tier: str, fields: Mapping[str, str]) -> None:
    """:func:`post_pressure` on an asyncio client."""
    entry: dict[FieldT, EncodableT] = {k: v for k, v in fields.items()}  # a dict is invariant in its key
    await r.xadd(keys.pressure(tier), entry, maxlen=PRESSURE_MAXLEN, approximate=True)


def any_beating(r: redis.Redis, beats: list[str]) -> bool:
    """Whether any of the heartbeat keys ``beats`` exists."""
    return bool(beats) and int(r.exists(*beats)) > 0


async def any_beating_async(r: aioredis.Redis, beats: list[str]) -> bool:
    """:func:`any_beating` on an asyncio client."""
    return bool(beats) and int(await r.exists(*beats)) > 0


def wait_reply(r: redis.Redis, user: str, turn_id: str, timeout: float) -> Any:
    """The raw reply of a turn (``BLPOP`` up to ``timeout`` s), or None if none came."""
    got = r.blpop([keys.reply(user, turn_id)], timeout=max(timeout, 0.01))
    return None if got is None else got[1]


async def wait_reply_async(r: aioredis.Redis, user: str, turn_id: str, timeout: float) -> Any:
    """:func:`wait_reply` on an asyncio client."""
    got = await r.blpop([keys.reply(user, turn_id)], timeout=max(timeout, 0.01))
    return None if got is None else got[1]
