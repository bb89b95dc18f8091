"""Single writer: the leader lease (``SET NX PX``, renewed) with a fencing epoch (DESIGN §5, I4).

Only the leader acts, and it appends every change to the ledger *before* acting through a
script that refuses a deposed leader (``ledger_append.lua``): a commander that was paused
past its lease and wakes up finds its append fenced, so it never acts on a stale view.
"""

from __future__ import annotations

import logging

import redis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import encode
from protocol.models import LedgerEvent
from stores.scripts import source

log = logging.getLogger("fleet.commander")
EVENTS_MAXLEN = 100_000


class Deposed(Exception):
    """This commander no longer leads: stop acting."""


class Leadership:
    """One commander's claim on leadership, on a blocking client."""

    def __init__(self, r: redis.Redis, commander_id: str, ttl_ms: int = 3000) -> None:
        self.r = r
        self.commander_id = commander_id
        self.ttl_ms = ttl_ms
        self.epoch: int | None = None
        self._acquire = r.register_script(source("leader_acquire"))
        self._renew = r.register_script(source("lease_renew"))
        self._drop = r.register_script(source("lease_drop"))
        self._append = r.register_script(source("ledger_append"))

    @property
    def leading(self) -> bool:
        return self.epoch is not None

    @property
    def holder(self) -> str:
        return f"{self.commander_id}|{self.epoch}"

    def campaign(self) -> bool:
        """Take the lease if it is free (or already ours); True when leading."""
        res = self._acquire(keys=[keys.LEADER, keys.EPOCH], args=[self.commander_id, self.ttl_ms])
        if int(res[0]) == 1:
            epoch = int(res[1])
            if self.epoch != epoch:
                log.info("commander %s leads with epoch %d", self.commander_id, epoch)
            self.epoch = epoch
            return True
        self.epoch = None
        return False

    def renew(self) -> bool:
        """Extend the lease; on loss, become a standby (``leading`` turns False)."""
        if self.epoch is None:
            return False
        if int(self._renew(keys=[keys.LEADER], args=[self.holder, self.ttl_ms])) == 1:
            return True
        log.warning("commander %s lost the lease of epoch %d", self.commander_id, self.epoch)
        self.epoch = None
        return False

    def step_down(self) -> None:
        """Give up the lease now (a clean shutdown), so a standby takes over at once."""
        if self.epoch is not None:
            self._drop(keys=[keys.LEADER], args=[self.holder])
            self.epoch = None

    def append(self, event: LedgerEvent) -> str:
        """Append to the ledger, fenced: raises ``Deposed`` if another commander leads."""
        try:
            entry = self._append(keys=[keys.LEADER, keys.EVENTS],
                                 args=[self.holder, EVENTS_MAXLEN, encode(event), event.tier])
        except ResponseError as exc:
            if str(exc).startswith("FENCED"):
                self.epoch = None
                raise Deposed(self.commander_id) from None
            raise
        return entry.decode() if isinstance(entry, bytes) else str(entry)
