"""Loads the Lua scripts of ``stores/lua`` (one file, one operation, KEYS/ARGV header each).

redis-py's ``Script`` objects run by EVALSHA and reload on NOSCRIPT, so a Redis restart
(which forgets the script cache) costs one extra round trip, not an error.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import redis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript, Script

NAMES = ("lane_acquire", "lease_renew", "lane_release", "lease_drop", "turn_commit", "leader_acquire",
         "ledger_append", "lane_clear", "consumer_drop", "notification_ack",
         "notification_ack_covered", "notification_touch")


@cache
def source(name: str) -> str:
    """The text of ``stores/lua/<name>.lua``."""
    if name not in NAMES:
        raise KeyError(f"no Lua script named {name!r}")
    return resources.files("stores").joinpath("lua", f"{name}.lua").read_text()


class Scripts:
    """The scripts bound to one asyncio client."""

    def __init__(self, r: aioredis.Redis) -> None:
        self.lane_acquire: AsyncScript = r.register_script(source("lane_acquire"))
        self.lease_renew: AsyncScript = r.register_script(source("lease_renew"))
        self.lane_release: AsyncScript = r.register_script(source("lane_release"))
        self.lease_drop: AsyncScript = r.register_script(source("lease_drop"))
        self.turn_commit: AsyncScript = r.register_script(source("turn_commit"))
        self.notification_ack: AsyncScript = r.register_script(source("notification_ack"))
        self.notification_ack_covered: AsyncScript = r.register_script(source("notification_ack_covered"))
        self.notification_touch: AsyncScript = r.register_script(source("notification_touch"))


class SyncScripts:
    """The scripts the commander's takeover runs, bound to one blocking client.

    A blocking client (``redis.Redis``, or ``fakeredis.FakeRedis`` in the simulator and unit
    tests) cannot run the ``AsyncScript`` objects of ``Scripts``; pass ``client=pipe`` to run
    one on a pipeline of the same client.
    """

    def __init__(self, r: redis.Redis) -> None:
        self.lane_clear: Script = r.register_script(source("lane_clear"))
        self.consumer_drop: Script = r.register_script(source("consumer_drop"))
