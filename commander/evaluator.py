"""The evaluator: raw worker reports in, occupancy and rates out (what ``decide`` and the monitor read).

Per worker it keeps a window of the last ``WINDOW_ROWS`` reports. Per row: ``cpu = min(cpu, 1)``,
``memory = rss / memory_limit`` (only when a limit is set), ``slots = busy / total``. Each
component is averaged over the last ``AVERAGE_ROWS`` rows, and occupancy is the **max** of the
averages: the bottleneck answers "can it take more?". A worker with no rows reads 0.

What occupancy and rates read of a report is derived once, when the report is kept (a
:class:`Row`, beside the report): a commander asks for every worker's occupancy and rates each
pass, and a pass over 10,000 workers cannot afford to walk their reports again.

Pure: no clock, no I/O. Time comes in only through ``report.ts`` or a ``now`` argument.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from protocol.models import OccupancyReport
from protocol.policy import ScaleRules

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


@dataclass(frozen=True, slots=True)
class Row:
    """What occupancy and rates read of one report (rows of a worker in time order): its
    components but memory (which depends on the policy's limit: ``rss`` is kept), its counters,
    and the number ``n`` of this row and ``segment`` of the first row since its counters last
    went down (a rate never spans a reset)."""

    ts: float
    cpu: float | None
    rss: int
    slots: float | None
    turns: int
    errors: int
    handler_seconds: float
    n: int
    segment: int


@dataclass(frozen=True, slots=True)
class HistoryPoint:
    """One report as the monitor draws it: the row's own components, not averaged."""

    ts: float
    state: str
    occupancy: float
    cpu: float | None
    memory: float | None
    slots: float | None
    busy: int
    total: int
    users: int
    active_users: int


def memory_limit_bytes(policy: ScaleRules) -> float | None:
    """The policy's memory limit in bytes, or None when memory is not a component."""
    limit_mb = policy.scaling.occupancy.memory_limit_mb
    return None if limit_mb is None else limit_mb * _MB


def row_cpu(report: OccupancyReport) -> float | None:
    """cpu capped to one core's worth; None on a worker's first report."""
    if report.cpu is None:
        return None
    return min(max(report.cpu, 0.0), 1.0)


def row_memory(report: OccupancyReport, limit_bytes: float | None) -> float | None:
    """rss as a fraction of the limit; None when no limit is set."""
    if not limit_bytes or limit_bytes <= 0:
        return None
    return report.rss / limit_bytes


def row_slots(report: OccupancyReport, previous: OccupancyReport | None = None) -> float | None:
    """Slot use of a row: given the row before it, the time-averaged use over the interval
    (handler seconds / (seconds x slots)); else busy/total at the report instant.

    A report is an instant: a worker serving short turns is often caught between two of
    them, and instants alone would call it idle. The workers count handler time as it runs
    (not when a turn ends), so the counter delta is the exact use over the interval.
    """
    total = report.slots.total
    if total <= 0:
        return None
    instant = report.slots.busy / total
    if previous is None or _counters_dropped(report, previous):
        return instant
    span = report.ts - previous.ts
    if span <= 0:
        return instant
    averaged = (report.counters.handler_seconds - previous.counters.handler_seconds) / (span * total)
    return min(averaged, 1.0)


def derive(report: OccupancyReport, previous: OccupancyReport | None = None,
           before: Row | None = None) -> Row:
    """``report``'s row, given the report before it and that report's row (None: the first)."""
    n = 0 if before is None else before.n + 1
    reset = previous is None or before is None or _counters_dropped(report, previous)
    segment = n if reset or before is None else before.segment
    c = report.counters
    return Row(report.ts, row_cpu(report), report.rss, row_slots(report, previous), c.turns, c.errors,
               c.handler_seconds, n, segment)


def rows_of(reports: Sequence[OccupancyReport]) -> list[Row]:
    """The rows of a worker's reports (oldest first)."""
    out: list[Row] = []
    for i, report in enumerate(reports):
        out.append(derive(report, reports[i - 1] if i else None, out[-1] if out else None))
    return out


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def occupancy_of(reports: Sequence[OccupancyReport], limit_bytes: float | None) -> Occupancy:
    """Average each component over the last ``AVERAGE_ROWS`` reports; occupancy is their max."""
    return occupancy_of_rows(rows_of(list(reports)[-(AVERAGE_ROWS + 1):])[-AVERAGE_ROWS:], limit_bytes)


def occupancy_of_rows(rows: Sequence[Row], limit_bytes: float | None) -> Occupancy:
    """:func:`occupancy_of` on the last ``AVERAGE_ROWS`` of ``rows``."""
    recent = list(islice(reversed(rows), AVERAGE_ROWS))  # (newest first: a mean has no order)
    if not recent:
        return Occupancy()
    cpu = _mean(r.cpu for r in recent)
    memory = None if not limit_bytes or limit_bytes <= 0 else _mean(r.rss / limit_bytes for r in recent)
    slots = _mean(r.slots for r in recent)
    parts = [p for p in (cpu, memory, slots) if p is not None]
    return Occupancy(max(parts, default=0.0), cpu, memory, slots, len(recent))


def _counters_dropped(newer: OccupancyReport, older: OccupancyReport) -> bool:
    a, b = newer.counters, older.counters
    return a.turns < b.turns or a.errors < b.errors or a.handler_seconds < b.handler_seconds


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


def history_point(report: OccupancyReport, limit_bytes: float | None) -> HistoryPoint:
    """One row's components, for the monitor's occupancy history."""
    cpu, memory, slots = row_cpu(report), row_memory(report, limit_bytes), row_slots(report)
    value = max((p for p in (cpu, memory, slots) if p is not None), default=0.0)
    return HistoryPoint(
        ts=report.ts,
        state=report.state,
        occupancy=value,
        cpu=cpu,
        memory=memory,
        slots=slots,
        busy=report.slots.busy,
        total=report.slots.total,
        users=report.users,
        active_users=report.active_users,
    )


class Evaluator:
    """Windows of recent reports per worker, and what they mean."""

    def __init__(self, window: int = WINDOW_ROWS) -> None:
        self._window = window
        self._rows: dict[str, deque[OccupancyReport]] = {}
        self._derived: dict[str, deque[Row]] = {}  # the rows' Row, in step with _rows
        self._ready_at: dict[str, float] = {}  # worker -> ts of its first report as ready

    def add(self, report: OccupancyReport) -> bool:
        """Keep a report; False (ignored) when it is not newer than the worker's last one.

        Reading the same stream entries twice (a commander restart) is therefore harmless.
        """
        rows = self._rows.get(report.worker)
        if rows is None:
            rows = self._rows[report.worker] = deque(maxlen=self._window)
            derived = self._derived[report.worker] = deque(maxlen=self._window)
        elif rows and report.ts <= rows[-1].ts:
            return False
        else:
            derived = self._derived[report.worker]
        derived.append(derive(report, rows[-1] if rows else None, derived[-1] if derived else None))
        rows.append(report)
        if report.state == "ready" and report.cpu is None:
            # a worker's very first report (its sensor has no cpu to give yet): the end of its
            # start; a later one (a commander that restarted and reads a window) says nothing
            self._ready_at.setdefault(report.worker, report.ts)
        return True

    def forget(self, worker: str) -> None:
        """Drop a worker's window (it exited or was declared dead)."""
        self._rows.pop(worker, None)
        self._derived.pop(worker, None)
        self._ready_at.pop(worker, None)

    def forget_absent(self, present: Collection[str], now: float,
                      after_s: float = FORGET_ABSENT_S) -> list[str]:
        """Drop the windows of workers not in ``present`` (the registry's and the runtime's ids)
        whose newest report is more than ``after_s`` old at ``now``: workers that ended without
        being reaped by this commander (another host's, a pod, one whose entry was removed).
        Returns the workers forgotten."""
        gone = [w for w, rows in self._rows.items()
                if w not in present and (not rows or now - rows[-1].ts > after_s)]
        for worker in gone:
            self.forget(worker)
        return gone

    def ready_at(self, worker: str) -> float | None:
        """The ``ts`` of the worker's first report as ready (its start cost ends there), or None."""
        return self._ready_at.get(worker)

    def workers(self, tier: str | None = None) -> list[str]:
        """Workers with at least one report, optionally only those of ``tier``."""
        return [w for w, rows in self._rows.items() if tier is None or rows[-1].tier == tier]

    def latest(self, worker: str) -> OccupancyReport | None:
        """The newest report of a worker, or None."""
        rows = self._rows.get(worker)
        return rows[-1] if rows else None

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
        return occupancy_of_rows(self._derived.get(worker, ()), memory_limit_bytes)

    def rates(self, worker: str, span_s: float = RATE_SPAN_S) -> Rates | None:
        """Turn, error and handler-time rates from counter deltas; None with too few rows."""
        return rates_of_rows(self._derived.get(worker, ()), span_s)

    def window(self, worker: str) -> tuple[OccupancyReport, ...]:
        """The worker's window of reports (oldest first), as an immutable copy."""
        return tuple(self._rows.get(worker, ()))

    def history(self, worker: str, memory_limit_bytes: float | None = None) -> list[HistoryPoint]:
        """Per-row history (oldest first) for the monitor."""
        return [history_point(r, memory_limit_bytes) for r in self._rows.get(worker, ())]
