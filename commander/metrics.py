"""The commander's Prometheus metrics: one registry per ``Metrics``, served on demand.

The commander calls the ``observe_*`` methods once per pass and ``scale_event`` per action;
``serve`` exposes ``/metrics`` (Prometheus text format) and ``/healthz`` from a thread of its own:
the commander's aiohttp server (``commander.monitor.server``), which also serves the monitor.
Nothing here touches the process-wide default registry, so several commanders (or tests) in
one process never collide.

Metric names (every one prefixed ``fleet_``):

=====================================  =========  ===============  ===========================
name                                   type       labels           meaning
=====================================  =========  ===============  ===========================
fleet_tier_desired_workers             gauge      tier             decide's desired count (clamped)
fleet_tier_target_workers              gauge      tier             the stabilized scale-in target
fleet_tier_running_workers             gauge      tier             ready workers (as the commander counts)
fleet_tier_starting_workers            gauge      tier             workers started, not serving yet
fleet_tier_draining_workers            gauge      tier             workers draining (not capacity)
fleet_tier_busy_workers                gauge      tier             workers' worth of busy slots
fleet_tier_busy_slots                  gauge      tier             Σ busy handler slots
fleet_tier_slots                       gauge      tier             Σ handler slots
fleet_tier_backlog                     gauge      tier             turns no worker started
fleet_tier_active_users                gauge      tier             users active in the window
fleet_tier_pressure_events_total       counter    tier             pressure events (commander's total)
fleet_worker_occupancy                 gauge      tier, worker     the evaluator's occupancy (0..)
fleet_worker_busy_slots                gauge      tier, worker     busy handler slots
fleet_scale_events_total               counter    tier, direction  scale actions, direction up|down
fleet_takeovers_total                  counter    tier             dead workers whose users were taken over
fleet_takeover_users_total             counter    tier             users handed on by those takeovers
fleet_decide_seconds                   histogram  -                duration of one decide pass
fleet_commander_is_leader              gauge      -                1 while this commander leads
fleet_unproven_processes_total         counter    -                processes left alone: no spawn proof
fleet_commander_redis_errors_total     counter    kind             errors Redis answered this commander
fleet_worker_redis_errors_total        counter    tier, kind       errors Redis answered the tier's workers
fleet_policy_rejected                  gauge      tier             1 while the tier's policy key is rejected
fleet_state_errors_total               counter    kind             bad entries of shared state met and skipped
fleet_turns_total                      counter    tier, result     turns committed: ok|error|dup|stale
fleet_turn_retries_total               counter    tier             handler calls of an attempt after the first
fleet_dead_letters_total               counter    tier             entries written to the dead letters
fleet_fenced_total                     counter    tier             lanes lost to another worker (fencing)
fleet_delivery_limit_total             counter    tier             poison notifications dead-lettered
fleet_turn_queue_wait_seconds          histogram  tier             submit -> first attempt's handler start
fleet_turn_handler_seconds             histogram  tier             each handler call
fleet_turn_latency_seconds             histogram  tier             submit -> commit of the reply
=====================================  =========  ===============  ===========================

``fleet_tier_busy_workers`` is Σ busy/total over ready workers with a fresh report: whole
workers' worth of busy slots, the measure the warm-buffer proposal uses (three workers with
one of four slots busy each read 0.75, not 3). Unreported workers are not counted in it.

The turn metrics (``fleet_turns_total`` to ``fleet_turn_latency_seconds``) come from the
counts each worker carries in its occupancy reports, added up per tier by the commander so
that they never go down as workers come and go (``commander.turn_metrics`` says how, and why
reports rather than scraping the workers). The histograms' buckets are
``protocol.metrics_buckets.TURN_BUCKETS``. Results: ``ok`` answered; ``error`` answered with an
error and dead-lettered; ``dup`` found answered before (a redelivery); ``stale`` a commit that
found the entry already committed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from commander.decide import Plan
from commander.monitor.access import Access
from commander.snapshot import TierSnapshot, WorkerView
from commander.turn_metrics import TurnCollector
from protocol.models import RedisErrorKind, TurnStats

if TYPE_CHECKING:
    from commander.monitor.server import MonitorServer

log = logging.getLogger(__name__)

Direction = Literal["up", "down"]
DECIDE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _PressureTotals(Collector):
    """Exposes the commander's own running total of pressure events per tier, as a counter.

    The commander counts them (it consumes the pressure streams); a value that goes down is a
    restart of that count, which Prometheus' ``rate()`` reads as a counter reset.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, int] = {}

    def set(self, tier: str, total: int) -> None:
        with self._lock:
            self._totals[tier] = max(0, int(total))

    def remove(self, tier: str) -> None:
        with self._lock:
            self._totals.pop(tier, None)

    def value(self, tier: str) -> int | None:
        with self._lock:
            return self._totals.get(tier)

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily("fleet_tier_pressure_events", "Pressure events seen by the commander.",
                                     labels=["tier"])
        with self._lock:
            totals = sorted(self._totals.items())
        for tier, total in totals:
            family.add_metric([tier], total)
        yield family


def busy_workers(workers: Iterable[WorkerView]) -> float:
    """Σ busy/total over ready, freshly reported workers with slots: workers' worth of busy slots."""
    return sum(w.busy / w.total for w in workers if w.state == "ready" and w.fresh and w.total > 0)


class Metrics:
    """The commander's metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.address = ""  # ``host:port`` of /metrics once it serves (shown in fleet:commanders)
        self.registry = CollectorRegistry()
        reg = self.registry

        def tier_gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["tier"], registry=reg)

        self.desired = tier_gauge("fleet_tier_desired_workers", "Desired workers (clamped) of the last pass.")
        self.target = tier_gauge("fleet_tier_target_workers", "Stabilized scale-in target of the last pass.")
        self.running = tier_gauge("fleet_tier_running_workers", "Ready workers.")
        self.starting = tier_gauge("fleet_tier_starting_workers", "Workers started that do not serve yet.")
        self.draining = tier_gauge("fleet_tier_draining_workers", "Workers draining.")
        self.busy_workers = tier_gauge("fleet_tier_busy_workers",
                                       "Workers' worth of busy slots: sum of busy/total, fresh ready ones.")
        self.busy_slots = tier_gauge("fleet_tier_busy_slots", "Busy handler slots.")
        self.slots = tier_gauge("fleet_tier_slots", "Handler slots.")
        self.backlog = tier_gauge("fleet_tier_backlog", "Notifications no worker has started: "
                                  "ready-stream lag plus pending ones no live worker holds.")
        self.active_users = tier_gauge("fleet_tier_active_users", "Users active in the policy's window.")
        self.policy_rejected_gauge = tier_gauge("fleet_policy_rejected",
                                                "1 while the tier's policy key is rejected.")
        self.pressure = _PressureTotals()
        reg.register(self.pressure)
        self.worker_occupancy = Gauge("fleet_worker_occupancy", "Occupancy: max of the averaged components.",
                                      ["tier", "worker"], registry=reg)
        self.worker_busy_slots = Gauge("fleet_worker_busy_slots", "Worker's busy handler slots.",
                                       ["tier", "worker"], registry=reg)
        self.scale_events = Counter("fleet_scale_events", "Scale actions taken.", ["tier", "direction"],
                                    registry=reg)
        self.takeovers = Counter("fleet_takeovers", "Dead workers whose pending users were taken over.",
                                 ["tier"], registry=reg)
        self.takeover_users = Counter("fleet_takeover_users", "Users handed on by takeovers of dead workers.",
                                      ["tier"], registry=reg)
        self.decide_hist = Histogram("fleet_decide_seconds", "Duration of one decide pass.",
                                     buckets=DECIDE_BUCKETS, registry=reg)
        self.leader = Gauge("fleet_commander_is_leader", "1 while this commander leads.", registry=reg)
        self.unproven = Counter("fleet_unproven_processes", "Live processes a run record or a registry "
                                "entry named that do not carry this host's spawn proof: left alone.",
                                registry=reg)
        self.redis_errors = Counter("fleet_commander_redis_errors",
                                    "Errors Redis answered this commander, by kind (stores.redis_errors): "
                                    "each logged once, backed off, retried.",
                                    ["kind"], registry=reg)
        self.state_errors = Counter("fleet_state_errors",
                                    "Bad entries of shared state this commander met and skipped, by kind "
                                    "(stores.bad_state): each warned about once, counted every time.",
                                    ["kind"], registry=reg)
        self.turns = TurnCollector()
        reg.register(self.turns)
        self._workers: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self._server: MonitorServer | None = None

    # --- what the commander calls each pass --------------------------------------------
    def observe_tier(self, tier: str, snapshot: TierSnapshot, plan: Plan, running: int, starting: int,
                     pressure_total: int) -> None:
        """Record one tier's pass: the plan's counts, the snapshot's signals, the pressure total.

        ``pressure_total`` is the commander's running count of the tier's pressure events.
        """
        self.desired.labels(tier).set(plan.desired)
        self.target.labels(tier).set(plan.target)
        self.running.labels(tier).set(running)
        self.starting.labels(tier).set(starting)
        self.draining.labels(tier).set(sum(1 for w in snapshot.workers if w.state == "draining"))
        self.busy_workers.labels(tier).set(busy_workers(snapshot.workers))
        self.busy_slots.labels(tier).set(sum(w.busy for w in snapshot.workers))
        self.slots.labels(tier).set(sum(w.total for w in snapshot.workers))
        self.backlog.labels(tier).set(snapshot.backlog)
        self.active_users.labels(tier).set(snapshot.active_users)
        self.pressure.set(tier, pressure_total)

    def observe_workers(self, tier: str, views: Iterable[WorkerView]) -> None:
        """Set each worker's gauges, and remove the series of the tier's workers that are gone."""
        views = list(views)
        seen = {v.id for v in views}
        for v in views:
            self.worker_occupancy.labels(tier, v.id).set(v.occupancy)
            self.worker_busy_slots.labels(tier, v.id).set(v.busy)
        with self._lock:
            gone = self._workers.get(tier, set()) - seen
            self._workers[tier] = seen
        for worker in gone:
            self._remove_worker(tier, worker)

    def observe_turns(self, tier: str, totals: TurnStats) -> None:
        """Set a tier's turn totals (``commander.turn_metrics.TurnTotals``: never decreasing)."""
        self.turns.set(tier, totals)

    def scale_event(self, tier: str, direction: Direction) -> None:
        """Count one scale action of a tier (``up`` or ``down``)."""
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', not {direction!r}")
        self.scale_events.labels(tier, direction).inc()

    def takeover(self, tier: str, users: int) -> None:
        """Count one takeover of a dead worker of a tier and the users it handed on."""
        self.takeovers.labels(tier).inc()
        self.takeover_users.labels(tier).inc(max(0, users))

    def decide_seconds(self, seconds: float) -> None:
        """Record the duration of one decide pass."""
        self.decide_hist.observe(seconds)

    def is_leader(self, leading: bool) -> None:
        """Whether this commander is the leader now."""
        self.leader.set(1 if leading else 0)

    def unproven_process(self) -> None:
        """Count a process adoption left alone: it could not be proven ours."""
        self.unproven.inc()

    def redis_error(self, kind: RedisErrorKind) -> None:
        """One error Redis answered this commander (its loop, or its monitor's reads)."""
        self.redis_errors.labels(kind).inc()

    def state_error(self, kind: str) -> None:
        """One bad entry of shared state met (``stores.bad_state.BadKind``), or a pass that raised."""
        self.state_errors.labels(kind).inc()

    def policy_rejected(self, tier: str, rejected: bool) -> None:
        """Whether the tier's policy key is currently rejected (the last good one runs)."""
        self.policy_rejected_gauge.labels(tier).set(1 if rejected else 0)

    def forget_tier(self, tier: str) -> None:
        """Remove every series of a tier that no longer exists."""
        for gauge in (self.desired, self.target, self.running, self.starting, self.draining,
                      self.busy_workers, self.busy_slots, self.slots, self.backlog, self.active_users,
                      self.policy_rejected_gauge):
            _remove(gauge, tier)
        for direction in ("up", "down"):
            _remove(self.scale_events, tier, direction)
        _remove(self.takeovers, tier)
        _remove(self.takeover_users, tier)
        self.pressure.remove(tier)
        self.turns.remove(tier)
        with self._lock:
            gone = self._workers.pop(tier, set())
        for worker in gone:
            self._remove_worker(tier, worker)

    def _remove_worker(self, tier: str, worker: str) -> None:
        _remove(self.worker_occupancy, tier, worker)
        _remove(self.worker_busy_slots, tier, worker)

    # --- exposition --------------------------------------------------------------------
    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return _generate_latest(self.registry)

    def serve(self, host: str = "127.0.0.1", port: int = 0, access: Access | None = None,
              monitor: Any | None = None) -> tuple[str, int]:
        """Serve ``/metrics`` and ``/healthz`` (and, given a ``commander.monitor.api.Monitor``, the
        monitor page and its API) from a thread of its own; returns the bound (host, port).

        ``access``: the tokens and the allowed hosts (none: loopback only, open to loopback names).
        """
        from commander.monitor.server import serve  # (aiohttp: only a process that serves loads it)

        if self._server is not None:
            raise RuntimeError("metrics are already served")
        self._server, bound = serve(self, monitor, host, port, access or Access())
        self.address = f"{bound[0]}:{bound[1]}"
        return bound

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()


def _remove(metric: Gauge | Counter, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set: nothing to remove
        metric.remove(*labels)


def sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample's value from the registry (for tests and the monitor); None when absent."""
    return metrics.registry.get_sample_value(name, labels or {})


def series(metrics: Metrics, name: str) -> Iterator[dict[str, str]]:
    """The label sets present for a sample name."""
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                yield dict(s.labels)
