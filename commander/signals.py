"""One worker-count proposal per signal (DESIGN §5); ``decide`` takes the max of the enabled ones.

Each function maps one measured quantity to "how many workers it asks for"; ``None`` means the
signal is disabled by the policy. No function here decides anything on its own.
"""

from __future__ import annotations

import math

from commander.capacity import any_admits, ledger_floor, ledger_load
from commander.snapshot import Fleet, TierSnapshot
from protocol.policy import Policy

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


def buffer_proposal(fleet: Fleet, policy: Policy) -> int:
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
    return ceil_ratio(busy, 1.0) + policy.target_buffer


def occupancy_proposal(fleet: Fleet, policy: Policy) -> int:
    """Up by one when no ready worker admits; else the ledger's floor (never above current).

    Holds while workers are starting (they are the answer already) or when nothing is
    measured, and asks for 0 when every worker is measured and idle.
    """
    ready = len(fleet.ready)
    if fleet.starting or not fleet.fresh:
        return fleet.current
    if all(w.idle for w in fleet.ready):
        return 0
    if not any_admits(fleet, policy):
        return ready + 1
    return ledger_floor(ready, ledger_load(fleet.ready, fleet.reception, policy), policy)


def pressure_proposal(events: int, fleet: Fleet, policy: Policy) -> int:
    """Turns that found no free slot ask for the slots they missed on top of the ready workers.

    Starting workers are not added: they are netted out when the spawn count is computed.
    """
    if events <= 0:
        return 0
    return len(fleet.ready) + ceil_ratio(events, policy.concurrency)


def proposals(snapshot: TierSnapshot, fleet: Fleet, policy: Policy) -> dict[str, int | None]:
    """Every signal's proposal, by name; None for a signal the policy disables."""
    return {
        "users": users_proposal(snapshot.active_users, policy.users_per_instance),
        "backlog": backlog_proposal(snapshot.backlog, policy.target_backlog_per_worker),
        "rps": rps_proposal(snapshot.rps, policy.target_rps_per_worker),
        "buffer": buffer_proposal(fleet, policy),
        "occupancy": occupancy_proposal(fleet, policy),
        "pressure": pressure_proposal(snapshot.pressure_events, fleet, policy),
    }
