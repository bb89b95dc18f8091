"""The commander's recovery after a Redis Cluster failover: see ``stores.recovery`` for what a
failover can lose and what the sweep does about it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis

from protocol.models import LedgerEvent
from stores.renotify import (
    Renotified,
    cluster_epoch,
    read_recovered,
    renotify_unserved,
    write_recovered,
)

log = logging.getLogger("fleet.commander")


@dataclass(frozen=True)
class Recovered:
    """One recovery: the cluster epoch it answers, the one before, and each tier's sweep."""

    before: int
    now: int
    tiers: tuple[Renotified, ...]


class Recovery:
    """Remembers the cluster epoch last recovered from; re-notifies when it grows."""

    def __init__(self) -> None:
        self.last: int | None = None
        self._loaded = False  # read the stored epoch at the first pass of a leadership

    def forget(self) -> None:
        """A new leadership: the stored epoch may be newer than ours (another commander's)."""
        self._loaded = False

    def run(self, r: redis.Redis, shards: Mapping[str, int], now: int | None) -> Recovered | None:
        """Sweep ``shards``' tiers (tier -> its ready shards) if the cluster epoch ``now``
        (``stores.recovery.cluster_epoch``) grew since the last recovery; None if it did not,
        on one node (``now`` None), or if no epoch was recorded yet (it is recorded then: there
        is no "since" to recover from). Errors are raised and nothing is recorded, so the next
        pass tries again."""
        if now is None:
            return None
        if not self._loaded:
            self.last, self._loaded = read_recovered(r), True
        if self.last is None or now <= self.last:
            if self.last is None:
                write_recovered(r, now)
                self.last = now
            return None
        done = tuple(renotify_unserved(r, tier, n) for tier, n in sorted(shards.items()))
        write_recovered(r, now)
        before, self.last = self.last, now
        return Recovered(before, now, done)


class Recovering:
    """The leader's recovery pass, for ``Commander``, which provides the state below."""

    r: redis.Redis
    recovery: Recovery
    _append: Callable[[LedgerEvent], None]
    _event: Callable[..., LedgerEvent]

    def _recover(self, shards: dict[str, int]) -> None:
        """After a Cluster failover, re-notify the users whose queued turns may have lost their
        notification (``stores.recovery``); a failure is retried next pass."""
        try:
            done = self.recovery.run(self.r, shards, cluster_epoch(self.r))
        except Exception as exc:  # noqa: BLE001 - Redis still failing over: the next pass retries
            log.warning("recovery after a failover failed (%s: %s); retried next pass",
                        type(exc).__name__, exc)
            return
        if done is None:
            return
        for tier in done.tiers:
            if not tier.users:
                continue
            reason = (f"cluster epoch {done.before} -> {done.now} (a failover may have lost "
                      f"notifications): re-notified {len(tier.users)} of {tier.checked} active "
                      f"users with turns queued")
            log.warning("tier %s: %s", tier.tier, reason)
            self._append(self._event(tier.tier, "renotified", reason=reason,
                                     why={"renotified": {"users": list(tier.users[:20]),
                                                         "count": len(tier.users),
                                                         "checked": tier.checked}}))
