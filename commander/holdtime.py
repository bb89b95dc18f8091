"""The scale-in hold, derived from what a worker costs: the break-even ("ski rental") rule.

An idle worker's capacity is kept as long as keeping it costs less than starting a worker again,
and no longer. Keeping costs 1 worker-second per second. Starting again costs:

- the **start time** ``s``, a worker paid that serves nothing: the commander measures it per
  tier, from each worker's spawn to its first report as ready (``WorkerView.ready_at -
  started``), and takes the highest of the last ``START_SAMPLES`` (a worker still starting
  for longer already counts: its age is a lower bound);
- the **waiting** the restart causes if the demand comes back: ``lambda * s`` turns arrive per
  worker meanwhile (``lambda``, the tier's measured turns per second per ready worker) and wait
  ``s / 2`` on average; a second of a turn waiting is priced like a second of a worker.

So ``R = s + lambda * s^2 / 2`` worker-seconds, and the hold is ``R`` seconds: keeping a
worker idle for ``R`` and then releasing it never costs more than twice what an oracle that knew
when demand returns would pay (the deterministic ski-rental bound). A forked worker (~0.1 s
to start) is held for almost nothing, a GPU worker that takes 3 minutes to start at 1 turn/s is
held for hours (up to the cap). Two bounds: never shorter than the commander's measurement
window (``AVERAGE_ROWS`` reports of ``report_interval_s``: before it, the occupancy averages
still describe the load that just left) nor than ``scale_in_hold.min_s``, never longer than
``scale_in_hold.max_s``; before any start has been measured, ``scale_in_hold.unmeasured_s``.
A policy that sets ``scale_down_stabilization_s`` gets that fixed hold instead.

Pure: everything comes from the snapshot, the policy and the previous samples.
"""

from __future__ import annotations

from dataclasses import dataclass

from commander.evaluator import AVERAGE_ROWS
from commander.snapshot import TierSnapshot, TierWorkers
from protocol.policy import ScaleRules

START_SAMPLES = 8
Samples = tuple[tuple[str, float], ...]  # (worker, start seconds), oldest first


@dataclass(frozen=True, slots=True)
class Hold:
    """The scale-in hold of a pass and how it was found (for the ledger)."""

    seconds: float
    rule: str  # "fixed", "unmeasured" or "break-even"
    start_s: float | None = None
    restart_cost_s: float | None = None
    turns_per_worker_s: float = 0.0

    def why(self) -> dict[str, float | str | None]:
        """The figures as plain data."""
        return {"hold_s": round(self.seconds, 3), "rule": self.rule,
                "start_s": None if self.start_s is None else round(self.start_s, 3),
                "restart_cost_s": None if self.restart_cost_s is None else round(self.restart_cost_s, 3),
                "turns_per_worker_s": round(self.turns_per_worker_s, 3)}


def start_samples(previous: Samples, fleet: TierWorkers) -> Samples:
    """The last ``START_SAMPLES`` measured start costs, with any ready worker seen the first time."""
    known = {wid for wid, _ in previous}
    new = [(w.id, max(0.0, w.ready_at - w.started)) for w in sorted(fleet.ready, key=lambda v: v.started)
           if w.ready_at is not None and w.started > 0 and w.id not in known]
    return (previous + tuple(new))[-START_SAMPLES:]


def start_cost(samples: Samples, fleet: TierWorkers, now: float) -> float | None:
    """The tier's start cost: the highest recent sample, or longer if a worker starts for longer."""
    starting = [now - w.started for w in fleet.starting if w.started > 0]
    values = [s for _, s in samples] + starting
    return max(values) if values else None


def turns_per_worker(snapshot: TierSnapshot, fleet: TierWorkers) -> float:
    """Turns per second one ready worker serves, measured (0 with no ready worker)."""
    return snapshot.rps / len(fleet.ready) if fleet.ready else 0.0


def restart_cost(start_s: float, rate: float) -> float:
    """Worker-seconds a restart costs: the start itself, and the waits of the turns that come
    while it starts (``rate * start_s`` turns waiting ``start_s / 2`` on average)."""
    return start_s + rate * start_s * start_s / 2.0


def measurement_window(policy: ScaleRules) -> float:
    """How long the evaluator's averages take to forget a load: its rows x the report interval."""
    return AVERAGE_ROWS * policy.scaling.report_interval_s


def hold(policy: ScaleRules, start_s: float | None, rate: float) -> Hold:
    """This pass's scale-in hold (see the module docstring)."""
    if policy.scaling.scale_down_stabilization_s is not None:
        return Hold(policy.scaling.scale_down_stabilization_s, "fixed", start_s, None, rate)
    bounds = policy.scaling.scale_in_hold
    if start_s is None:
        return Hold(bounds.unmeasured_s, "unmeasured", None, None, rate)
    cost = restart_cost(start_s, rate)
    floor = max(bounds.min_s, measurement_window(policy))
    return Hold(min(bounds.max_s, max(floor, cost)), "break-even", start_s, cost, rate)
