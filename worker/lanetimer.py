"""A lane's deadline on the worker that holds it (a mixin of ``worker.job.UserJob``).

A lease lasts one lane TTL from the request that took or renewed it. Unless renewed by then,
the turn in progress is stopped by a timer of the lane's own, not by the renew loop, which a
Redis outage or a paused process can make late (explorer seeds 20217, 28924).
"""

from __future__ import annotations

import asyncio
import logging
import time

from stores.turns import Lease

log = logging.getLogger("fleet.worker")


class LaneTimer:
    """The lane's timer and what stops the turn in progress; ``UserJob`` provides the state."""

    user: str
    lease: Lease | None
    renewed: float
    committing: bool
    task: asyncio.Task[None] | None
    _lost: bool
    _expiry: asyncio.TimerHandle | None

    def lane_ttl_s(self) -> float:
        """The lane TTL of the job's worker, in seconds (``UserJob`` says)."""
        raise NotImplementedError

    def renewed_at(self, lease: Lease, sent: float) -> None:
        """``lease`` was taken or renewed by a request sent at ``sent`` (monotonic): it lasts one
        lane TTL from then at least. Unless renewed again by then, the turn in progress is stopped
        at that deadline, by a timer of its own: not by the renew loop, which Redis away, a pass
        stuck in the client's retries or a paused process make late (explorer seeds 20217, 28924)."""
        if self.lease is not lease or sent <= self.renewed:
            return  # (a renewal pass left behind may end after a newer one)
        self.renewed = sent
        if self._expiry is not None:
            self._expiry.cancel()
        left = sent + self.lane_ttl_s() - time.monotonic()
        self._expiry = asyncio.get_running_loop().call_later(max(0.0, left), self._expired, lease)

    def _expired(self, lease: Lease) -> None:
        self._expiry = None
        if self.lease is lease:
            log.warning("lane of %s not renewed within its TTL: stopping the turn in progress", self.user)
            self.lane_lost()

    def renew_failed(self) -> None:
        """A renewal found the lane gone. While a commit is in flight that is its own doing
        (the commit releases the lane when nothing waits, and its reply may wait on for a WAIT
        after it): the commit's answer decides. Released: nothing was lost. Kept: the next
        renewal pass judges the lane again, the commit was fenced if it had been lost before,
        and the lane's own TTL timer (``renewed_at``) still bounds the turn after it."""
        if self.committing:
            return
        log.warning("lane of %s expired under us: stopping the turn in progress", self.user)
        self.lane_lost()

    def lane_lost(self) -> None:
        """A renewal found the lane gone, or its deadline passed unrenewed: stop the turn in
        progress, whose write would be fenced anyway, so no handler runs on beside the new owner's."""
        if self.task is not None and not self.task.done() and not self._lost:
            self._lost = True
            self.task.cancel()
