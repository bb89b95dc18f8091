"""The evaluator: raw worker reports in, occupancy and rates out (what ``decide`` and the monitor read).

Per worker it keeps a window of the last ``WINDOW_ROWS`` rows, one per report. Per row: ``cpu = min(cpu, 1)``,
``memory = rss / memory_limit`` (only when a limit is set), ``slots = busy / total``. Each
component is averaged over the last ``AVERAGE_ROWS`` rows, and occupancy is the **max** of the
averages: the bottleneck answers "can it take more?". A worker with no rows reads 0.

What occupancy, rates and the monitor read of a report is derived once, as it arrives (a
:class:`Row`), and only the worker's newest report is kept whole: a commander asks for every
worker's occupancy and rates each pass, and at 10,000 workers it can neither walk their reports
again nor hold a minute of them (several kB each, decoded).

Pure: no clock, no I/O. Time comes in only through ``report.ts`` or a ``now`` argument.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from protocol.models import OccupancyReport
from protocol.policy import ScaleRules

A = TypeVar("A")  # what a kept value was computed with (a limit, a span)
V = TypeVar("V")
WINDOW_ROWS = 60
AVERAGE_ROWS = 6
RATE_SPAN_S = 60.0
# a worker neither registered nor run by the commander, unreported this long, is forgotten
FORGET_ABSENT_S = 600.0
_MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Occupancy:
    """A worker's occupancy: ``value`` is the max of the averaged components (None = absent)."""

    value: float = 0.0
    cpu: float | None = None
    memory: float | None = None
    slots: float | None = None
    rows: int = 0


@dataclass(frozen=True, slots=True)
class Rates:
    """Counter deltas per second between two rows ``span_s`` apart."""

    turns_per_s: float
    errors_per_s: float
    handler_busy: float  # handler seconds per second: ~ busy slots on average
    span_s: float


class Row(NamedTuple):
    """What occupancy, rates and the monitor read of one report (rows of a worker in time
    order): its components but memory (which depends on the policy's limit: ``rss`` is kept),
    the slots in use at the report's instant (the monitor's history), its counters, its users,
    and the number ``n`` of this row and ``segment`` of the first row since its counters last
    went down (a rate never spans a reset). A tuple of plain numbers: a minute of rows for each
    of 10,000 workers is 600,000 of them, which the garbage collector need not track."""

    ts: float
    cpu: float | None
    rss: int
    slots: float | None  # the slot use over the interval since the row before (row_slots)
    instant: float | None  # busy / total at the report's instant
    turns: int
    errors: int
    handler_seconds: float
    users: int
    active_users: int
    n: int
    segment: int


def memory_limit_bytes(policy: ScaleRules) -> float | None:
    """The policy's memory limit in bytes, or None when memory is not a component."""
    limit_mb = policy.scaling.occupancy.memory_limit_mb
    return None if limit_mb is None else limit_mb * _MB


def row_cpu(report: OccupancyReport) -> float | None:
    """cpu capped to one core's worth; None on a worker's first report."""
    if report.cpu is None:
        return None
    return min(max(report.cpu, 0.0), 1.0)


def row_memory(row: Row, limit_bytes: float | None) -> float | None:
    """rss as a fraction of the limit; None when no limit is set."""
    if not limit_bytes or limit_bytes <= 0:
        return None
    return row.rss / limit_bytes


def row_slots(report: OccupancyReport, before: Row | None = None) -> float | None:
    """Slot use of a report: given the row before it, the time-averaged use over the interval
    (handler seconds / (seconds x slots)); else busy/total at the report instant.

    A report is an instant: a worker serving short turns is often caught between two of
    them, and instants alone would call it idle. The workers count handler time as it runs
    (not when a turn ends), so the counter delta is the exact use over the interval.
    """
    return _slots(report, before, _instant(report))


def _instant(report: OccupancyReport) -> float | None:
    """busy / total at the report's instant (None: no slots)."""
    total = report.slots.total
    return report.slots.busy / total if total > 0 else None


def _slots(report: OccupancyReport, before: Row | None, instant: float | None) -> float | None:
    """:func:`row_slots`, given the report's ``instant``."""
    if instant is None or before is None or _counters_dropped(report, before):
        return instant
    span = report.ts - before.ts
    if span <= 0:
        return instant
    averaged = (report.counters.handler_seconds - before.handler_seconds) / (span * report.slots.total)
    return min(averaged, 1.0)


def derive(report: OccupancyReport, before: Row | None = None) -> Row:
    """``report``'s row, given the row of the report before it (None: the first)."""
    n = 0 if before is None else before.n + 1
    segment = n if before is None or _counters_dropped(report, before) else before.segment
    c, instant = report.counters, _instant(report)
    return Row(report.ts, row_cpu(report), report.rss, _slots(report, before, instant), instant,
               c.turns, c.errors, c.handler_seconds, report.users, report.active_users, n, segment)


def rows_of(reports: Sequence[OccupancyReport]) -> list[Row]:
    """The rows of a worker's reports (oldest first)."""
    out: list[Row] = []
    for report in reports:
        out.append(derive(report, out[-1] if out else None))
    return out


def occupancy_of(reports: Sequence[OccupancyReport], limit_bytes: float | None) -> Occupancy:
    """Average each component over the last ``AVERAGE_ROWS`` reports; occupancy is their max."""
    return occupancy_of_rows(rows_of(list(reports)[-(AVERAGE_ROWS + 1):])[-AVERAGE_ROWS:], limit_bytes)


def occupancy_of_rows(rows: Sequence[Row], limit_bytes: float | None) -> Occupancy:
    """:func:`occupancy_of` on the last ``AVERAGE_ROWS`` of ``rows``: each component's mean
    over the rows that have it. (One loop, no generators: a pass reads a thousand of these.)"""
    recent = rows[-AVERAGE_ROWS:]
    if not recent:
        return Occupancy()
    cpu_sum = slots_sum = memory_sum = 0.0
    cpu_n = slots_n = 0
    limit = limit_bytes if limit_bytes and limit_bytes > 0 else None
    for row in reversed(recent):  # (newest first, as ever: the same sums to the last bit)
        if row.cpu is not None:
            cpu_sum += row.cpu
            cpu_n += 1
        if row.slots is not None:
            slots_sum += row.slots
            slots_n += 1
        if limit is not None:
            memory_sum += row.rss / limit
    cpu = cpu_sum / cpu_n if cpu_n else None
    slots = slots_sum / slots_n if slots_n else None
    memory = memory_sum / len(recent) if limit is not None else None
    parts = [p for p in (cpu, memory, slots) if p is not None]
    return Occupancy(max(parts, default=0.0), cpu, memory, slots, len(recent))


def _counters_dropped(report: OccupancyReport, before: Row) -> bool:
    c = report.counters
    return c.turns < before.turns or c.errors < before.errors or c.handler_seconds < before.handler_seconds


def rates_of(reports: Sequence[OccupancyReport], span_s: float = RATE_SPAN_S) -> Rates | None:
    """Rates between the newest report and the oldest one within ``span_s`` (never across a
    reset); None with fewer than two usable reports."""
    return rates_of_rows(rows_of(reports), span_s)


def rates_of_rows(rows: Sequence[Row], span_s: float = RATE_SPAN_S) -> Rates | None:
    """:func:`rates_of` on rows (in time order)."""
    if len(rows) < 2:
        return None
    newest = rows[-1]
    first = max(newest.segment - rows[0].n, 0)  # the oldest row since the last reset
    # the oldest row with newest.ts - row.ts <= span_s (as written: the same rounding)
    at = bisect_left(rows, -span_s, first, len(rows) - 1, key=lambda r: -(newest.ts - r.ts))
    if at >= len(rows) - 1:
        return None
    older = rows[at]
    if newest.ts <= older.ts:
        return None
    dt = newest.ts - older.ts
    return Rates(
        turns_per_s=(newest.turns - older.turns) / dt,
        errors_per_s=(newest.errors - older.errors) / dt,
        handler_busy=(newest.handler_seconds - older.handler_seconds) / dt,
        span_s=dt,
    )


class Evaluator:
    """Windows of recent rows per worker, each worker's newest report, and what they mean."""

    def __init__(self, window: int = WINDOW_ROWS) -> None:
        self._window = window
        # worker -> its rows, oldest first: a tuple replaced on each add, so that a window can be
        # handed out (to the monitor's thread) without a copy
        self._rows: dict[str, tuple[Row, ...]] = {}
        self._latest: dict[str, OccupancyReport] = {}  # worker -> its newest report
        self._ready_at: dict[str, float] = {}  # worker -> ts of its first report as ready
        # what was last read of a worker's rows, until its next row: a pass asks every worker's
        # occupancy and rates, and most of them reported nothing new since the last pass
        self._occupancy: dict[str, tuple[float | None, Occupancy]] = {}  # worker -> (limit, value)
        self._rates: dict[str, tuple[float, Rates | None]] = {}  # worker -> (span, value)
        self._changed: set[str] = set()  # workers added or forgotten since the last take_changed

    def add(self, report: OccupancyReport) -> bool:
        """Keep a report's row (and the report, until a newer one); False (ignored) when it is
        not newer than the worker's last one.

        Reading the same stream entries twice (a commander restart) is therefore harmless.
        """
        worker = report.worker
        rows = self._rows.get(worker, ())
        if rows and report.ts <= rows[-1].ts:
            return False
        over = len(rows) + 1 - self._window  # rows to drop to make room
        row = derive(report, rows[-1] if rows else None)
        self._rows[worker] = (*(rows[over:] if over > 0 else rows), row)
        self._latest[worker] = report
        self._occupancy.pop(worker, None)
        self._rates.pop(worker, None)
        self._changed.add(worker)
        if report.state == "ready" and report.cpu is None:
            # a worker's very first report (its sensor has no cpu to give yet): the end of its
            # start; a later one (a commander that restarted and reads a window) says nothing
            self._ready_at.setdefault(report.worker, report.ts)
        return True

    def forget(self, worker: str) -> None:
        """Drop a worker's window (it exited or was declared dead)."""
        for kept in (self._rows, self._latest, self._ready_at, self._occupancy, self._rates):
            kept.pop(worker, None)
        self._changed.add(worker)

    def take_changed(self) -> frozenset[str]:
        """The workers whose rows, newest report or start changed (a report added, or the
        worker forgotten) since the last call: what anything derived from them must look at
        again. (One reader: the commander's pass; ``decide_inputs.ViewMemo``.)"""
        changed, self._changed = frozenset(self._changed), set()
        return changed

    def forget_absent(self, present: Collection[str], now: float,
                      after_s: float = FORGET_ABSENT_S) -> list[str]:
        """Drop the windows of workers not in ``present`` (the registry's and the runtime's ids)
        whose newest report is more than ``after_s`` old at ``now``: workers that ended without
        being reaped by this commander (another host's, a pod, one whose entry was removed).
        Returns the workers forgotten."""
        gone = [w for w, report in self._latest.items() if w not in present and now - report.ts > after_s]
        for worker in gone:
            self.forget(worker)
        return gone

    def ready_at(self, worker: str) -> float | None:
        """The ``ts`` of the worker's first report as ready (its start cost ends there), or None."""
        return self._ready_at.get(worker)

    def workers(self, tier: str | None = None) -> list[str]:
        """Workers with at least one report, optionally only those of ``tier``."""
        return [w for w, report in self._latest.items() if tier is None or report.tier == tier]

    @property
    def newest(self) -> Mapping[str, OccupancyReport]:
        """Each worker's newest report (read-only: :meth:`add` and :meth:`forget` change it)."""
        return self._latest

    def latest(self, worker: str) -> OccupancyReport | None:
        """The newest report of a worker, or None."""
        return self._latest.get(worker)

    def last_report_ts(self, worker: str) -> float | None:
        """The ``ts`` of the newest report, or None when there is none."""
        latest = self.latest(worker)
        return None if latest is None else latest.ts

    def is_fresh(self, worker: str, now: float, max_age_s: float) -> bool:
        """Whether the newest report is at most ``max_age_s`` old at ``now``."""
        ts = self.last_report_ts(worker)
        return ts is not None and now - ts <= max_age_s

    def occupancy(self, worker: str, memory_limit_bytes: float | None = None) -> Occupancy:
        """The worker's occupancy; 0 with no rows."""
        return self._kept(self._occupancy, worker, memory_limit_bytes, occupancy_of_rows)

    def rates(self, worker: str, span_s: float = RATE_SPAN_S) -> Rates | None:
        """Turn, error and handler-time rates from counter deltas; None with too few rows."""
        return self._kept(self._rates, worker, span_s, rates_of_rows)

    def _kept(self, kept: dict[str, tuple[A, V]], worker: str, arg: A,
              compute: Callable[[Sequence[Row], A], V]) -> V:
        """``compute(rows, arg)`` of the worker's rows, as kept since its last row if asked
        with the same ``arg`` (a worker with no rows: computed, not kept)."""
        hit = kept.get(worker)
        if hit is not None and hit[0] == arg:
            return hit[1]
        value = compute(self._rows.get(worker, ()), arg)
        if worker in self._rows:
            kept[worker] = (arg, value)
        return value

    def windows(self) -> dict[str, tuple[Row, ...]]:
        """Every worker's window of rows (oldest first): a copy of the mapping, the windows
        themselves shared (a window is a tuple, replaced, never changed, on each add)."""
        return dict(self._rows)

    def window(self, worker: str) -> tuple[Row, ...]:
        """The worker's window of rows (oldest first)."""
        return self._rows.get(worker, ())
