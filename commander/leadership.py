"""Single writer: the leader lease (``SET NX PX``, renewed) with a fencing epoch.

Only the leader acts, and it appends every change to the ledger *before* acting through a
script that refuses a deposed leader (``ledger_append.lua``): a commander that was paused
past its lease and wakes up finds its append fenced, so it never acts on a stale view. A
scale-up is fenced by ``confirm`` (a lease renewal) instead, and ledgered right after the
runtime returned the new workers' ids.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from protocol.models import LedgerEvent
from stores.leader_lease import LeaderLease
from stores.ledger import Ledger, NotLeading
from stores.retry import TRANSIENT

log = logging.getLogger("fleet.commander")


class Deposed(Exception):
    """This commander no longer leads: stop acting."""


class Leadership:
    """One commander's claim on leadership, on a blocking client."""

    def __init__(self, r: redis.Redis, commander_id: str, ttl_ms: int = 3000,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.commander_id = commander_id
        self._ttl_ms = ttl_ms
        self._monotonic = monotonic
        self._held_at = 0.0  # monotonic time of the last acquire or renewal of the lease
        self.epoch: int | None = None
        self._lease = LeaderLease(r)
        self._ledger = Ledger(r)

    @property
    def leading(self) -> bool:
        """Whether this commander holds the lease (as of its last campaign, renewal or append)."""
        return self.epoch is not None

    @property
    def holder(self) -> str:
        """The lease's value while this commander holds it: ``<commander>|<epoch>``."""
        return f"{self.commander_id}|{self.epoch}"

    def campaign(self) -> bool:
        """Take the lease if it is free (or already ours); True when leading."""
        sent = self._monotonic()
        epoch = self._lease.acquire(self.commander_id, self._ttl_ms)
        if epoch is not None:
            self._held_at = sent
            if self.epoch != epoch:
                log.info("commander %s leads with epoch %d", self.commander_id, epoch)
            self.epoch = epoch
            return True
        self.epoch = None
        return False

    def renew(self) -> bool:
        """Extend the lease; on loss, become a standby (``leading`` turns False). A renewal
        Redis refuses (an error, or no answer) is raised; once the lease's TTL has passed since
        it was last held, this commander is a standby first: the lease has expired."""
        if self.epoch is None:
            return False
        sent = self._monotonic()
        try:
            renewed = self._lease.renew(self.holder, self._ttl_ms)
        except TRANSIENT:
            if sent - self._held_at >= self._ttl_ms / 1000:
                log.warning("commander %s could not renew the lease of epoch %d within its TTL: a standby",
                            self.commander_id, self.epoch)
                self.epoch = None
            raise
        if renewed:
            self._held_at = sent
            return True
        log.warning("commander %s lost the lease of epoch %d", self.commander_id, self.epoch)
        self.epoch = None
        return False

    def confirm(self) -> None:
        """Renew the lease now, or raise ``Deposed``: the fence before an act whose ledger entry
        can only be written after it (a scale-up names the workers the runtime returned)."""
        if not self.renew():
            raise Deposed(self.commander_id)

    def step_down(self) -> None:
        """Give up the lease now (a clean shutdown), so a standby takes over at once."""
        if self.epoch is not None:
            self._lease.drop(self.holder)
            self.epoch = None

    def append(self, event: LedgerEvent) -> str:
        """Append to the ledger, fenced: raises ``Deposed`` if another commander leads."""
        try:
            return self._ledger.append(self.holder, event)
        except NotLeading:
            self.epoch = None
            raise Deposed(self.commander_id) from None
