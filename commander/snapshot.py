"""What ``decide`` sees of a tier: plain, frozen values, built by the observer each pass.

Nothing here reads Redis or the clock; the observer fills these from the registry, the
evaluator and the tier's streams, and ``decide`` trusts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ViewState = Literal["starting", "ready", "draining"]


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the judge sees it.

    ``fresh`` says whether a recent report backs ``occupancy``/``busy``/``lanes``: without
    one they are unknown, and unknown is never idle.
    """

    id: str
    state: ViewState = "ready"
    occupancy: float = 0.0
    busy: int = 0  # busy handler slots
    total: int = 0  # handler slots
    lanes: int = 0  # users whose lane it holds
    fresh: bool = True
    is_reception: bool = False  # marked by the observer; else the oldest ready worker
    started: float = 0.0  # unix time of its spawn (or of its own start, for one started apart)
    ready_at: float | None = None  # its first report as ready: ready_at - started is its start cost
    turns: int = 0  # turns it has served since it started (its counters)
    protected_until: float | None = None  # a handler asked that it not be retired before this

    def protected(self, now: float) -> bool:
        """Whether a handler's scale-in protection still holds at ``now``."""
        return self.protected_until is not None and now < self.protected_until

    @property
    def idle(self) -> bool:
        """Ready, freshly reported, no busy slot and no lane: safe to reclaim."""
        return self.state == "ready" and self.fresh and self.busy == 0 and self.lanes == 0


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """A tier's signals at one pass. ``pressure_events`` counts those since the last pass."""

    tier: str
    workers: tuple[WorkerView, ...] = ()
    active_users: int = 0
    backlog: int = 0  # notifications no worker started (stores.backlog): lag + orphaned pending
    rps: float = 0.0  # turns per second the tier's workers served (their counters, over a minute)
    handler_rate: float = 0.0  # handler seconds per second, same span: with rps, the time a turn takes
    pressure_events: int = 0
    observed: bool = True  # False when the tier's signals could not be read this pass


@dataclass(frozen=True, slots=True)
class TierWorkers:
    """A tier's workers sorted by state, with its reception worker named."""

    ready: tuple[WorkerView, ...]
    starting: tuple[WorkerView, ...]
    draining: tuple[WorkerView, ...]
    reception: str | None

    @property
    def current(self) -> int:
        """Workers that count as capacity: running and starting (never draining)."""
        return len(self.ready) + len(self.starting)

    @property
    def fresh(self) -> tuple[WorkerView, ...]:
        """Ready workers backed by a recent report."""
        return tuple(w for w in self.ready if w.fresh)

    @property
    def stale(self) -> tuple[WorkerView, ...]:
        """Ready workers whose reports are missing or late."""
        return tuple(w for w in self.ready if not w.fresh)


def _age_key(w: WorkerView) -> tuple[float, str]:
    return (w.started, w.id)


def reception_of(ready: tuple[WorkerView, ...], starting: tuple[WorkerView, ...]) -> str | None:
    """The reception: a marked worker if any, else the tier's first (oldest started) worker."""
    for group in (ready, starting):
        marked = [w for w in group if w.is_reception]
        if marked:
            return min(marked, key=_age_key).id
    for group in (ready, starting):
        if group:
            return min(group, key=_age_key).id
    return None


def classify(workers: tuple[WorkerView, ...]) -> TierWorkers:
    """Split workers by state and name the reception."""
    ready = tuple(w for w in workers if w.state == "ready")
    starting = tuple(w for w in workers if w.state == "starting")
    draining = tuple(w for w in workers if w.state == "draining")
    return TierWorkers(ready, starting, draining, reception_of(ready, starting))
