"""The simulator's types: what a policy is (``SimPolicy``) and asks for (``Scale``), how the
tier runs (``SimConfig``), a simulated worker, and the outcome of a run (``SimResult``, with
its ``summary`` and ``quantile``). The simulator itself is ``sim/scaling/simulate.py``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from commander.snapshot import TierSnapshot
from protocol.policy import TurnsPolicy


@dataclass(frozen=True)
class Scale:
    """What a policy asks for at a pass: workers to start and workers (by id) to drain."""

    spawn: int = 0
    retire: tuple[str, ...] = ()


class SimPolicy(Protocol):
    """A scaling policy the simulator can run. It returns a ``Scale`` or a target count."""

    name: str
    observes: bool  # needs a TierSnapshot (reports are simulated only then)
    wakes_on_pressure: bool

    def initial_workers(self) -> int:
        """Ready workers at time 0."""
        ...

    def due(self, now: float) -> bool:
        """Whether the policy runs at this pass (HPA every 15 s, KEDA every 30 s, ...)."""
        ...

    def __call__(self, now: float, snap: TierSnapshot | None, current: int) -> Scale | int:
        """The decision; ``now`` is seconds since the trace start, ``current`` starting + ready."""
        ...


@dataclass(frozen=True)
class SimConfig:
    """How the simulated tier runs. ``view_policy`` feeds the snapshot (staleness, window)."""

    concurrency: int = 8
    tier: str = "chat"
    interval_s: float = 0.5
    spawn_delay_s: float = 0.1
    wake_s: float = 0.005
    slo_s: float = 1.0
    sample_s: float = 1.0
    epoch: float = 0.0  # unix time of the trace's start: reports and decide() see epoch + t
    report_outages: tuple[tuple[float, float], ...] = ()  # [start, end) with every report lost
    protect_turns_over_s: float | None = None  # such turns protect their worker while they run
    view_policy: TurnsPolicy = field(default_factory=TurnsPolicy)


@dataclass
class SimWorker:
    id: str
    started: float
    state: Literal["starting", "ready", "draining"] = "starting"
    busy: dict[str, int] = field(default_factory=dict)  # user -> turn index in service
    last_take: float = -1.0
    turns: int = 0
    handler_seconds: float = 0.0  # of the turns that ended
    since: dict[str, float] = field(default_factory=dict)  # user -> when its turn in service began

    def copy(self) -> SimWorker:
        return SimWorker(self.id, self.started, self.state, dict(self.busy), self.last_take, self.turns,
                         self.handler_seconds, dict(self.since))

    def handler_seconds_at(self, now: float) -> float:
        """Handler seconds up to ``now``, the turns in service included as far as they ran: what
        ``worker.sensor.Reports`` reports (``TurnTally.counters``: handler time counted as it runs)."""
        return self.handler_seconds + sum(now - t for t in self.since.values())


@dataclass
class SimResult:
    """The outcome of one run; ``waits`` is per turn (NaN if never served)."""

    policy: str
    waits: list[float]
    arrivals: list[float]
    worker_seconds: float
    scale_ups: int
    scale_downs: int
    spawned: int
    retired: int
    timeline: list[tuple[float, int, int, int, int]]  # (t, workers, ready, queued, in service)
    slo_s: float
    horizon_s: float
    runtime_s: float = 0.0

    def summary(self) -> dict[str, float | int | str]:
        """The figures the benchmark reports."""
        served = [w for w in self.waits if not math.isnan(w)]
        over = sum(1 for w in served if w > self.slo_s) + (len(self.waits) - len(served))
        workers = [s[1] for s in self.timeline if s[0] <= self.horizon_s] or [0]
        return {
            "policy": self.policy, "turns": len(self.waits), "unserved": len(self.waits) - len(served),
            "p50_wait_s": round(quantile(served, 50), 3), "p99_wait_s": round(quantile(served, 99), 3),
            "max_wait_s": round(max(served, default=0.0), 3), "slo_violations": over,
            "slo_violation_pct": round(100.0 * over / max(1, len(self.waits)), 2),
            "worker_seconds": round(self.worker_seconds, 1),
            "mean_workers": round(self.worker_seconds / max(self.horizon_s, 1e-9), 2),
            "peak_workers": max(workers), "scale_ups": self.scale_ups, "scale_downs": self.scale_downs,
            "scale_events": self.scale_ups + self.scale_downs, "spawned": self.spawned,
            "retired": self.retired, "runtime_s": round(self.runtime_s, 2),
        }


def quantile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]
