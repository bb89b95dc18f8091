"""One worker-count proposal per signal; ``decide`` takes the max of the enabled ones.

Each function maps one measured quantity to "how many workers it asks for"; ``None`` means the
signal is disabled by the policy. No function here decides anything on its own. ``load`` is the
one that only sizes: it sets how far a scale-up goes and how low a scale-in may go, but asks
for no worker by itself (``commander.scaleup``).
"""

from __future__ import annotations

import math

from commander.capacity import any_admits, ledger_floor, ledger_load
from commander.snapshot import TierSnapshot, TierWorkers
from protocol.policy import ScaleRules

_EPS = 1e-9  # so that 3.0000000001 workers' worth of float noise asks for 3, not 4


def ceil_ratio(amount: float, per: float) -> int:
    """``ceil(amount / per)``, robust to float noise; 0 for no amount."""
    if amount <= 0:
        return 0
    return max(1, math.ceil(amount / per - _EPS))


def users_proposal(active_users: int, users_per_instance: float | None) -> int | None:
    """``ceil(active_users / users_per_instance)``."""
    return None if users_per_instance is None else ceil_ratio(active_users, users_per_instance)


def backlog_proposal(backlog: int, per_worker: float | None) -> int | None:
    """``ceil(backlog / target_backlog_per_worker)``."""
    return None if per_worker is None else ceil_ratio(backlog, per_worker)


def rps_proposal(rps: float, per_worker: float | None) -> int | None:
    """``ceil(rps / target_rps_per_worker)``."""
    return None if per_worker is None else ceil_ratio(rps, per_worker)


def buffer_proposal(fleet: TierWorkers, policy: ScaleRules) -> int:
    """Busy workers plus ``target_buffer`` warm ones.

    "Busy workers" is counted in whole workers' worth of busy slots (Σ busy/total), so that
    many lightly loaded workers can still be consolidated; an unreported worker counts as
    one fully busy worker.
    """
    busy = 0.0
    for w in fleet.ready:
        if not w.fresh:
            busy += 1.0
        elif w.busy > 0:
            busy += w.busy / (w.total or policy.concurrency)
    return ceil_ratio(busy, 1.0) + policy.scaling.target_buffer


def occupancy_proposal(fleet: TierWorkers, policy: ScaleRules) -> int:
    """Up by one when no ready worker admits; else the ledger's floor (never above current).

    Holds while workers are starting (they are the answer already) or when nothing is
    measured, and asks for 0 when every worker is measured and idle. On a queue-driven tier (rq:
    one job per worker) a full worker is no trouble until a job waits, which the backlog and
    pressure signals see: it holds instead of asking for one more.
    """
    ready = len(fleet.ready)
    if fleet.starting or not fleet.fresh:
        return fleet.current
    if all(w.idle for w in fleet.ready):
        return 0
    if not any_admits(fleet, policy):
        return ready if policy.queue_driven else ready + 1
    return ledger_floor(ready, ledger_load(fleet.ready, fleet.reception, policy), policy)


def load_proposal(fleet: TierWorkers, policy: ScaleRules) -> int:
    """The fewest workers whose ledger capacity exceeds the measured load: ``C(n) > O``.

    ``O`` is the ledger's load: the summed occupancy, in workers' worth (handler seconds per
    second over the evaluator's window, i.e. arrival rate x time per turn while turns do not
    wait; an unreported worker counts as full); ``C(n) = reception_threshold + (n - 1) x
    admission_threshold``, so at this count some worker still admits. It sizes a scale-up and
    keeps the scale-in target (``commander.scaleup``); on its own it asks for no worker. A tier
    whose workers are all idle has no load (their own cpu is not a turn's).
    """
    load = ledger_load(fleet.ready, fleet.reception, policy)
    if load <= 0 or all(w.idle for w in fleet.ready):
        return 0
    occupancy = policy.scaling.occupancy
    if load < occupancy.reception_threshold - _EPS:
        return 1
    return math.floor((load - occupancy.reception_threshold) / occupancy.admission_threshold + _EPS) + 2


def service_s(snapshot: TierSnapshot) -> float | None:
    """The handler time of one turn, measured: handler seconds over turns (None before any)."""
    if snapshot.rps <= 0 or snapshot.handler_rate <= 0:
        return None
    return snapshot.handler_rate / snapshot.rps


def free_slots(snapshot: TierSnapshot, fleet: TierWorkers, policy: ScaleRules) -> int:
    """Slots the ready workers reported free: none when a turn just found none (pressure)."""
    if snapshot.pressure_events > 0:
        return 0
    return sum(max(0, (w.total or policy.concurrency) - w.busy) for w in fleet.ready if w.fresh)


def pressure_proposal(snapshot: TierSnapshot, fleet: TierWorkers, policy: ScaleRules,
                      queued_for: float = 0.0) -> int:
    """Waiting turns the running slots will not start within ``target_wait_s`` ask for slots.

    Waiting turns take the free slots first. A busy slot frees every ``service_s`` on average,
    so ``slots`` of them start ``target_wait_s x slots / service_s`` more waiting turns within
    the target; only the rest of the backlog asks for workers, on top of the ready ones
    (starting workers are netted out when the spawn count is computed). Before any turn is
    measured, or once a queue has stood ``queued_for >= target_wait_s`` (its turns have waited
    that long already), every waiting turn asks for a slot of its own. While turns wait the
    proposal is at least the ready workers: none is retired from under a backlog.
    """
    if snapshot.backlog <= 0:
        return 0
    waiting = float(snapshot.backlog - free_slots(snapshot, fleet, policy))
    slots = sum(w.total or policy.concurrency for w in fleet.ready)
    per_turn = service_s(snapshot)
    if per_turn is not None and slots > 0 and queued_for < policy.scaling.target_wait_s:
        waiting -= policy.scaling.target_wait_s * slots / per_turn
    return len(fleet.ready) + ceil_ratio(waiting, policy.concurrency)


def proposals(snapshot: TierSnapshot, fleet: TierWorkers, policy: ScaleRules,
              queued_for: float = 0.0) -> dict[str, int | None]:
    """Every signal's proposal, by name; None for a signal the policy disables."""
    return {
        "users": users_proposal(snapshot.active_users, policy.scaling.users_per_instance),
        "backlog": backlog_proposal(snapshot.backlog, policy.scaling.target_backlog_per_worker),
        "rps": rps_proposal(snapshot.rps, policy.scaling.target_rps_per_worker),
        "buffer": buffer_proposal(fleet, policy),
        "occupancy": occupancy_proposal(fleet, policy),
        "pressure": pressure_proposal(snapshot, fleet, policy, queued_for),
        "load": load_proposal(fleet, policy),
    }
