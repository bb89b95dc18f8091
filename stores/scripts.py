"""Loads the Lua scripts of ``stores/lua`` (one file, one operation, KEYS/ARGV header each).

redis-py's ``Script`` objects run by EVALSHA and reload on NOSCRIPT, so a Redis restart
(which forgets the script cache) costs one extra round trip, not an error.
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from importlib import resources

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


class Scripts:
    """The scripts bound to one asyncio client."""

    def __init__(self, r: aioredis.Redis) -> None:
        self.lane_acquire: AsyncScript = r.register_script(source("lane_acquire"))
        self.lease_renew: AsyncScript = r.register_script(source("lease_renew"))
        self.lease_drop: AsyncScript = r.register_script(source("lease_drop"))
        self.turn_commit: AsyncScript = r.register_script(source("turn_commit"))
        self.notification_ack: AsyncScript = r.register_script(source("notification_ack"))
        self.notification_ack_covered: AsyncScript = r.register_script(source("notification_ack_covered"))
        self.notification_touch: AsyncScript = r.register_script(source("notification_touch"))
        self.turn_submit: AsyncScript = r.register_script(source("turn_submit"))
        self.submit_pressure: AsyncScript = r.register_script(source("submit_pressure"))


class SyncScripts:
    """The scripts the commander's takeover runs, bound to one blocking client.

    A blocking client (``redis.Redis``, or ``fakeredis.FakeRedis`` in the simulator and unit
    tests) cannot run the ``AsyncScript`` objects of ``Scripts``; pass ``client=pipe`` to run
    one on a pipeline of the same client.
    """

    def __init__(self, r: redis.Redis) -> None:
        self.lane_clear: Script = r.register_script(source("lane_clear"))
        self.consumer_drop: Script = r.register_script(source("consumer_drop"))
