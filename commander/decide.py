"""The judge: ``decide(snapshot, policy, state, now) -> (Plan, TierState)``.

Pure: no Redis, no clock, no randomness. ``now`` comes in as an argument, the previous
``TierState`` comes in and the next one goes out. The steps, in order:

1. every enabled signal proposes a worker count (``commander.signals``); the asking ones' max is
   what the pass aims at, and a scale-up is sized by the measured load and doubles within a
   burst (``commander.scaleup``);
2. clamp to the tier's floor and cap: ``[min_workers, max_workers]`` moved by the scheduled
   bounds in force (``commander.bounds``); backlog or pressure on an empty tier asks for 1;
3. the scale-in hold is derived from what a worker costs to start (``commander.holdtime``:
   the break-even rule) unless the policy fixes it; the scale-in target is the highest desired
   (never under the measured load) over the hold;
4. ``paused`` does nothing; after ``fallback.after`` failed observations the fallback holds or
   goes up to a fixed count, and never scales in;
5. up is fast: spawn ``desired - (running + starting)``, at most ``max_step_up`` (when set) and
   what the scale-up rate rules allow (``commander.limits``);
6. down is slow: one scale-in per hold, to the target in one batch, unless blocked
   (``paused_scale_in``, a no-scale-in window, missing reports, scale-down disabled), at most what
   the scale-down rules and the disruption budget allow; idle workers go first, then
   consolidations (``commander.scalein``); protected workers never go;
7. recycling by age or turns, make-before-break, within the same budget.

Same snapshot + the returned state gives the same plan and the same state again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from commander import holdtime, scaleup
from commander.bounds import Bounds, in_no_scale_in_window, tier_bounds, utc_weekday_minute
from commander.limits import budget_room, down_limit, longest_period, record_changes, up_limit
from commander.scalein import Recycle, Recycling, Retirement, choose_victims, plan_recycle
from commander.signals import proposals as signal_proposals
from commander.snapshot import TierSnapshot, TierWorkers, WorkerView, classify
from commander.tierstate import TierState
from protocol.policy import ScaleRules

__all__ = ["Plan", "Retirement", "TierSnapshot", "TierState", "WorkerView", "decide",
           "in_no_scale_in_window", "utc_weekday_minute"]


@dataclass(frozen=True)
class Plan:
    """What to do for one tier this pass, with every reason the ledger records."""

    tier: str
    current: int  # ready + starting workers (draining ones are not capacity)
    desired: int  # max of the proposals, clamped
    target: int  # the scale-in target after the hold (>= desired)
    spawn: int = 0
    retire: tuple[Retirement, ...] = ()
    proposals: dict[str, int | None] = field(default_factory=dict)
    raw: int = 0  # what the pass aims at before the clamp (the asking proposals', sized)
    clamp: str | None = None  # "min_workers", "max_workers", "wake", "schedule ..." or None
    held: str | None = None  # why a wanted scale-in did not (fully) happen
    reason: str = ""
    hold: holdtime.Hold | None = None
    bounds: Bounds | None = None
    notes: tuple[str, ...] = ()  # limits applied, recycling, fallback
    failures: int = 0  # failed observations in a row
    asked: int = 0  # the highest proposal of the signals that ask for workers
    sized_by: str | None = None  # the rule that raised a scale-up past what asked (scaleup.Step)

    @property
    def changed(self) -> bool:
        """Whether the plan asks the runtime to do anything."""
        return self.spawn > 0 or bool(self.retire)

    def why(self) -> dict[str, Any]:
        """The reasons as plain data, for the ``fleet:events`` ledger."""
        out: dict[str, Any] = {
            "proposals": dict(self.proposals), "raw": self.raw, "clamp": self.clamp,
            "desired": self.desired, "stabilized": self.target, "held": self.held,
            "reason": self.reason}
        if self.sized_by is not None:
            out["step"] = {"asked": self.asked, "sized_by": self.sized_by}
        if self.hold is not None:
            out["hold"] = self.hold.why()
        if self.bounds is not None:
            out["floor"], out["cap"] = self.bounds.floor, self.bounds.cap
        if self.notes:
            out["notes"] = list(self.notes)
        if self.failures:
            out["failed_observations"] = self.failures
        return out


def clamp_desired(raw: int, snapshot: TierSnapshot, bounds: Bounds) -> tuple[int, str | None]:
    """Clamp to the floor and cap; parked work on an empty tier asks for 1."""
    floor, why = bounds.floor, bounds.floor_by
    if (snapshot.backlog > 0 or snapshot.pressure_events > 0) and floor < 1:
        floor, why = min(1, bounds.cap), "wake"
    if raw < floor:
        return floor, why
    if raw > bounds.cap:
        return bounds.cap, bounds.cap_by
    return raw, None


def kept(desired: int, proposals: dict[str, int | None], bounds: Bounds) -> int:
    """What the scale-in hold keeps from this pass: the desired count, never under the measured
    load at the admission threshold (``load`` sizes; it never asks)."""
    return max(desired, min(proposals.get("load") or 0, bounds.cap))


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


def stabilized_target(history: tuple[tuple[float, int], ...], desired: int, cap: int) -> int:
    """The scale-in target: the highest desired in the window, never above the cap."""
    highest = max((d for _, d in history), default=desired)
    return min(cap, max(desired, highest))


def observation_failed(snapshot: TierSnapshot, fleet: TierWorkers) -> bool:
    """Whether this pass's observation failed: signals unread, or most reports missing."""
    return not snapshot.observed or len(fleet.stale) * 2 > len(fleet.ready)


def count_failures(state: TierState, failed: bool, now: float) -> tuple[int, float | None]:
    """Failed observations in a row: one more per failed pass (a pass repeated at the same
    ``now`` counts once), none after a good one."""
    if not failed:
        return 0, None
    if state.failed_at is not None and now <= state.failed_at:
        return state.failures, state.failed_at
    return state.failures + 1, now


def scale_in_blocker(fleet: TierWorkers, policy: ScaleRules, snapshot: TierSnapshot,
                     now: float) -> str | None:
    """Why no worker may be retired for scale-in this pass, or None."""
    if policy.controls.paused_scale_in:
        return "scale-in paused (paused_scale_in)"
    if policy.controls.scale_down.select == "disabled":
        return "scale-down disabled (scale_down.select)"
    if in_no_scale_in_window(policy, now):
        return "inside a no-scale-in window"
    if not snapshot.observed:
        return "the tier's signals could not be read"
    stale = len(fleet.stale)
    if stale * 2 > len(fleet.ready):
        return f"reports missing from {stale} of {len(fleet.ready)} ready workers"
    return None


@dataclass(frozen=True, slots=True)
class Moves:
    """What the pass does, before it becomes a ``Plan``."""

    spawn: int = 0
    retire: tuple[Retirement, ...] = ()
    held: str | None = None
    notes: tuple[str, ...] = ()
    recycling: Recycling = ()
    replacements: int = 0  # of ``spawn``, the recycling's (no scale event for the rate rules)


def fallback_moves(policy: ScaleRules, fleet: TierWorkers, failures: int, state: TierState) -> Moves | None:
    """The fallback once ``after`` observations in a row failed, else None."""
    fb = policy.controls.fallback
    if fb is None or failures < fb.after:
        return None
    head = f"fallback after {failures} failed observations"
    if fb.action == "hold" or fb.workers is None or fleet.current >= fb.workers:
        return Moves(held=f"{head}: hold at {fleet.current} (never scale in on missing data)",
                     recycling=state.recycling)
    spawn = capped(fb.workers - fleet.current, policy)
    return Moves(spawn=spawn, notes=(f"{head}: up to {fb.workers}",), recycling=state.recycling)


def capped(want: int, policy: ScaleRules) -> int:
    """``want`` workers, at most ``max_step_up`` when the policy sets it."""
    step = policy.scaling.max_step_up
    return want if step is None else min(want, step)


def limited_spawn(desired: int, effective: int, fleet: TierWorkers, policy: ScaleRules, state: TierState,
                  now: float) -> tuple[int, str | None]:
    """Workers to start: the gap net of those starting, capped by ``max_step_up`` and the rules."""
    want = capped(max(0, desired - effective), policy)
    limit = up_limit(policy.controls.scale_up, fleet.current, state.changes, now)
    if limit is None or fleet.current + want <= limit:
        return want, None
    allowed = max(0, limit - fleet.current)
    return allowed, f"scale-up rate limit: {fleet.current}->{limit} allowed now (wanted +{want})"


def victims_allowed(excess: int, fleet: TierWorkers, policy: ScaleRules, state: TierState, now: float,
                    room: int | None) -> tuple[int, str | None]:
    """How many of ``excess`` may go now: the scale-down rules and the disruption budget."""
    count, note = excess, None
    limit = down_limit(policy.controls.scale_down, fleet.current, state.changes, now)
    if limit is not None and fleet.current - count < limit:
        count, note = max(0, fleet.current - limit), f"scale-down rate limit: down to {limit} now"
    if room is not None and count > room:
        count, note = room, f"disruption budget: {len(fleet.draining)} draining, {room} more may go"
    return count, note


Victims = tuple[tuple[Retirement, ...], str | None]


def scale_in_wait(state: TierState, hold_s: float, now: float) -> str | None:
    """One scale-in per hold: the target after a scale-in is the highest desired of the hold that
    follows it, so what that hold allows goes one hold later, in one batch. (A pass repeated at
    the same ``now`` is not held back by its own scale-in.)"""
    last = state.last_scale_down
    if last is None or not 0.0 < now - last < hold_s:
        return None
    return f"one scale-in per hold: the last {now - last:.0f} s ago, the next after {hold_s:g} s"


def scale_in(fleet: TierWorkers, policy: ScaleRules, snapshot: TierSnapshot, state: TierState, now: float,
             excess: int, room: int | None, keep: tuple[str, ...], hold_s: float) -> Victims:
    """The victims toward the target, with why fewer went than wanted."""
    if excess <= 0:
        return (), None
    blocked = scale_in_blocker(fleet, policy, snapshot, now) or scale_in_wait(state, hold_s, now)
    if blocked:
        return (), blocked
    count, limited = victims_allowed(excess, fleet, policy, state, now, room)
    victims, refusal = choose_victims(fleet, policy, count, now, keep)
    return victims, limited if count < excess else refusal


def normal_moves(fleet: TierWorkers, policy: ScaleRules, snapshot: TierSnapshot, state: TierState, now: float,
                 desired: int, target: int, hold_s: float) -> Moves:
    """Up, down and recycling when nothing pauses or falls back."""
    room = budget_room(policy.controls.disruption_budget, fleet)
    rec: Recycle = plan_recycle(fleet, policy, state.recycling, now, room)
    spawn, up_note = limited_spawn(desired, fleet.current, fleet, policy, state, now)
    if room is not None:
        room -= len(rec.retire)
    # the count once the recycling is through: each old worker replaced one for one
    effective = fleet.current - rec.leaving - rec.replacing + rec.spawn
    retire, held = scale_in(fleet, policy, snapshot, state, now, effective - target, room, rec.involved,
                            hold_s)
    notes = tuple(n for n in (up_note, rec.note) if n)
    return Moves(spawn + rec.spawn, rec.retire + retire, held, notes, rec.pending, rec.spawn)


def _driver(plan: Plan) -> str:
    """Which signals set the count, e.g. ``"buffer, occupancy propose 3"``, and how a scale-up
    was sized past them, e.g. ``"pressure proposes 4, sized by the load to 7"``."""
    if plan.asked <= 0 and plan.raw <= 0:
        return "no signal asks for a worker"
    names = [name for name, p in plan.proposals.items()
             if p == plan.asked and name not in scaleup.SIZING_ONLY]
    driver = f"{', '.join(names)} propose{'s' if len(names) == 1 else ''} {plan.asked}"
    if plan.sized_by is not None:
        driver += f", sized by {plan.sized_by} to {plan.raw}"
    return driver


def explain(plan: Plan, starting: int, policy: ScaleRules) -> str:
    """A one-line human reason for the plan (or for doing nothing)."""
    driver = _driver(plan)
    clamp = f", clamped by {plan.clamp} to {plan.desired}" if plan.clamp else ""
    notes = "".join(f"; {n}" for n in plan.notes)
    if plan.spawn:
        extra = f", {starting} already starting" if starting else ""
        step = policy.scaling.max_step_up
        if plan.current + plan.spawn < plan.desired and not plan.notes and step is not None:
            extra += f", step capped at {step}"
        return f"scale up {plan.current}->{plan.current + plan.spawn}: {driver}{clamp}{extra}{notes}"
    if plan.retire:
        who = ", ".join(f"{r.action} {r.worker}" for r in plan.retire)
        rest = f"; {plan.held}" if plan.held else ""
        return f"scale in {plan.current}->{plan.current - len(plan.retire)}: {who}{rest}{notes}"
    if plan.held:
        return f"hold at {plan.current} (want {plan.target}): {plan.held}{notes}"
    if plan.target > plan.desired and plan.current > plan.desired and plan.hold is not None:
        keeps = f"the scale-in hold keeps {plan.target} ({plan.hold.seconds:g} s, {plan.hold.rule})"
        return f"hold at {plan.current}: {driver}{clamp}, {keeps}{notes}"
    return f"steady at {plan.current}: {driver}{clamp}{notes}"


def decide(snapshot: TierSnapshot, policy: ScaleRules, state: TierState,
           now: float) -> tuple[Plan, TierState]:
    """One pass of the judge for one tier: the plan (with its reasons) and the next state."""
    fleet = classify(snapshot.workers)
    starts = holdtime.start_samples(state.starts, fleet)
    hold = holdtime.hold(policy, holdtime.start_cost(starts, fleet, now),
                         holdtime.turns_per_worker(snapshot, fleet))
    queued_since = scaleup.queued_since(state, snapshot, fleet, policy, now)
    proposals = signal_proposals(snapshot, fleet, policy, 0.0 if queued_since is None else now - queued_since)
    step = scaleup.step_target(proposals, fleet, policy, state, now)
    bounds = tier_bounds(policy, now)
    desired, clamp = clamp_desired(step.raw, snapshot, bounds)
    history = record_desired(state.history, now, kept(desired, proposals, bounds), hold.seconds)
    target = stabilized_target(history, desired, bounds.cap)
    failures, failed_at = count_failures(state, observation_failed(snapshot, fleet), now)
    if policy.controls.paused:
        moves = Moves(held="paused (the policy's paused is set)", recycling=state.recycling)
    else:
        moves = fallback_moves(policy, fleet, failures, state) or \
            normal_moves(fleet, policy, snapshot, state, now, desired, target, hold.seconds)
    plan = Plan(snapshot.tier, fleet.current, desired, target, moves.spawn, moves.retire, proposals,
                step.raw, clamp, moves.held, hold=hold, bounds=bounds, notes=moves.notes, failures=failures,
                asked=step.asked, sized_by=step.sized_by if moves.spawn else None)
    plan = replace(plan, reason=explain(plan, len(fleet.starting), policy))
    scaled_up = moves.spawn - moves.replacements
    scaled_down = sum(1 for r in moves.retire if r.action != "recycle")
    changes = record_changes(state.changes, now, scaled_up, scaled_down,
                             longest_period(policy.controls.scale_up, policy.controls.scale_down))
    return plan, TierState(history=history, last_scale_up=now if plan.spawn else state.last_scale_up,
                           last_scale_down=now if scaled_down else state.last_scale_down,
                           changes=changes, starts=starts, failures=failures, failed_at=failed_at,
                           recycling=moves.recycling, steps=scaleup.record_step(state, now, scaled_up),
                           queued_since=queued_since)
