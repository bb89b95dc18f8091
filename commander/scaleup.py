"""How far a scale-up goes (up is fast and event-driven): the up half of ``decide``.

- **What asks.** The signals that see trouble or hold a target ask for workers: waiting turns the
  running slots will not start within ``target_wait_s`` (``pressure``; every waiting turn once
  a queue has stood that long: ``queued_since``), no worker under its
  threshold (``occupancy``), and the per-signal targets (``users``, ``backlog``, ``rps``,
  ``buffer``). The measured load (``load``) asks for nothing on its own: a load a fraction of a
  worker over the thresholds is no trouble until turns wait or workers saturate, and a scale-up
  that followed it would creep up one worker per pass while the measurement catches up with a
  rising load.
- **How far.** Once asked, a step goes to the highest of what asked and the measured load
  (``load``: the fewest workers whose ledger capacity exceeds the summed occupancy, i.e. arrival
  rate x time per turn at the admission threshold): one step covers the load.
- **Doubling within a burst.** Asked again by waiting turns or saturated workers within one
  report interval of the last scale-up (sooner than the evaluator can measure what that step
  absorbed), the load grows faster than it is measured: the step is at least twice the last
  one. A burst of unknown size gets its workers in about log2(size) steps, and the overshoot is
  less than the last step (the doubling search; the HPA's default scale-up policy doubles per
  period too).

The result is clamped, net of starting workers, and limited by ``max_step_up`` and the scale-up
rate rules (``commander.decide``). Pure: no Redis, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from commander.signals import free_slots
from commander.snapshot import TierSnapshot, TierWorkers
from commander.tierstate import TierState
from protocol.policy import ScaleRules

SIZING_ONLY = frozenset({"load"})  # proposals that size a step but never ask for one
TROUBLE = ("pressure", "occupancy")  # the asks that mean the measured load is behind: they double


@dataclass(frozen=True, slots=True)
class Step:
    """The count this pass aims at before the clamp, what asked for it and how it was sized."""

    raw: int  # the count aimed at (the asking proposals', raised by the sizing rules)
    asked: int  # the highest asking proposal
    sized_by: str | None = None  # "load" or "doubling (...)" when a sizing rule raised the step


def asked(proposals: dict[str, int | None]) -> int:
    """The highest proposal of the signals that may ask for workers (0 when none is enabled)."""
    return max((p for name, p in proposals.items() if p is not None and name not in SIZING_ONLY), default=0)


def queued_since(state: TierState, snapshot: TierSnapshot, fleet: TierWorkers, policy: ScaleRules,
                 now: float) -> float | None:
    """Since when turns have waited beyond the free and the starting slots, pass after pass
    (None: not now). A queue that stood for ``target_wait_s`` has made turns wait that long:
    the running slots are not starting them in time, whatever their average says."""
    starting = sum(w.total or policy.concurrency for w in fleet.starting)
    if snapshot.backlog <= free_slots(snapshot, fleet, policy) + starting:
        return None
    since = state.queued_since
    return since if since is not None and since <= now else now


def last_step(state: TierState, now: float) -> tuple[float, int] | None:
    """The last scale-up before ``now`` (a pass repeated at the same ``now`` sees the same one)."""
    before = [s for s in state.steps if s[0] < now]
    return before[-1] if before else None


def burst_step(state: TierState, policy: ScaleRules, now: float) -> int:
    """The last step's size if it was less than one report interval ago, else 0."""
    last = last_step(state, now)
    if last is None or now - last[0] >= policy.scaling.report_interval_s:
        return 0
    return last[1]


def record_step(state: TierState, now: float, spawned: int) -> tuple[tuple[float, int], ...]:
    """The state's ``steps`` after this pass: the last scale-up before ``now``, and this one."""
    if spawned <= 0:
        return state.steps
    last = last_step(state, now)
    return ((last,) if last else ()) + ((now, spawned),)


def troubled(proposals: dict[str, int | None], fleet: TierWorkers) -> bool:
    """Whether waiting turns or saturated workers ask for more (a target signal's count, such as
    ``users``, is exact and never doubles)."""
    return any((proposals.get(name) or 0) > fleet.current for name in TROUBLE)


def step_target(proposals: dict[str, int | None], fleet: TierWorkers, policy: ScaleRules, state: TierState,
                now: float) -> Step:
    """The count to aim at: what asked, and, when that is a scale-up, sized by the load and by
    doubling within a burst."""
    ask = asked(proposals)
    if ask <= fleet.current:
        return Step(ask, ask)
    raw, sized_by = ask, None
    load = proposals.get("load") or 0
    if load > raw:
        raw, sized_by = load, "load"
    burst = burst_step(state, policy, now) if troubled(proposals, fleet) else 0
    if burst and fleet.current + 2 * burst > raw:
        raw, sized_by = fleet.current + 2 * burst, f"doubling (the last step +{burst})"
    return Step(raw, ask, sized_by)
