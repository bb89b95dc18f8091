"""Turn metrics from the workers' reports: per-worker counts since start -> tier counters.

Each worker's occupancy report carries its turn counts since it started
(``protocol.models.TurnStats``; counted by ``worker.tally``). Why reports and not the workers'
own ``/metrics``: workers are short-lived and stateless, started on loopback by the process
runtime (pods come and go on Kubernetes), so a scraper may never reach them or lose a
worker's last counts when it exits; the commander reads every report anyway, at no extra
round trip. The cost: the counts are as fresh as the last report (``report_interval_s``).

A tier's counter must not go down when one of its workers exits, so the commander keeps the
last counts it saw per worker and adds the increase of each new report to the tier's total:

- a worker seen for the first time adds its whole count (it started counting at zero);
- a worker gone keeps what it contributed; a worker restarted under a new id is a new one;
- a report whose counts are below the last seen (the same id counting afresh: a restart)
  adds its whole count, as a fresh start;
- a report not newer than the last seen of its worker adds nothing (read twice).

A commander that starts (or is elected) starts its totals from the counts in the reports it
reads then: Prometheus sees its counters reset, as for any restarted process.

``TurnTotals`` does that bookkeeping (no clock, no I/O: table-tested); ``TurnCollector``
exposes the totals as Prometheus counters and histograms (``commander.metrics`` registers it).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.metrics_buckets import BUCKET_COUNT, TURN_BUCKETS
from protocol.models import (
    TURN_COUNTERS,
    TURN_HISTOGRAMS,
    TURN_RESULTS,
    OccupancyReport,
    RedisErrorKind,
    TurnHistogram,
    TurnStats,
)

FORGET_AFTER_S = 3600.0  # a worker unreported this long (by report time) is forgotten: gone
EMPTY = TurnStats()
_SCALARS = (*TURN_RESULTS, *TURN_COUNTERS)
_NO_COUNTS = (0,) * BUCKET_COUNT

# The arithmetic runs on a flat vector of a TurnStats' numbers: its scalars, then per histogram
# its bucket counts and its sum (no counts: zeros). A commander folds one report per worker per
# second into its tier's total; done on pydantic models, that took a second per pass at 10,000
# workers (scripts/bench_commander). The Redis error counts ride beside it, as a dict.
Vector = tuple[float, ...]
Errors = dict[RedisErrorKind, int]


def _vector(s: TurnStats) -> Vector:
    out: list[float] = [getattr(s, f) for f in _SCALARS]
    for f in TURN_HISTOGRAMS:
        h = getattr(s, f)
        out += h.counts or _NO_COUNTS
        out.append(h.sum)
    return tuple(out)


def _stats(v: Vector, redis_errors: Errors) -> TurnStats:
    """The TurnStats of a vector (a histogram of no observations: empty)."""
    n = len(_SCALARS)
    body: dict[str, Any] = {f: int(x) for f, x in zip(_SCALARS, v[:n], strict=True)}
    for k, f in enumerate(TURN_HISTOGRAMS):
        at = n + k * (BUCKET_COUNT + 1)
        counts = tuple(int(x) for x in v[at:at + BUCKET_COUNT])
        body[f] = TurnHistogram.model_construct(counts=counts, sum=max(0.0, v[at + BUCKET_COUNT])) \
            if any(counts) else TurnHistogram()
    body["redis_errors"] = redis_errors
    return TurnStats.model_construct(**body)  # (sums and differences of valid counts)


def _errors(a: Errors, b: Errors, sign: int) -> Errors:
    if not b:
        return a
    both = {k: a.get(k, 0) + sign * b.get(k, 0) for k in {**a, **b}}
    return {k: n for k, n in both.items() if n}


def _went_down(last: Vector, last_errors: Errors, new: Vector, new_errors: Errors) -> bool:
    return any(map(operator.lt, new, last)) or any(new_errors.get(k, 0) < n for k, n in last_errors.items())


def went_down(last: TurnStats, new: TurnStats) -> bool:
    """Whether any count of ``new`` is below ``last``'s: the worker started counting afresh."""
    return _went_down(_vector(last), last.redis_errors, _vector(new), new.redis_errors)


def combine(a: TurnStats, b: TurnStats, sign: int = 1) -> TurnStats:
    """``a + b`` (or ``a - b`` with ``sign=-1``, for ``b`` no greater than ``a``), field by field."""
    op = operator.add if sign > 0 else operator.sub
    return _stats(tuple(map(op, _vector(a), _vector(b))), _errors(a.redis_errors, b.redis_errors, sign))


def _step(last: tuple[Vector, Errors] | None, new: Vector, new_errors: Errors) -> tuple[Vector, Errors]:
    """What a worker's newest counts add to its tier's total since ``last`` (None: first seen):
    the whole count when first seen or counting afresh, else the increase."""
    if last is None or _went_down(*last, new, new_errors):
        return new, new_errors
    return tuple(map(operator.sub, new, last[0])), _errors(new_errors, last[1], -1)


def delta(last: TurnStats | None, new: TurnStats) -> TurnStats:
    """:func:`_step` on TurnStats."""
    before = None if last is None else (_vector(last), last.redis_errors)
    return _stats(*_step(before, _vector(new), new.redis_errors))


class TurnTotals:
    """The tiers' turn totals, and the last counts seen per worker (for the deltas)."""

    def __init__(self, forget_after_s: float = FORGET_AFTER_S) -> None:
        self.forget_after_s = forget_after_s
        # worker -> (report ts, its counts, its Redis error counts)
        self._seen: dict[str, tuple[float, Vector, Errors]] = {}
        self._totals: dict[str, tuple[Vector, Errors]] = {}  # tier -> Σ deltas
        self._as_stats: dict[str, TurnStats] = {}  # tier -> its totals as TurnStats, once asked
        self._pruned_at: float | None = None

    def add(self, report: OccupancyReport) -> bool:
        """Add a report's increase to its tier; False (nothing added) if not newer than the
        worker's last one."""
        seen = self._seen.get(report.worker)
        if seen is not None and report.ts <= seen[0]:
            return False
        stats = report.turn_stats
        new, errors = _vector(stats), dict(stats.redis_errors)
        step, step_errors = _step(None if seen is None else seen[1:], new, errors)
        self._seen[report.worker] = (report.ts, new, errors)
        total = self._totals.get(report.tier)
        if total is None or any(step) or step_errors:  # (an idle worker's report adds nothing)
            self._totals[report.tier] = (step, step_errors) if total is None else \
                (tuple(map(operator.add, total[0], step)), _errors(total[1], step_errors, 1))
            self._as_stats.pop(report.tier, None)
        self._prune(report.ts)
        return True

    def tier(self, tier: str) -> TurnStats:
        """A tier's totals (zeros before any report of it)."""
        if tier not in self._as_stats:
            total = self._totals.get(tier)
            self._as_stats[tier] = EMPTY if total is None else _stats(*total)
        return self._as_stats[tier]

    def workers(self) -> list[str]:
        """The workers whose last counts are kept."""
        return sorted(self._seen)

    def _prune(self, now: float) -> None:
        """Forget the last counts of workers not reported for ``forget_after_s`` (their
        contribution stays in the totals), looking once per tenth of that."""
        if self._pruned_at is not None and now - self._pruned_at < self.forget_after_s / 10:
            return
        self._pruned_at = now
        horizon = now - self.forget_after_s
        self._seen = {w: s for w, s in self._seen.items() if s[0] >= horizon}


_COUNTERS = (  # (metric, TurnStats field, help)
    ("fleet_turn_retries", "retries", "Handler calls of a turn's attempt after the first."),
    ("fleet_dead_letters", "dead_letters", "Entries the tier's workers wrote to its dead letters."),
    ("fleet_fenced", "fenced", "Lanes the tier's workers lost to another (a fenced write or a lost lease)."),
    ("fleet_delivery_limit", "delivery_limit", "Notifications dead-lettered and acked at max_deliveries."),
)
_HISTOGRAMS = (
    ("fleet_turn_queue_wait_seconds", "queue_wait", "Submit to the handler start of a turn's first attempt."),
    ("fleet_turn_handler_seconds", "handler", "Duration of each handler call."),
    ("fleet_turn_latency_seconds", "latency", "Submit to the commit of the turn's reply (end to end)."),
)
_LE = (*(repr(float(b)) for b in TURN_BUCKETS), "+Inf")  # as prometheus_client writes them


def _buckets(h: TurnHistogram) -> list[tuple[str, float]]:
    """Prometheus' cumulative ``le`` buckets from per-bucket counts."""
    out, running = [], 0
    for le, n in zip(_LE, h.counts or _NO_COUNTS, strict=True):
        running += n
        out.append((le, float(running)))
    return out


class TurnCollector(Collector):
    """Exposes each tier's turn totals: counters, and histograms with the summed buckets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # set by the commander's pass, read by the scrape
        self._tiers: dict[str, TurnStats] = {}

    def set(self, tier: str, stats: TurnStats) -> None:
        with self._lock:
            self._tiers[tier] = stats

    def remove(self, tier: str) -> None:
        with self._lock:
            self._tiers.pop(tier, None)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            tiers = sorted(self._tiers.items())
        turns = CounterMetricFamily("fleet_turns", "Turns the tier's workers committed, by result: ok, "
                                    "error (dead-lettered), dup (answered before), stale (committed before), "
                                    "expired (reached after its deadline), cancelled (stopped by its user).",
                                    labels=["tier", "result"])
        for tier, stats in tiers:
            for result in TURN_RESULTS:
                turns.add_metric([tier, result], getattr(stats, result))
        yield turns
        for name, field, doc in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, stats in tiers:
                family.add_metric([tier], getattr(stats, field))
            yield family
        errors = CounterMetricFamily("fleet_worker_redis_errors", "Errors Redis answered the tier's workers, "
                                     "by kind (stores.redis_errors): each logged once, backed off, retried.",
                                     labels=["tier", "kind"])
        for tier, stats in tiers:
            for kind, n in sorted(stats.redis_errors.items()):
                errors.add_metric([tier, kind], n)
        yield errors
        for name, field, doc in _HISTOGRAMS:
            hist = HistogramMetricFamily(name, doc, labels=["tier"])
            for tier, stats in tiers:
                h = getattr(stats, field)
                hist.add_metric([tier], _buckets(h), sum_value=h.sum)
            yield hist
