"""What the runtime says, for the ledger: its refusals, its notes, and the workers that wait too
long for a place to run.

- Before acting on a plan, the commander asks ``runtime.refusal(tier)``. A refusal (kubernetes:
  an HPA or ScaledObject targets the tier's Deployment, or it has no single one) drops the
  plan's spawns and retirements; a new reason is ledgered once as ``refused``, not every pass.
- A worker whose ``pending_since`` is older than the policy's ``pending_timeout_s`` (a Pending
  pod) is ledgered once as ``no-capacity``: capacity is the cluster's business (its
  autoscaler's), so nothing is retried; the worker keeps counting as starting, so the commander
  does not pile more pods on a cluster that has no room for them.
- ``runtime.notes()`` (kubernetes: a Pending pod deleted instead of the victim; process: a
  process that does not prove it is ours, also counted in ``fleet_unproven_processes``) go to
  the ledger as they come.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

from commander.decide import Plan
from commander.ledger_writer import LedgerWriter
from commander.metrics import Metrics
from commander.runtime import Lifecycle, Runtime, WorkerHandle
from protocol.policy import Policy

log = logging.getLogger("fleet.commander")


def overdue(handles: Iterable[WorkerHandle], tier: str, limit_s: float, now: float) -> list[WorkerHandle]:
    """The tier's workers that have waited for a place to run longer than ``limit_s``."""
    return [h for h in handles
            if h.tier == tier and h.state is not Lifecycle.EXITED and h.pending_since is not None
            and now - h.pending_since > limit_s]


def no_capacity_reason(late: list[WorkerHandle], limit_s: float, now: float) -> str:
    """One line for the ledger: who waits, how long, and why (as the scheduler says)."""
    each = "; ".join(f"{h.worker_id} for {now - (h.pending_since or now):.0f}s"
                     + (f" ({h.pending_why})" if h.pending_why else "") for h in late[:5])
    more = f" and {len(late) - 5} more" if len(late) > 5 else ""
    return (f"{len(late)} worker{'s' if len(late) != 1 else ''} waiting for a place to run past "
            f"pending_timeout_s={limit_s:g}: {each}{more}; the cluster's capacity (its autoscaler) "
            f"decides, nothing is retried, they still count as starting")


class RuntimeWatch:
    """Refusals, notes and Pending workers of one runtime, in the ledger."""

    def __init__(self, runtime: Runtime, ledger: LedgerWriter, metrics: Metrics | None = None) -> None:
        self._runtime, self._ledger, self._metrics = runtime, ledger, metrics
        self._refusals: dict[str, str] = {}  # tier -> the refusal last ledgered
        self._no_capacity: dict[str, set[str]] = {}  # tier -> workers ledgered as waiting, while they wait

    def allowed(self, plan: Plan) -> Plan:
        """The plan, without its spawns and retirements while the runtime refuses to act on its
        tier (asked only when the plan would act); a new reason goes to the ledger once."""
        if not plan.changed:
            return plan
        why = self._runtime.refusal(plan.tier)
        last = self._refusals.get(plan.tier)
        if why is None:
            if last is not None:
                log.info("tier %s: the %s runtime acts again", plan.tier, self._runtime.name)
                del self._refusals[plan.tier]
            return plan
        if why != last:
            reason = f"{plan.reason}: not done, the {self._runtime.name} runtime refuses: {why}"
            self._ledger.record(plan.tier, "refused", plan, to=plan.current, reason=reason,
                                victims=[r.worker for r in plan.retire], why={**plan.why(), "refused": why})
            log.warning("tier %s: %s", plan.tier, reason)
            self._refusals[plan.tier] = why
        return replace(plan, spawn=0, retire=())

    def note_pending(self, tier: str, handles: list[WorkerHandle], policy: Policy, plan: Plan,
                     now: float) -> None:
        """Ledger the workers that newly waited past ``pending_timeout_s``, once each."""
        late = overdue(handles, tier, policy.controls.pending_timeout_s, now)
        noted = self._no_capacity.get(tier, set())
        new = [h for h in late if h.worker_id not in noted]
        self._no_capacity[tier] = {h.worker_id for h in late}
        if not new:
            return
        reason = no_capacity_reason(new, policy.controls.pending_timeout_s, now)
        self._ledger.record(tier, "no-capacity", plan, to=plan.current, victims=[h.worker_id for h in new],
                            reason=reason, why={"pending": {h.worker_id: h.pending_why for h in new}})
        log.warning("tier %s: %s", tier, reason)

    def record_notes(self) -> None:
        """What the runtime did beyond the plan (a substituted victim), to the ledger."""
        for note in self._runtime.notes():
            self._ledger.record(note.tier, note.action, victims=list(note.workers), reason=note.reason)
            if note.action == "unproven-process" and self._metrics is not None:
                self._metrics.unproven_process()
