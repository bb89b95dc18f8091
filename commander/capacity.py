"""Occupancy arithmetic for ``decide``: admission, the capacity ledger, and "does it fit?".

The ledger: ``C = reception_threshold + (N-1) * admission_threshold``,
``O = Σ occupancy``, ``H = C - O``; compaction is allowed only while
``H > compaction_margin * admission_threshold``. Scale-up fires when no worker admits, i.e.
when every worker is at its threshold, which means ``H <= 0``; right after a compaction
``H > (margin - 1) * admission_threshold >= 0``. The two can therefore never chase each other.

A worker without a fresh report counts as exactly full (its threshold): it adds no headroom,
and it never admits.
"""

from __future__ import annotations

from collections.abc import Iterable

from commander.snapshot import TierWorkers, WorkerView
from protocol.policy import ScaleRules

_EPS = 1e-9


def threshold(worker: WorkerView, reception: str | None, peers: int, policy: ScaleRules) -> float:
    """Where a worker stops taking new work: the reception stops early while it has peers."""
    if worker.id == reception and peers > 1:
        return policy.scaling.occupancy.reception_threshold
    return policy.scaling.occupancy.admission_threshold


def admits(worker: WorkerView, fleet: TierWorkers, policy: ScaleRules) -> bool:
    """Whether a ready worker can take more work now (unknown load never admits)."""
    limit = threshold(worker, fleet.reception, len(fleet.ready), policy)
    return worker.fresh and worker.occupancy < limit


def any_admits(fleet: TierWorkers, policy: ScaleRules) -> bool:
    """Whether some ready worker of the tier can take more work."""
    return any(admits(w, fleet, policy) for w in fleet.ready)


def ledger_load(workers: Iterable[WorkerView], reception: str | None, policy: ScaleRules) -> float:
    """O: the summed occupancy, with an unreported worker counted as full."""
    workers = tuple(workers)
    total = 0.0
    for w in workers:
        total += w.occupancy if w.fresh else threshold(w, reception, len(workers), policy)
    return total


def capacity(n: int, policy: ScaleRules) -> float:
    """C for ``n`` workers: the reception's threshold plus the others' admission thresholds."""
    if n <= 0:
        return 0.0
    occupancy = policy.scaling.occupancy
    return occupancy.reception_threshold + (n - 1) * occupancy.admission_threshold


def may_compact(n: int, load: float, policy: ScaleRules) -> bool:
    """Whether ``n`` workers carrying ``load`` have headroom to lose one (H > margin * a).

    "Greater" means by more than float noise: a sum of occupancies one ulp short of the
    boundary must not compact a fleet that a scale-up just sized exactly at it.
    """
    headroom = capacity(n, policy) - load
    occupancy = policy.scaling.occupancy
    return n > 1 and headroom > occupancy.compaction_margin * occupancy.admission_threshold + _EPS


def ledger_floor(n: int, load: float, policy: ScaleRules) -> int:
    """The fewest workers that compaction, one at a time from ``n``, would leave."""
    while may_compact(n, load, policy):
        n -= 1
    return n


def free_capacity(survivors: tuple[WorkerView, ...], reception: str | None,
                  policy: ScaleRules) -> float:
    """Room left under each survivor's threshold; an unreported survivor has none."""
    room = 0.0
    for w in survivors:
        if w.fresh:
            limit = threshold(w, reception, len(survivors), policy)
            room += max(0.0, limit - w.occupancy)
    return room


def fits(victim: WorkerView, survivors: tuple[WorkerView, ...], reception: str | None,
         policy: ScaleRules) -> bool:
    """Whether the victim's load fits on the survivors under their thresholds."""
    return victim.occupancy <= free_capacity(survivors, reception, policy)
