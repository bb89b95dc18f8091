"""The leader's recovery after a Redis Cluster failover: see ``stores.renotify`` for what a
failover can lose (a queued turn's notification) and what the sweep does about it.

The cluster epoch last recovered from is kept in Redis (``fleet:recovered``), so a new leader
does not sweep again for a failover its predecessor already answered.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from commander.ledger_writer import LedgerWriter
from stores.redis_errors import RedisErrors
from stores.renotify import (
    Renotified,
    cluster_epoch,
    read_recovered,
    renotify_unserved,
    write_recovered,
)
from stores.retry import TRANSIENT

log = logging.getLogger("fleet.commander")


@dataclass(frozen=True)
class Recovered:
    """One recovery: the cluster epoch it answers, the one before, and each tier's sweep."""

    before: int
    now: int
    tiers: tuple[Renotified, ...]


class FailoverRecovery:
    """Re-notifies the users whose queued turns may have lost their notification, once per
    growth of the cluster epoch."""

    def __init__(self, r: redis.Redis, ledger: LedgerWriter, errors: RedisErrors | None = None) -> None:
        self._r, self._ledger = r, ledger
        self._errors = errors or RedisErrors(log)  # the commander's, which counts them
        self.last: int | None = None  # the cluster epoch last recovered from
        self._loaded = False  # read the stored epoch at the first pass of a leadership

    def forget(self) -> None:
        """A new leadership: the stored epoch may be newer than ours (another commander's)."""
        self._loaded = False

    def recover(self, shards: Mapping[str, int]) -> None:
        """Each pass: sweep ``shards``' tiers (tier -> its ready shards) if the cluster failed
        over since the last recovery, and ledger who was re-notified; a failure is logged and
        retried next pass."""
        try:
            done = self.run(shards, cluster_epoch(self._r))
        except TRANSIENT as exc:  # Redis still failing over, or erring: the next pass retries
            self._errors.failed("failover recovery", exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bad entry, say: the next pass retries
            log.warning("recovery after a failover failed (%s: %s); retried next pass",
                        type(exc).__name__, exc)
            return
        self._errors.answered("failover recovery")
        if done is None:
            return
        for tier in done.tiers:
            if not tier.users:
                continue
            reason = (f"cluster epoch {done.before} -> {done.now} (a failover may have lost "
                      f"notifications): re-notified {len(tier.users)} of {tier.checked} active "
                      f"users with turns queued")
            log.warning("tier %s: %s", tier.tier, reason)
            self._ledger.record(tier.tier, "renotified", reason=reason,
                                why={"renotified": {"users": list(tier.users[:20]), "count": len(tier.users),
                                                    "checked": tier.checked}})

    def run(self, shards: Mapping[str, int], epoch: int | None) -> Recovered | None:
        """Sweep if the cluster epoch ``epoch`` (``stores.renotify.cluster_epoch``) grew since
        the last recovery; None if it did not, on one node (``epoch`` None), or if no epoch was
        recorded yet (it is recorded then: there is no "since" to recover from). Errors are
        raised and nothing is recorded, so the next pass tries again."""
        if epoch is None:
            return None
        if not self._loaded:
            self.last, self._loaded = read_recovered(self._r), True
        if self.last is None or epoch <= self.last:
            if self.last is None:
                write_recovered(self._r, epoch)
                self.last = epoch
            return None
        done = tuple(renotify_unserved(self._r, tier, n) for tier, n in sorted(shards.items()))
        write_recovered(self._r, epoch)
        before, self.last = self.last, epoch
        return Recovered(before, epoch, done)
