"""Which workers go, and how many may: the scale-in half of ``decide`` (down is slow).

- ``reclaim_idle``: idle workers first (ready, fresh, no busy slot, no lane), least occupied;
  the reception only when it is alone;
- ``consolidation``: then, one after another in the same batch, the least-occupied fresh
  non-reception worker, only if its load fits on the survivors under their thresholds and the
  ledger keeps its margin (the survivors of the ones chosen before it);
- a worker a handler protected (``WorkerView.protected``) is never picked, nor one being
  recycled;
- ``plan_recycle``: a worker past ``max_worker_age_s`` or ``max_turns_per_worker`` is
  replaced make-before-break: a replacement is started first, and once no worker of the tier
  is starting the old one drains (action ``recycle``), one at a time, through the same drain
  and within the disruption budget.

Pure: no Redis, no clock.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from commander.capacity import capacity, fits, ledger_load, may_compact
from commander.snapshot import TierWorkers, WorkerView
from protocol.policy import ScaleRules

RetireAction = Literal["reclaim-idle", "consolidate", "recycle"]


@dataclass(frozen=True, slots=True)
class Retirement:
    """One worker to drain, and why it was chosen."""

    worker: str
    action: RetireAction


def may_go(w: WorkerView, now: float, keep: Collection[str]) -> bool:
    """Whether ``w`` may be chosen for scale-in: not protected, not kept for another reason."""
    return not w.protected(now) and w.id not in keep


def protected_note(fleet: TierWorkers, now: float) -> str | None:
    """The protected workers, for the ledger, or None."""
    held = [f"{w.id} ({w.protected_until - now:.0f} s)" for w in fleet.ready
            if w.protected(now) and w.protected_until is not None]
    return f"protected by their handlers: {', '.join(held)}" if held else None


def reclaim_idle(fleet: TierWorkers, count: int, now: float = 0.0,
                 keep: Collection[str] = ()) -> tuple[Retirement, ...]:
    """Up to ``count`` idle workers, least occupied first; the reception only when alone."""
    alone = fleet.current == 1
    idle = [w for w in fleet.ready if w.idle and (alone or w.id != fleet.reception) and may_go(w, now, keep)]
    idle.sort(key=lambda w: (w.occupancy, w.id))
    return tuple(Retirement(w.id, "reclaim-idle") for w in idle[:max(0, count)])


def consolidation(fleet: TierWorkers, policy: ScaleRules, taken: tuple[Retirement, ...], now: float = 0.0,
                  keep: Collection[str] = ()) -> tuple[Retirement | None, str | None]:
    """Drain the least-occupied non-reception worker if the survivors can carry its load.

    The ledger's margin applies to automatic compaction; a tier above ``max_workers`` (the
    operator lowered it) skips it, but the load must still fit.
    """
    if fleet.starting:
        return None, "consolidation waits for starting workers"
    gone = {r.worker for r in taken}
    remaining = tuple(w for w in fleet.ready if w.id not in gone)
    candidates = [w for w in remaining if w.fresh and w.id != fleet.reception and may_go(w, now, keep)]
    if not candidates:
        return None, protected_note(fleet, now) or "no worker may be consolidated"
    victim = min(candidates, key=lambda w: (w.occupancy, w.id))
    survivors = tuple(w for w in remaining if w.id != victim.id)
    if not fits(victim, survivors, fleet.reception, policy):
        return None, f"{victim.id}'s load {victim.occupancy:.2f} does not fit on the others: kept"
    load = ledger_load(remaining, fleet.reception, policy)
    forced = fleet.current > policy.max_workers
    if not forced and not may_compact(len(remaining), load, policy):
        headroom = capacity(len(remaining), policy) - load
        occupancy = policy.scaling.occupancy
        margin = occupancy.compaction_margin * occupancy.admission_threshold
        return None, f"ledger headroom {headroom:.2f} <= {margin:.2f}: no compaction"
    return Retirement(victim.id, "consolidate"), None


def choose_victims(fleet: TierWorkers, policy: ScaleRules, count: int, now: float,
                   keep: Collection[str]) -> tuple[tuple[Retirement, ...], str | None]:
    """Up to ``count`` victims in one batch: idle ones, then consolidations one after another,
    each fitting on the survivors of the ones before it (with why fewer went)."""
    if count <= 0:
        return (), None
    victims = reclaim_idle(fleet, count, now, keep)
    while len(victims) < count:
        victim, refusal = consolidation(fleet, policy, victims, now, keep)
        if victim is None:
            return victims, refusal
        victims += (victim,)
    return victims, None


# --- recycling ---------------------------------------------------------------------------
def recycle_due(w: WorkerView, policy: ScaleRules, now: float) -> str | None:
    """Why ``w`` is due for recycling, or None."""
    age, turns = policy.controls.max_worker_age_s, policy.controls.max_turns_per_worker
    if age is not None and w.started > 0 and now - w.started >= age:
        return f"{w.id} is {now - w.started:.0f} s old (max_worker_age_s {age:g})"
    if turns is not None and w.turns >= turns:
        return f"{w.id} served {w.turns} turns (max_turns_per_worker {turns})"
    return None


Recycling = tuple[tuple[str, float, str], ...]  # (old worker, replacement asked at, phase)
REPLACEMENT_GRACE_S = 60.0  # a replacement not seen by then is asked for again


@dataclass(frozen=True, slots=True)
class Recycle:
    """This pass's recycling: a replacement to start, an old worker to drain, who is in hand."""

    spawn: int = 0
    retire: tuple[Retirement, ...] = ()
    pending: Recycling = ()
    note: str | None = None

    @property
    def replacing(self) -> int:
        """Old workers still counted while their replacement comes up."""
        return sum(1 for _, _, phase in self.pending if phase == "replacing")

    @property
    def leaving(self) -> int:
        """Old workers told to drain, still listed as ready (this pass's drain among them)."""
        return sum(1 for _, _, phase in self.pending if phase == "draining")

    @property
    def involved(self) -> tuple[str, ...]:
        """Workers scale-in must leave to the recycling."""
        return tuple(wid for wid, _, _ in self.pending)


def _replacement_up(fleet: TierWorkers, asked_at: float) -> bool:
    """Whether a worker started since ``asked_at`` is ready and nothing else is starting."""
    return not fleet.starting and any(w.started >= asked_at for w in fleet.ready)


def _advance(fleet: TierWorkers, entry: tuple[str, float, str], now: float,
             room: int | None) -> tuple[tuple[str, float, str] | None, Retirement | None, str | None]:
    """One pending recycle one step on: (the entry kept or None, a drain, a note)."""
    wid, asked_at, phase = entry
    old = next((w for w in fleet.ready if w.id == wid), None)
    if old is None:
        return None, None, None  # drained (or gone): done
    if phase == "draining":
        return entry, None, None
    if not _replacement_up(fleet, asked_at):
        if not fleet.starting and now - asked_at > REPLACEMENT_GRACE_S:
            return None, None, f"recycling {wid}: its replacement never came up; asked again"
        return entry, None, f"recycling {wid}: its replacement is starting"
    if room == 0:
        return entry, None, f"recycling {wid} waits for the disruption budget"
    if old.protected(now):
        return entry, None, f"recycling {wid} waits for its protection to end"
    return (wid, asked_at, "draining"), Retirement(wid, "recycle"), f"recycle {wid}: its replacement is ready"


def plan_recycle(fleet: TierWorkers, policy: ScaleRules, pending: Recycling, now: float,
                 room: int | None) -> Recycle:
    """Drain an old worker whose replacement is up, or start a replacement for the oldest due one."""
    kept: list[tuple[str, float, str]] = []
    retire: tuple[Retirement, ...] = ()
    notes = []
    for entry in pending:
        entry2, drain, note = _advance(fleet, entry, now, room if not retire else 0)
        if entry2 is not None:
            kept.append(entry2)
        if drain is not None:
            retire += (drain,)
        if note:
            notes.append(note)
    if any(phase == "replacing" for _, _, phase in kept):
        return Recycle(0, retire, tuple(kept), "; ".join(notes) or None)
    busy = {wid for wid, _, _ in kept}
    due = [(w.started, w.id, why) for w in fleet.ready if w.id not in busy
           and (why := recycle_due(w, policy, now)) is not None and not w.protected(now)]
    if not due:
        return Recycle(0, retire, tuple(kept), "; ".join(notes) or None)
    _, wid, why = min(due)
    notes.append(f"recycle: {why}; starting its replacement")
    return Recycle(1, retire, (*kept, (wid, now, "replacing")), "; ".join(notes))
