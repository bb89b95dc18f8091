"""What the leading commander publishes for its monitor: the last pass, read from another thread.

The commander's loop writes (``Board.tier`` per judged tier, ``Board.publish`` at the end of a
pass); the monitor's server thread reads (``Board.seen``, ``Board.samples``). Everything
published is immutable (frozen dataclasses, tuples, fresh dicts never mutated after the swap),
so a reader needs no lock for the pass itself; the per-tier sample rings, appended to in place,
are read under the board's lock.

No aiohttp here: the commander imports this module whether or not it serves a monitor.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from commander.decide import Plan
from commander.evaluator import Evaluator, Row
from commander.snapshot import TierSnapshot
from protocol.models import WorkerInfo
from protocol.policy import Policy

SAMPLE_EVERY_S = 5.0  # one point of the tier chart every this many seconds
KEEP_S = 3600.0  # the chart's span: the last hour


@dataclass(frozen=True, slots=True)
class TierSeen:
    """One tier as the last pass judged it: its policy, its signals and the plan."""

    tier: str
    ts: float
    policy: Policy
    source: str  # where the policy came from ("key", "last-good", "default")
    error: str | None  # why the tier's policy key is rejected (the policy above runs instead)
    snapshot: TierSnapshot
    plan: Plan
    starting: int
    group_rejected: str | None = None  # a group's pool: why the commander rejected its group


@dataclass(frozen=True, slots=True)
class Sample:
    """One point of a tier's chart: its workers and its demand at ``ts``."""

    ts: float
    ready: int
    starting: int
    draining: int
    desired: int
    target: int
    active_users: int
    backlog: int
    rps: float
    busy_slots: int


Entries = Mapping[str, tuple[WorkerInfo, bool]]  # registry entries: id -> (entry, alive)


@dataclass(frozen=True, slots=True)
class Seen:
    """The last pass: its tiers, each worker's window of rows, and the registry it read."""

    ts: float
    tiers: Mapping[str, TierSeen] = field(default_factory=dict)
    windows: Mapping[str, tuple[Row, ...]] = field(default_factory=dict)
    registry: Entries = field(default_factory=dict)
    generation: int = 0  # +1 per publish: a cache key for what the monitor derives from it


def sample_of(seen: TierSeen) -> Sample:
    """The chart's point for one judged tier."""
    workers = seen.snapshot.workers
    return Sample(ts=seen.ts, ready=sum(1 for w in workers if w.state == "ready"), starting=seen.starting,
                  draining=sum(1 for w in workers if w.state == "draining"), desired=seen.plan.desired,
                  target=seen.plan.target, active_users=seen.snapshot.active_users,
                  backlog=seen.snapshot.backlog, rps=seen.snapshot.rps,
                  busy_slots=sum(w.busy for w in workers))


class Board:
    """The commander's last pass, published for the monitor, and an hour of chart samples."""

    def __init__(self, sample_every_s: float = SAMPLE_EVERY_S, keep_s: float = KEEP_S) -> None:
        self._every, self._keep = sample_every_s, keep_s
        self._lock = threading.Lock()
        self._pending: dict[str, TierSeen] = {}
        self._samples: dict[str, deque[Sample]] = {}
        self._seen: Seen | None = None
        # the registry last published, and the copy of it the monitor reads (made once per registry)
        self._registry: tuple[Entries | None, Entries] = None, {}

    def tier(self, seen: TierSeen) -> None:
        """Record one tier judged this pass (the commander's thread)."""
        self._pending[seen.tier] = seen
        with self._lock:
            ring = self._samples.setdefault(seen.tier, deque())
            if not ring or seen.ts - ring[-1].ts >= self._every:
                ring.append(sample_of(seen))
            while ring and seen.ts - ring[0].ts > self._keep:
                ring.popleft()

    def publish(self, now: float, registry: Entries,
                evaluator: Evaluator) -> None:
        """End of a pass: swap in what it saw (the tiers recorded since the last publish)."""
        tiers, self._pending = self._pending, {}
        generation = self._seen.generation + 1 if self._seen else 1
        if registry is not self._registry[0]:  # (a copy: the pass's thread keeps its own)
            self._registry = registry, dict(registry)
        self._seen = Seen(ts=now, tiers=tiers, windows=evaluator.windows(), registry=self._registry[1],
                          generation=generation)
        with self._lock:  # a tier gone for the chart's whole span is dropped
            gone = [t for t, ring in self._samples.items() if not ring or now - ring[-1].ts > self._keep]
            for tier in gone:
                del self._samples[tier]

    @property
    def seen(self) -> Seen | None:
        """The last published pass (None before the first)."""
        return self._seen

    def samples(self, tier: str, since: float = 0.0) -> list[Sample]:
        """The tier's chart points at or after ``since``, oldest first."""
        with self._lock:
            return [s for s in self._samples.get(tier, ()) if s.ts >= since]
