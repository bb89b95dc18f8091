"""The commander's part for rq tiers: their ``decide`` inputs read from RQ, the refusal of every
rq tier when there is no RQ Redis (a Cluster without ``rq_url``), and the jobs of a dead RQ
worker handed back to RQ at once."""

from __future__ import annotations

import logging

from commander.ledger_writer import LedgerWriter
from commander.rq.inputs import decide_policy, rq_snapshot, rq_views
from commander.rq.reader import NO_RQ_ON_CLUSTER, RqReader
from commander.runtime import WorkerHandle
from commander.snapshot import TierSnapshot, WorkerView
from protocol.policy import RqPolicy, ScaleRules

log = logging.getLogger("fleet.commander")


class RqTiers:
    """The rq tiers of one commander, on its ``reader``."""

    def __init__(self, reader: RqReader, ledger: LedgerWriter) -> None:
        self.reader, self._ledger = reader, ledger
        self._refused: set[str] = set()  # rq tiers refused for want of an RQ Redis, ledgered once each

    def refused(self, tier: str) -> str | None:
        """Why the rq tier cannot be run here (no RQ Redis), or None; said once in the ledger
        and the log, not every pass."""
        if self.reader.available:
            self._refused.discard(tier)
            return None
        if tier not in self._refused:
            self._refused.add(tier)
            reason = f"tier {tier} is of kind rq, not run: {NO_RQ_ON_CLUSTER}"
            self._ledger.record(tier, "refused", reason=reason, why={"refused": NO_RQ_ON_CLUSTER})
            log.error("%s", reason)
        return NO_RQ_ON_CLUSTER

    def inputs(self, tier: str, policy: RqPolicy, handles: list[WorkerHandle],
               now: float) -> tuple[tuple[WorkerView, ...], TierSnapshot, ScaleRules]:
        """The views, snapshot and decide policy of an rq tier (its workers are RQ's)."""
        read, rate = self.reader.read(tier, policy, now)
        views = rq_views(tier, handles, read.workers)
        return views, rq_snapshot(tier, views, read, rate), decide_policy(policy)

    def reap(self, handle: WorkerHandle, policy: RqPolicy) -> None:
        """An RQ worker that died (not a warm shutdown): its job goes back to RQ now, retried if
        it has retries left, else failed; RQ itself would do it only once the job's heartbeat
        expires (a minute or more). A failure leaves it to RQ, and says so."""
        try:
            n = self.reader.reap(handle.worker_id, policy, handle.tier)
        except Exception as exc:  # noqa: BLE001 - RQ's own cleanup still hands the job back later
            log.warning("tier %s: the jobs of dead RQ worker %s could not be handed back (%s: %s); "
                        "RQ does it once their heartbeat expires", handle.tier, handle.worker_id,
                        type(exc).__name__, exc)
            return
        if n == 0 and handle.retire_reason is not None and not handle.killed and handle.exit_code is None:
            # retired, and not our child (adopted): its exit status is unknown, but it left no
            # job behind, which is what a warm shutdown does
            log.info("tier %s: RQ worker %s (adopted) exited after its retirement, no job in hand",
                     handle.tier, handle.worker_id)
            return
        how = "was killed" if handle.killed else f"exited (code {handle.exit_code})"
        reason = f"RQ worker {handle.worker_id} {how}; {n} job(s) in hand handed back to RQ"
        log.warning("tier %s: %s", handle.tier, reason)
        self._ledger.record(handle.tier, "worker-exited", reason=reason, victims=[handle.worker_id],
                            why={"rq_reaped": n})
