"""The commanders' leader lease (``{fleet:events}:leader``) and its fencing epoch.

``SET NX PX`` with an epoch counter (``leader_acquire.lua``), renewed and dropped only by its
holder ``"<commander>|<epoch>"`` (``lease_renew.lua``, ``lease_drop.lua``). The logic of
leading (when to campaign, what a loss means) is ``commander/leader.py``'s.
"""

from __future__ import annotations

import redis

from protocol import keys
from protocol.codec import as_str
from stores.functions import Functions


class LeaderLease:
    """The lease scripts, on a blocking client."""

    def __init__(self, r: redis.Redis) -> None:
        scripts = Functions(r)
        self._acquire = scripts.leader_acquire
        self._renew = scripts.lease_renew
        self._drop = scripts.lease_drop

    def acquire(self, commander_id: str, ttl_ms: int) -> int | None:
        """Take the lease if it is free (or already ``commander_id``'s): its epoch, else None."""
        res = self._acquire(keys=[keys.LEADER, keys.EPOCH], args=[commander_id, ttl_ms])
        return int(res[1]) if int(res[0]) == 1 else None

    def renew(self, holder: str, ttl_ms: int) -> bool:
        """Extend the lease while ``holder`` holds it; False if it does not."""
        return int(self._renew(keys=[keys.LEADER], args=[holder, ttl_ms])) == 1

    def drop(self, holder: str) -> None:
        """Give up the lease if ``holder`` holds it."""
        self._drop(keys=[keys.LEADER], args=[holder])


def lease_holder(r: redis.Redis) -> str | None:
    """Who holds the lease now (``"<commander>|<epoch>"``), or None."""
    holder = r.get(keys.LEADER)
    return None if holder is None else as_str(holder)


def lease_ttl_ms(r: redis.Redis) -> int | None:
    """The lease's remaining time in ms, or None if it has none (no lease, or no TTL)."""
    ttl = r.pttl(keys.LEADER)
    return int(ttl) if ttl is not None and ttl >= 0 else None
