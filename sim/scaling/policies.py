"""Scaling policies for the simulator: Fleet's ``decide()``, static, HPA-like, KEDA-like, oracle.

Each one follows ``sim.scaling.simulate.SimPolicy``. The baselines are re-implementations of the
published algorithms, reduced to what matters for one tier of slot-bound workers:

- **static**: a fixed count, sized for the trace's peak (``peak_static_workers``).
- **HPA-like** (Kubernetes ``horizontal.go``): every 15 s, ``desired = ceil(ready *
  utilization / target)`` unless ``|utilization / target - 1| <= 0.1``; utilization is the
  mean slot occupancy of the ready workers (the evaluator's, like a pod metric averaged by
  the metrics pipeline); up at most ``max(2x, +4)`` per sync; down to the highest
  recommendation of the last 300 s (the default down-stabilization).
- **KEDA-like** (Redis streams scaler feeding an HPA): every 30 s, ``desired =
  ceil(backlog / target_per_replica)`` with backlog = lag + pending, the same 0.1 tolerance
  and 300 s down-stabilization the HPA underneath applies, at least ``min_replicas``.
- **oracle**: perfect foresight, per-minute counts found by search (``oracle_schedule``);
  its workers start exactly at the minute's start with no spawn delay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

from commander.decide import TierState, decide
from commander.snapshot import TierSnapshot
from protocol.policy import TurnsPolicy
from sim.scaling.simulate import Scale, SimConfig, Simulator, quantile
from sim.scaling.trace import TraceTurn


class FleetDecide:
    """The commander's ``decide()`` with its policy: every pass, woken by pressure."""

    observes = True
    wakes_on_pressure = True

    def __init__(self, policy: TurnsPolicy, name: str = "fleet", epoch: float = 0.0) -> None:
        self.name, self.policy, self.state = name, policy, TierState()
        self.epoch = epoch  # the trace's start (SimConfig.epoch): decide() sees unix times

    def initial_workers(self) -> int:
        return max(1, self.policy.min_workers)

    def due(self, now: float) -> bool:
        return True

    def __call__(self, now: float, snap: TierSnapshot | None, current: int) -> Scale:
        assert snap is not None
        plan, self.state = decide(snap, self.policy.scale_rules(), self.state, self.epoch + now)
        return Scale(plan.spawn, tuple(r.worker for r in plan.retire))


@dataclass
class Static:
    """A fixed number of workers, all ready from the start."""

    count: int
    name: str = "static"
    observes: bool = False
    wakes_on_pressure: bool = False

    def initial_workers(self) -> int:
        return self.count

    def due(self, now: float) -> bool:
        return False

    def __call__(self, now: float, snap: TierSnapshot | None, current: int) -> int:
        return self.count


class Metric(Protocol):
    """What an HPA-like policy scales on: the replica count it asks for, before the sync rules."""

    def desired(self, snap: TierSnapshot, current: int, tolerance: float) -> int: ...


@dataclass(frozen=True)
class Utilization:
    """The HPA's pod metric: mean slot occupancy of the ready workers, against a target."""

    target: float = 0.7
    counts_pending = False

    def desired(self, snap: TierSnapshot, current: int, tolerance: float) -> int:
        ready = [w for w in snap.workers if w.state == "ready" and w.fresh]
        if not ready:
            return current
        ratio = sum(w.occupancy for w in ready) / len(ready) / self.target
        if abs(ratio - 1.0) <= tolerance:
            return current
        return math.ceil(ratio * len(ready) - 1e-9)


@dataclass(frozen=True)
class Backlog:
    """KEDA's Redis streams scaler: backlog (lag + pending) per replica, against a target."""

    target_per_replica: float = 6.0
    counts_pending = True  # the backlog it reads is lag + pending, as the streams scaler's

    def desired(self, snap: TierSnapshot, current: int, tolerance: float) -> int:
        desired = math.ceil(snap.backlog / self.target_per_replica - 1e-9)
        if current and abs(desired / current - 1.0) <= tolerance:
            return current
        return desired


@dataclass
class HpaSync:
    """An HPA's loop on one ``metric``: a sync every ``period_s``, a tolerance, bounds, a step-up
    limit and the down-stabilization window (a KEDA scaler feeds the same loop)."""

    metric: Metric
    name: str
    period_s: float
    min_replicas: int = 1
    max_replicas: int = 32
    tolerance: float = 0.1
    down_window_s: float = 300.0
    next_at: float = 0.0
    history: list[tuple[float, int]] = field(default_factory=list)
    observes: bool = True
    wakes_on_pressure: bool = False

    @property
    def counts_pending(self) -> bool:
        return bool(getattr(self.metric, "counts_pending", False))

    def initial_workers(self) -> int:
        return self.min_replicas

    def due(self, now: float) -> bool:
        if now + 1e-9 < self.next_at:
            return False
        self.next_at = now + self.period_s
        return True

    def __call__(self, now: float, snap: TierSnapshot | None, current: int) -> int:
        assert snap is not None
        return self.stabilize(now, self.metric.desired(snap, current, self.tolerance), current)

    def stabilize(self, now: float, desired: int, current: int) -> int:
        """Clamp, limit the step up like the HPA's default policy, hold scale-in for the window."""
        desired = max(self.min_replicas, min(self.max_replicas, desired))
        desired = min(desired, max(2 * current, current + 4))
        self.history = [(t, d) for t, d in self.history if t > now - self.down_window_s]
        self.history.append((now, desired))
        if desired < current:
            return min(current, max(d for _, d in self.history))
        return desired

    def copy(self) -> HpaSync:
        return replace(self, history=list(self.history))


def hpa_like(target_utilization: float = 0.7, max_replicas: int = 32) -> HpaSync:
    """Target mean slot utilization across ready workers, synced every 15 s."""
    return HpaSync(Utilization(target_utilization), "hpa", 15.0, max_replicas=max_replicas)


def keda_like(target_per_replica: float = 6.0, max_replicas: int = 32) -> HpaSync:
    """Target backlog (lag + pending) per replica, polled every 30 s."""
    return HpaSync(Backlog(target_per_replica), "keda", 30.0, max_replicas=max_replicas)


@dataclass
class Schedule:
    """Per-minute worker counts (the oracle's); a minute without a count keeps the last one."""

    counts: dict[int, int]
    minute_s: float = 60.0
    name: str = "oracle"
    observes: bool = False
    wakes_on_pressure: bool = False

    def initial_workers(self) -> int:
        return self.counts.get(0, 1)

    def due(self, now: float) -> bool:
        return True

    def count_at(self, now: float) -> int:
        minute = int(now // self.minute_s)
        while minute >= 0 and minute not in self.counts:
            minute -= 1
        return self.counts.get(minute, 1)

    def __call__(self, now: float, snap: TierSnapshot | None, current: int) -> int:
        return self.count_at(now)

    def copy(self) -> Schedule:
        return replace(self, counts=dict(self.counts))


def peak_static_workers(turns: Sequence[TraceTurn], concurrency: int) -> int:
    """Workers for the peak number of turns in service at once if none ever waited."""
    edges = sorted([(t.at, 1) for t in turns] + [(t.at + t.service_s, -1) for t in turns],
                   key=lambda e: (e[0], e[1]))
    peak = level = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return max(1, math.ceil(peak / concurrency))


def _minute_ok(sim: Simulator, first: int, last: int, until: float, slo_s: float, q: float) -> bool:
    """Run ``sim`` to ``until`` (or until turns first..last all started) and check their q-th wait."""
    step = 10.0
    end = min(until, sim.t + step)
    while True:
        sim.run_until(end)
        waits = sim.wait[first:last]
        if not any(math.isnan(w) for w in waits) or end >= until:
            break
        end = min(until, end + step)
    served = [w if not math.isnan(w) else math.inf for w in waits]
    return quantile(served, q) <= slo_s


def oracle_schedule(turns: Sequence[TraceTurn], config: SimConfig, max_workers: int,
                    slo_s: float = 1.0, q: float = 99.0, minute_s: float = 60.0,
                    lookahead_s: float = 120.0) -> Schedule:
    """The fewest workers per minute that keep that minute's q-th percentile wait <= ``slo_s``.

    Greedy in time order with perfect foresight: for each minute, binary-search the count on a
    copy of the simulation carried over from the minutes already decided (the count holds
    until that minute's arrivals have all started, at most ``lookahead_s``), then commit it.
    Workers of a smaller count drain; the search assumes no spawn delay.
    """
    config = replace(config, spawn_delay_s=0.0)
    schedule = Schedule({0: 1}, minute_s)
    sim = Simulator(turns, schedule, config)
    arrivals = [t.at for t in turns]
    minutes = int(math.ceil((arrivals[-1] + 1e-9) / minute_s)) if arrivals else 0
    lo_idx = 0
    for m in range(minutes):
        hi_idx = lo_idx
        while hi_idx < len(arrivals) and arrivals[hi_idx] < (m + 1) * minute_s:
            hi_idx += 1
        best = _search_minute(sim, m, lo_idx, hi_idx, max_workers, slo_s, q, minute_s, lookahead_s)
        sim.policy.counts[m] = best  # type: ignore[attr-defined]
        if m == 0:
            sim = Simulator(turns, replace(schedule, counts={0: best}), config)
        sim.run_until((m + 1) * minute_s)
        lo_idx = hi_idx
    return sim.policy  # type: ignore[return-value]


def _search_minute(sim: Simulator, m: int, first: int, last: int, max_workers: int, slo_s: float,
                   q: float, minute_s: float, lookahead_s: float) -> int:
    if first == last:
        return 1
    lo, hi = 1, max_workers
    until = (m + 1) * minute_s + lookahead_s
    while lo < hi:
        mid = (lo + hi) // 2
        trial = _trial(sim, m, mid)
        if _minute_ok(trial, first, last, until, slo_s, q):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _trial(sim: Simulator, m: int, count: int) -> Simulator:
    trial = sim.fork()
    trial.policy.counts[m] = count  # type: ignore[attr-defined]
    if m == 0:  # the first minute's workers are there from the start
        trial = Simulator(sim.turns, replace(cast(Schedule, sim.policy), counts={0: count}), sim.cfg)
    return trial
