"""The comparison behind ``scripts/bench_trace`` and ``scripts/bench_scaling``: one trace's turns
under Fleet's ``decide()`` and the baselines (static, HPA-like, KEDA-like) and the oracle, all in
the simulator, with each run's worker-seconds as a ratio of the oracle's; and the frontier: the
same policies over a range of their settings, cost (worker-seconds / oracle) against misses
(% of waits over the SLO).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from protocol.policy import TurnsPolicy, turns_policy
from sim.scaling.policies import (
    FleetDecide,
    Static,
    hpa_like,
    keda_like,
    oracle_schedule,
    peak_static_workers,
)
from sim.scaling.simulate import SimConfig, SimPolicy, SimResult, simulate
from sim.scaling.trace import TraceTurn

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Setup:
    """How the tier runs in every policy's simulation, and what the oracle aims at."""

    policy: TurnsPolicy = field(default_factory=lambda: TurnsPolicy(handler="sleep"))
    spawn_delay_s: float = 0.1
    slo_s: float = 1.0
    oracle_quantile: float = 99.0
    oracle_step_s: float = 60.0
    epoch: float = 0.0
    hpa_target: float = 0.7
    keda_per_replica: float | None = None  # None: 0.75 x concurrency

    @property
    def concurrency(self) -> int:
        return self.policy.concurrency

    @property
    def max_workers(self) -> int:
        return self.policy.max_workers

    def config(self, policy: TurnsPolicy | None = None) -> SimConfig:
        """The simulator's settings; ``policy`` feeds the snapshot (report interval, window)."""
        return SimConfig(concurrency=self.concurrency, spawn_delay_s=self.spawn_delay_s,
                         view_policy=policy or self.policy, slo_s=self.slo_s, epoch=self.epoch)


def fleet_policy(concurrency: int = 8, max_workers: int = 32, **fields: Any) -> TurnsPolicy:
    """The default policy with what a user of the benchmark sets: the sleep handler, the
    concurrency, max_workers, and any field of a policy file (by any name ``resolve`` takes)."""
    return turns_policy(handler="sleep", concurrency=concurrency, max_workers=max_workers, **fields)


def keda_target(setup: Setup) -> float:
    """The KEDA-like policy's backlog per replica."""
    return setup.keda_per_replica or 0.75 * setup.concurrency


def policies(turns: Sequence[TraceTurn], setup: Setup) -> list[SimPolicy]:
    """Fleet's decide() and the baselines, as run in the comparison (the oracle apart)."""
    peak = peak_static_workers(turns, setup.concurrency)
    return [FleetDecide(setup.policy, epoch=setup.epoch),
            Static(peak, name=f"static (peak: {peak})"),
            hpa_like(max_replicas=setup.max_workers, target_utilization=setup.hpa_target),
            keda_like(max_replicas=setup.max_workers, target_per_replica=keda_target(setup))]


def oracle_run(turns: Sequence[TraceTurn], setup: Setup) -> SimResult:
    """The oracle's schedule found by search, then run (no spawn delay, like its search)."""
    started = time.perf_counter()
    cfg = setup.config()
    schedule = oracle_schedule(turns, cfg, setup.max_workers, setup.slo_s, setup.oracle_quantile,
                               setup.oracle_step_s)
    search_s = time.perf_counter() - started
    result = simulate(turns, schedule, replace(cfg, spawn_delay_s=0.0))
    result.runtime_s += search_s
    return result


def compare(turns: Sequence[TraceTurn], setup: Setup, log: Log = _stderr) -> dict[str, SimResult]:
    """Every policy of the comparison on ``turns``, by name (the oracle last)."""
    runs: dict[str, SimResult] = {}
    for pol in policies(turns, setup):
        view = pol.policy if isinstance(pol, FleetDecide) else setup.policy
        runs[pol.name] = simulate(turns, pol, setup.config(view))
        log(f"  simulated {pol.name}: {runs[pol.name].runtime_s:.2f} s")
    runs["oracle"] = oracle_run(turns, setup)
    log(f"  oracle: search + run {runs['oracle'].runtime_s:.2f} s")
    return runs


def rows(runs: dict[str, SimResult]) -> list[dict[str, Any]]:
    """Each run's summary with ``oracle_ratio``: its worker-seconds over the oracle's."""
    base = runs["oracle"].worker_seconds if "oracle" in runs else 0.0
    out = []
    for result in runs.values():
        row: dict[str, Any] = result.summary()
        row["oracle_ratio"] = round(result.worker_seconds / base, 2) if base > 0 else None
        out.append(row)
    return out


# --- the frontier ------------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One policy at one setting: its cost and its misses."""

    family: str  # fleet, hpa, keda, static
    setting: str
    oracle_ratio: float
    slo_violation_pct: float
    p99_wait_s: float
    scale_events: int
    default: bool = False  # the setting of the comparison


def fleet_variants(setup: Setup) -> list[tuple[str, TurnsPolicy]]:
    """Fleet's policy over its cost/churn knobs: the scale-in hold (fixed or derived) and the
    ledger's compaction margin (the hysteresis between a scale-up and a compaction)."""
    base = setup.policy
    fixed = base.scaling.scale_down_stabilization_s
    out = [("derived hold" if fixed is None else f"hold {fixed:g} s", base)]
    for hold in (0.0, 60.0, 300.0):
        if hold != fixed:
            out.append((f"hold {hold:g} s", turns_policy(base, scale_down_stabilization_s=hold)))
    for margin in (2.0, 2.5):
        if margin != base.scaling.occupancy.compaction_margin:
            out.append((f"margin {margin:g}", turns_policy(base, compaction_margin=margin)))
    return out


def _variants(turns: Sequence[TraceTurn],
              setup: Setup) -> Iterable[tuple[str, str, SimPolicy, TurnsPolicy, bool]]:
    for i, (label, pol) in enumerate(fleet_variants(setup)):
        yield "fleet", label, FleetDecide(pol, epoch=setup.epoch), pol, i == 0
    for target in (0.5, 0.6, 0.7, 0.8, 0.9):
        hpa = hpa_like(max_replicas=setup.max_workers, target_utilization=target)
        yield "hpa", f"target {target:g}", hpa, setup.policy, target == setup.hpa_target
    k = keda_target(setup)
    for factor in (0.25, 0.5, 1.0, 2.0):
        yield ("keda", f"{k * factor:g}/replica",
               keda_like(max_replicas=setup.max_workers, target_per_replica=k * factor), setup.policy,
               factor == 1.0)
    peak = peak_static_workers(turns, setup.concurrency)
    for count in sorted({max(1, round(peak * f)) for f in (0.6, 0.8, 1.0)}):
        yield "static", f"{count} workers", Static(count), setup.policy, count == peak


def frontier(turns: Sequence[TraceTurn], setup: Setup, oracle_ws: float,
             log: Log = _stderr) -> list[Point]:
    """Every policy family over its settings (``fleet_variants``, HPA targets, KEDA backlog
    targets, static counts), each a point of cost vs misses."""
    points = []
    for family, setting, pol, view, default in _variants(turns, setup):
        s = simulate(turns, pol, setup.config(view)).summary()
        points.append(Point(family, setting, round(float(s["worker_seconds"]) / oracle_ws, 3),
                            float(s["slo_violation_pct"]), float(s["p99_wait_s"]),
                            int(s["scale_events"]), default))
        log(f"  frontier {family} {setting}: x{points[-1].oracle_ratio:.2f}, "
            f"{points[-1].slo_violation_pct:g} % over SLO")
    return points
