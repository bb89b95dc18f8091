"""The judge (DESIGN §5): ``decide(snapshot, policy, state, now) -> (Plan, TierState)``.

Pure: no Redis, no clock, no randomness. ``now`` comes in as an argument, the previous
``TierState`` comes in and the next one goes out. The steps, in order:

1. every enabled signal proposes a worker count (``commander.signals``); desired = their max;
2. clamp to ``[min_workers, max_workers]``; backlog or pressure on an empty tier asks for 1;
3. up is fast: spawn ``desired - (running + starting)``, at most ``max_step_up``;
4. down is slow: the scale-in target is the highest desired over the last
   ``scale_down_stabilization_s``; no scale-in inside a no-scale-in window or while most
   reports are missing; idle workers go first, else one consolidation if the ledger has
   headroom and the victim's load fits on the survivors; the reception is never compacted.

Same snapshot + the returned state gives the same plan and the same state again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from commander.capacity import capacity, fits, ledger_load, may_compact
from commander.signals import proposals as signal_proposals
from commander.snapshot import Fleet, TierSnapshot, WorkerView, classify
from protocol.policy import Policy

__all__ = [
    "Plan",
    "Retirement",
    "TierSnapshot",
    "TierState",
    "WorkerView",
    "decide",
    "utc_weekday_minute",
]

RetireAction = Literal["reclaim-idle", "consolidate"]
_DAY_S = 86_400
_EPOCH_WEEKDAY = 3  # 1970-01-01 was a Thursday (Monday = 0)


@dataclass(frozen=True, slots=True)
class TierState:
    """What ``decide`` remembers between passes for one tier.

    ``history`` holds ``(ts, desired)`` pairs inside the stabilization window, kept as a
    monotone queue (values strictly decrease with time): an older, lower entry can never be
    the window's max again, so it is dropped and the state stays small.
    """

    history: tuple[tuple[float, int], ...] = ()
    last_scale_up: float | None = None
    last_scale_down: float | None = None


@dataclass(frozen=True, slots=True)
class Retirement:
    """One worker to drain, and why it was chosen."""

    worker: str
    action: RetireAction


@dataclass(frozen=True)
class Plan:
    """What to do for one tier this pass, with every reason the ledger records."""

    tier: str
    current: int  # ready + starting workers (draining ones are not capacity)
    desired: int  # max of the proposals, clamped
    target: int  # the scale-in target after stabilization (>= desired)
    spawn: int = 0
    retire: tuple[Retirement, ...] = ()
    proposals: dict[str, int | None] = field(default_factory=dict)
    raw: int = 0  # max of the proposals before the clamp
    clamp: str | None = None  # "min_workers", "max_workers", "wake" or None
    held: str | None = None  # why a wanted scale-in did not (fully) happen
    reason: str = ""

    @property
    def changed(self) -> bool:
        """Whether the plan asks the runtime to do anything."""
        return self.spawn > 0 or bool(self.retire)

    def why(self) -> dict[str, Any]:
        """The reasons as plain data, for the ``fleet:events`` ledger."""
        return {
            "proposals": dict(self.proposals),
            "raw": self.raw,
            "clamp": self.clamp,
            "desired": self.desired,
            "stabilized": self.target,
            "held": self.held,
            "reason": self.reason,
        }


def utc_weekday_minute(now: float) -> tuple[int, int]:
    """(weekday 0=Monday, minute of day) of a unix time, in UTC."""
    seconds = int(now // 1)
    days, second_of_day = divmod(seconds, _DAY_S)
    return (days + _EPOCH_WEEKDAY) % 7, second_of_day // 60


def in_no_scale_in_window(policy: Policy, now: float) -> bool:
    """Whether ``now`` falls inside one of the policy's no-scale-in windows."""
    if not policy.no_scale_in_windows:
        return False
    weekday, minute = utc_weekday_minute(now)
    return any(w.contains(weekday, minute) for w in policy.no_scale_in_windows)


def max_proposal(proposals: dict[str, int | None]) -> int:
    """The highest enabled proposal (0 when every signal is disabled)."""
    return max((p for p in proposals.values() if p is not None), default=0)


def clamp_desired(raw: int, snapshot: TierSnapshot, policy: Policy) -> tuple[int, str | None]:
    """Clamp to ``[min_workers, max_workers]``; parked work on an empty tier asks for 1."""
    floor, why = policy.min_workers, "min_workers"
    if (snapshot.backlog > 0 or snapshot.pressure_events > 0) and floor < 1:
        floor, why = 1, "wake"
    if raw < floor:
        return floor, why
    if raw > policy.max_workers:
        return policy.max_workers, "max_workers"
    return raw, None


def record_desired(history: tuple[tuple[float, int], ...], now: float, desired: int,
                   window_s: float) -> tuple[tuple[float, int], ...]:
    """Add ``(now, desired)`` to the monotone window and drop what can no longer matter.

    Entries later than ``now`` (a clock that went back) are forgotten.
    """
    cutoff = now - window_s
    kept = [(ts, d) for ts, d in history if cutoff < ts <= now]
    while kept and kept[-1][1] <= desired:
        kept.pop()
    kept.append((now, desired))
    return tuple(kept)


def stabilized_target(history: tuple[tuple[float, int], ...], desired: int, policy: Policy) -> int:
    """The scale-in target: the highest desired in the window, never above ``max_workers``."""
    highest = max((d for _, d in history), default=desired)
    return min(policy.max_workers, max(desired, highest))


def spawn_count(desired: int, fleet: Fleet, policy: Policy) -> int:
    """Workers to start: the gap net of those already starting, at most ``max_step_up``."""
    return max(0, min(desired - fleet.current, policy.max_step_up))


def scale_in_blocker(fleet: Fleet, policy: Policy, now: float) -> str | None:
    """Why no worker may be retired this pass, or None."""
    if in_no_scale_in_window(policy, now):
        return "inside a no-scale-in window"
    stale = len(fleet.stale)
    if stale * 2 > len(fleet.ready):
        return f"reports missing from {stale} of {len(fleet.ready)} ready workers"
    return None


def reclaim_idle(fleet: Fleet, count: int) -> tuple[Retirement, ...]:
    """Up to ``count`` idle workers, least occupied first; the reception only when alone."""
    alone = fleet.current == 1
    idle = [w for w in fleet.ready if w.idle and (alone or w.id != fleet.reception)]
    idle.sort(key=lambda w: (w.occupancy, w.id))
    return tuple(Retirement(w.id, "reclaim-idle") for w in idle[:count])


def consolidation(fleet: Fleet, policy: Policy,
                  taken: tuple[Retirement, ...]) -> tuple[Retirement | None, str | None]:
    """Drain the least-occupied non-reception worker if the survivors can carry its load.

    The ledger's margin applies to automatic compaction; a tier above ``max_workers`` (the
    operator lowered it) skips it, but the load must still fit.
    """
    if fleet.starting:
        return None, "consolidation waits for starting workers"
    gone = {r.worker for r in taken}
    remaining = tuple(w for w in fleet.ready if w.id not in gone)
    candidates = [w for w in remaining if w.fresh and w.id != fleet.reception]
    if not candidates:
        return None, "no worker may be consolidated"
    victim = min(candidates, key=lambda w: (w.occupancy, w.id))
    survivors = tuple(w for w in remaining if w.id != victim.id)
    if not fits(victim, survivors, fleet.reception, policy):
        return None, f"{victim.id}'s load {victim.occupancy:.2f} does not fit on the others: kept"
    load = ledger_load(remaining, fleet.reception, policy)
    forced = fleet.current > policy.max_workers
    if not forced and not may_compact(len(remaining), load, policy):
        headroom = capacity(len(remaining), policy) - load
        margin = policy.compaction_margin * policy.admission_threshold
        return None, f"ledger headroom {headroom:.2f} <= {margin:.2f}: no compaction"
    return Retirement(victim.id, "consolidate"), None


def plan_scale_in(fleet: Fleet, policy: Policy, target: int,
                  now: float) -> tuple[tuple[Retirement, ...], str | None]:
    """Victims to drain toward ``target``: idle ones, else at most one consolidation."""
    excess = fleet.current - target
    if excess <= 0:
        return (), None
    blocked = scale_in_blocker(fleet, policy, now)
    if blocked:
        return (), blocked
    victims = reclaim_idle(fleet, excess)
    if len(victims) == excess:
        return victims, None
    victim, refusal = consolidation(fleet, policy, victims)
    return (victims + (victim,) if victim else victims), refusal


def _driver(proposals: dict[str, int | None], raw: int) -> str:
    """Which signals set the desired count, e.g. ``"buffer, occupancy propose 3"``."""
    if raw <= 0:
        return "no signal asks for a worker"
    names = [name for name, p in proposals.items() if p == raw]
    return f"{', '.join(names)} propose{'s' if len(names) == 1 else ''} {raw}"


def explain(plan: Plan, starting: int, policy: Policy) -> str:
    """A one-line human reason for the plan (or for doing nothing)."""
    driver = _driver(plan.proposals, plan.raw)
    clamp = f", clamped by {plan.clamp} to {plan.desired}" if plan.clamp else ""
    if plan.spawn:
        extra = f", {starting} already starting" if starting else ""
        if plan.current + plan.spawn < plan.desired:
            extra += f", step capped at {policy.max_step_up}"
        return f"scale up {plan.current}->{plan.current + plan.spawn}: {driver}{clamp}{extra}"
    if plan.retire:
        who = ", ".join(f"{r.action} {r.worker}" for r in plan.retire)
        rest = f"; {plan.held}" if plan.held else ""
        return f"scale in {plan.current}->{plan.current - len(plan.retire)}: {who}{rest}"
    if plan.held:
        return f"hold at {plan.current} (want {plan.target}): {plan.held}"
    if plan.target > plan.desired and plan.current > plan.desired:
        keeps = f"stabilization keeps {plan.target} ({policy.scale_down_stabilization_s:g}s)"
        return f"hold at {plan.current}: {driver}{clamp}, {keeps}"
    return f"steady at {plan.current}: {driver}{clamp}"


def next_state(state: TierState, history: tuple[tuple[float, int], ...], plan: Plan,
               now: float) -> TierState:
    """The state to pass to the next ``decide`` of this tier."""
    return TierState(
        history=history,
        last_scale_up=now if plan.spawn else state.last_scale_up,
        last_scale_down=now if plan.retire else state.last_scale_down,
    )


def decide(snapshot: TierSnapshot, policy: Policy, state: TierState,
           now: float) -> tuple[Plan, TierState]:
    """One pass of the judge for one tier: the plan (with its reasons) and the next state."""
    fleet = classify(snapshot.workers)
    proposals = signal_proposals(snapshot, fleet, policy)
    raw = max_proposal(proposals)
    desired, clamp = clamp_desired(raw, snapshot, policy)
    history = record_desired(state.history, now, desired, policy.scale_down_stabilization_s)
    target = stabilized_target(history, desired, policy)
    spawn = spawn_count(desired, fleet, policy)
    retire, held = plan_scale_in(fleet, policy, target, now)
    plan = Plan(snapshot.tier, fleet.current, desired, target, spawn, retire, proposals, raw,
                clamp, held)
    plan = replace(plan, reason=explain(plan, len(fleet.starting), policy))
    return plan, next_state(state, history, plan, now)

