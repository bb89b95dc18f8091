"""The Lua scripts of ``stores/lua`` (one file, one operation, KEYS/ARGV header each), and
:class:`Scripts`, the one registry of them for either kind of client.

redis-py's script objects run by EVALSHA and load themselves again on NOSCRIPT, so a Redis
restart (which forgets the script cache) costs a reload, not an error.
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from importlib import resources
from typing import Any, Generic, TypeVar, overload

import redis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript, Script

NAMES = ("lane_acquire", "lease_renew", "lease_drop", "turn_commit", "leader_acquire",
         "ledger_append", "lane_clear", "consumer_drop", "notification_ack",
         "notification_ack_covered", "notification_touch", "turn_submit", "submit_pressure")
_INCLUDE = re.compile(r"^-- @include (\w+)$", re.MULTILINE)


@cache
def source(name: str) -> str:
    """The text of ``stores/lua/<name>.lua``, with each ``-- @include <part>`` line replaced by
    ``stores/lua/include/<part>.lua`` (a function two scripts share: Redis has no includes)."""
    if name not in NAMES:
        raise KeyError(f"no Lua script named {name!r}")
    lua = resources.files("stores").joinpath("lua")
    return _INCLUDE.sub(lambda m: lua.joinpath("include", f"{m.group(1)}.lua").read_text(),
                        lua.joinpath(f"{name}.lua").read_text())


@cache
def sha(name: str) -> str:
    """The SHA1 that ``EVALSHA`` names script ``name`` by (for calls queued as raw commands)."""
    return hashlib.sha1(source(name).encode()).hexdigest()


ScriptT = TypeVar("ScriptT", Script, AsyncScript)


class Scripts(Generic[ScriptT]):
    """Every script, bound to client ``r``: redis-py's ``Script`` objects on a blocking client
    (``redis.Redis``, ``fakeredis.FakeRedis``), ``AsyncScript`` ones on an asyncio client. Each
    runs by ``EVALSHA`` and loads itself again on ``NOSCRIPT``; ``client=pipe`` queues a call on a
    pipeline of the same client instead."""

    lane_acquire: ScriptT
    lease_renew: ScriptT
    lease_drop: ScriptT
    turn_commit: ScriptT
    leader_acquire: ScriptT
    ledger_append: ScriptT
    lane_clear: ScriptT
    consumer_drop: ScriptT
    notification_ack: ScriptT
    notification_ack_covered: ScriptT
    notification_touch: ScriptT
    turn_submit: ScriptT
    submit_pressure: ScriptT

    @overload
    def __init__(self: Scripts[Script], r: redis.Redis) -> None: ...

    @overload
    def __init__(self: Scripts[AsyncScript], r: aioredis.Redis) -> None: ...

    def __init__(self, r: Any) -> None:
        for name in NAMES:
            setattr(self, name, r.register_script(source(name)))
