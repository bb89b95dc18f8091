"""What ``decide`` sees of a turns tier, built from what the observer read: pure, table-testable.

Missing reports are not idleness: a worker without a fresh report is marked ``fresh=False``
and ``decide`` never counts it idle nor picks it for scale-in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from commander.evaluator import Evaluator, memory_limit_bytes
from commander.runtime import Lifecycle, WorkerHandle
from commander.snapshot import TierSnapshot, ViewState, WorkerView
from protocol.models import OccupancyReport, WorkerInfo
from protocol.policy import ScaleRules

MIN_STALE_S = 2.0


@dataclass(frozen=True)
class TierSignals:
    """Per-tier quantities read from Redis this pass."""

    backlog: int = 0  # turns no worker has started (stores.backlog)
    active_users: int = 0
    pressure_events: int = 0
    held: Mapping[str, int] = field(default_factory=dict)  # live worker -> notifications of its jobs
    observed: bool = True  # False: the reads failed this pass (decide counts it toward the fallback)


def stale_after(policy: ScaleRules) -> float:
    """A report older than this no longer describes its worker: three report intervals."""
    return max(MIN_STALE_S, 3 * policy.scaling.report_interval_s)


def _state(handle: WorkerHandle | None, report_state: str | None) -> ViewState:
    if (handle and handle.state is Lifecycle.DRAINING) or report_state == "draining":
        return "draining"
    if report_state is None or report_state == "starting":
        return "starting"
    return "ready"


Made = tuple[tuple[object, ...], WorkerView]  # a view and what it was made of


@dataclass
class TierViews:
    """A tier's worker views as one pass built them, and what they were built from."""

    registry: Mapping[str, tuple[WorkerInfo, bool]]  # the tier's entries (compared by identity)
    inputs: tuple[object, ...]  # its handles (id, state, start), memory limit, staleness, trust
    at: float  # the time they were built at
    made: dict[str, Made]  # each worker's view, with what it was made of
    rates: dict[str, tuple[float, float]]  # each worker's (turns/s, handler busy) then
    stale_at: float  # no fresh view goes stale before this time
    views: tuple[WorkerView, ...]  # in worker order, the reception marked
    period: int  # the ViewMemo period (the pass) they were built or brought up to date in


class ViewMemo:
    """Each tier's worker views of the last pass, with what they were made of (:func:`worker_views`).

    A commander judges 10,000 workers every pass, and with a report every 5 s and a pass every
    0.5 s most have nothing new. Each pass begins a period with the workers the evaluator
    changed since the last (:meth:`Evaluator.take_changed`: a report added, or the worker
    forgotten). While a tier's views are of the last period, its entries (the same object),
    handles, limits and trust are those of the last pass, no fresh view has gone stale and the
    clock has not gone back, only the changed workers are built again, and their rates read
    again: a pass costs what changed, not what exists. Otherwise the tier is built whole, and
    a worker whose report (by its time), state, start, freshness and memory limit are those of
    the last pass keeps its view."""

    def __init__(self) -> None:
        self._tiers: dict[str, TierViews] = {}
        self.period = 0
        self._changed: dict[str, list[str]] = {}  # tier -> its workers changed in this period
        # worker -> the tiers whose views hold it (or held it: pruned when most are gone); tuples
        # of strings, which the garbage collector stops tracking, for 10,000 workers
        self._tiers_of: dict[str, tuple[str, ...]] = {}
        self._holding: dict[str, dict[str, tuple[WorkerView, int, WorkerView]]] = {}  # tier -> (holding)

    def begin(self, changed: Iterable[str]) -> None:
        """A new period (a pass): ``changed``, the workers changed since the last began."""
        self.period += 1
        self._changed = {}
        for wid in changed:
            for tier in self._tiers_of.get(wid, ()):
                self._changed.setdefault(tier, []).append(wid)

    def last(self, tier: str) -> TierViews | None:
        """The tier's views of the last pass, with what they were made of."""
        return self._tiers.get(tier)

    def changed(self, tier: str) -> list[str]:
        """The tier's workers changed in this period."""
        return self._changed.get(tier, [])

    def keep(self, tier: str, views: TierViews, whole: bool) -> None:
        """This pass's views of the tier, in place of the last's (``whole``: built whole, so
        their workers are indexed again)."""
        self._tiers[tier] = views
        if whole:
            for wid in views.made:
                known = self._tiers_of.get(wid, ())
                if tier not in known:
                    self._tiers_of[wid] = (*known, tier)

    def rates(self, tier: str, views: tuple[WorkerView, ...]) -> TierRates | None:
        """The tier's rates, summed from what its views carry, if they are ``views``."""
        kept = self._tiers.get(tier)
        if kept is None or kept.views is not views:
            return None
        return TierRates(math.fsum(t for t, _ in kept.rates.values()),
                         math.fsum(b for _, b in kept.rates.values()))

    def holding(self, tier: str) -> dict[str, tuple[WorkerView, int, WorkerView]]:
        """The views :func:`holding` made for the tier last (its ``kept``)."""
        return self._holding.setdefault(tier, {})

    def retain(self, tiers: Iterable[str]) -> None:
        """Forget the tiers not among ``tiers`` (no longer judged), and the workers indexed
        once more of them are in no tier's views than in some."""
        keep = set(tiers)
        self._tiers = {t: views for t, views in self._tiers.items() if t in keep}
        self._holding = {t: made for t, made in self._holding.items() if t in keep}
        if len(self._tiers_of) > 2 * sum(len(views.made) for views in self._tiers.values()) + 1000:
            held: dict[str, tuple[str, ...]] = {}
            for tier, views in self._tiers.items():
                for wid in views.made:
                    held[wid] = (*held.get(wid, ()), tier)
            self._tiers_of = held


@dataclass(frozen=True)
class _Build:
    """What every view of one tier in one pass is built with."""

    evaluator: Evaluator
    now: float
    limit: float | None
    stale_s: float
    interval_s: float
    trusted_since: float

    def view(self, wid: str, handle: WorkerHandle | None, started: float, report: OccupancyReport | None,
             last: Made | None) -> Made:
        """The worker's view (``last``'s if it is made of the same), with what it is made of."""
        if report is None:
            return (), WorkerView(id=wid, state=_state(handle, None), fresh=False, started=started)
        fresh = self.now - report.ts <= self.stale_s and report.ts - self.interval_s >= self.trusted_since
        state = _state(handle, report.state)
        # what the view is made of, as plain values: the report by its time (a worker's newest
        # report is only ever replaced by a later one), which also stands for the rows behind
        # its occupancy and ready_at. (One exception, in a tier built whole: a worker forgotten,
        # then sent a report of exactly the old time, a replayed or forged entry for an exited
        # worker, keeps the old view while that report is its newest.)
        parts = (report.ts, state, started, fresh, self.limit)
        if last is not None and last[0] == parts:
            return last
        return parts, WorkerView(
            id=wid, state=state, occupancy=self.evaluator.occupancy(wid, self.limit).value,
            busy=report.slots.busy, total=report.slots.total, lanes=report.slots.busy, fresh=fresh,
            started=started, ready_at=self.evaluator.ready_at(wid), turns=report.counters.turns,
            protected_until=report.protected_until)

    def rates(self, wid: str) -> tuple[float, float]:
        rates = self.evaluator.rates(wid)
        return (0.0, 0.0) if rates is None else (rates.turns_per_s, rates.handler_busy)


def worker_views(tier: str, handles: Iterable[WorkerHandle], registry: Mapping[str, tuple[WorkerInfo, bool]],
                 evaluator: Evaluator, policy: ScaleRules, now: float,
                 trusted_since: float = 0.0, memo: ViewMemo | None = None) -> tuple[WorkerView, ...]:
    """Every live worker of ``tier``: spawned/adopted by the runtime, or registered with a heartbeat.

    ``trusted_since`` is the end of the last outage the commander saw (Redis unreachable or
    paused): a report is fresh only if its whole interval came after it, since a worker that
    could not reach Redis looked idle for reasons that say nothing about its load. ``memo``:
    views of the last pass to keep where nothing they are made of changed (:class:`ViewMemo`).
    """
    mine = [h for h in handles if h.tier == tier and h.state is not Lifecycle.EXITED]
    build = _Build(evaluator, now, memory_limit_bytes(policy), stale_after(policy),
                   policy.scaling.report_interval_s, trusted_since)
    inputs = (tuple((h.worker_id, h.state, h.started) for h in mine), build.limit, build.stale_s,
              build.interval_s, trusted_since)
    newest = evaluator.newest
    last = memo.last(tier) if memo is not None else None
    if (memo is not None and last is not None and last.period == memo.period - 1 and last.registry is registry
            and last.inputs == inputs and last.at <= now <= last.stale_at):
        changed = [wid for wid in memo.changed(tier) if wid in last.made]
        if not changed:
            last.period = memo.period
            return last.views
        handle_of = {h.worker_id: h for h in mine}
        made, rates, stale_at = dict(last.made), dict(last.rates), last.stale_at
        for wid in changed:
            handle, report = handle_of.get(wid), newest.get(wid)
            made[wid] = build.view(wid, handle, _started(wid, handle, registry), report, None)
            rates[wid] = build.rates(wid)
            stale_at = min(stale_at, _stale_at(made[wid][1], report, build.stale_s))
        views = mark_reception([view for _, view in made.values()])
        memo.keep(tier, TierViews(registry, inputs, now, made, rates, stale_at, views, memo.period),
                  whole=False)
        return views
    by_id: dict[str, WorkerHandle | None] = {h.worker_id: h for h in mine}
    for wid, (info, alive) in registry.items():
        if info.tier == tier and alive:
            by_id.setdefault(wid, None)
    kept = last.made if last is not None else {}
    made, stale_at = {}, math.inf
    for wid, handle in sorted(by_id.items()):
        report = newest.get(wid)
        made[wid] = build.view(wid, handle, _started(wid, handle, registry), report, kept.get(wid))
        stale_at = min(stale_at, _stale_at(made[wid][1], report, build.stale_s))
    views = mark_reception([view for _, view in made.values()])
    if memo is not None:
        rates = {wid: build.rates(wid) for wid in made}
        memo.keep(tier, TierViews(registry, inputs, now, made, rates, stale_at, views, memo.period),
                  whole=True)
    return views


def _started(wid: str, handle: WorkerHandle | None, registry: Mapping[str, tuple[WorkerInfo, bool]]) -> float:
    if handle is not None:
        return handle.started
    entry = registry.get(wid)
    return entry[0].started if entry is not None else 0.0


def _stale_at(view: WorkerView, report: OccupancyReport | None, stale_s: float) -> float:
    """When a view goes stale: never if it is not fresh (time makes none fresh again)."""
    return report.ts + stale_s if view.fresh and report is not None else math.inf


def mark_reception(views: list[WorkerView]) -> tuple[WorkerView, ...]:
    """The views with the tier's reception marked: its oldest ready worker."""
    ready = [v for v in views if v.state == "ready"]
    if not ready:
        return tuple(views)
    first = min(ready, key=lambda v: (v.started, v.id)).id
    return tuple(v if v.is_reception == (v.id == first) else replace(v, is_reception=v.id == first)
                 for v in views)


@dataclass(frozen=True, slots=True)
class TierRates:
    """The tier's served rates, from its workers' counter deltas (``Evaluator.rates``)."""

    turns_per_s: float = 0.0
    handler_busy: float = 0.0  # handler seconds per second: busy slots on average


def tier_rates(views: Iterable[WorkerView], evaluator: Evaluator) -> TierRates:
    """Turns and handler seconds per second served by the tier's workers."""
    turns = busy = 0.0
    for v in views:
        rates = evaluator.rates(v.id)
        if rates is not None:
            turns += rates.turns_per_s
            busy += rates.handler_busy
    return TierRates(turns, busy)


def holding(views: Iterable[WorkerView], held: Mapping[str, int],
            kept: dict[str, tuple[WorkerView, int, WorkerView]] | None = None) -> tuple[WorkerView, ...]:
    """A worker holding pending notifications in Redis now has jobs in progress: it holds
    lanes, whatever its last report (up to a report interval old) said, so it is not idle.
    The backlog leaves jobs in progress out; this keeps a busy worker from being reclaimed
    on a report that caught it between two turns. ``kept``: the views so made by the last
    call, by worker (its view, what it held, the view made): one whose view and count are the
    same is not made again; replaced by this call's."""
    out, made = [], {}
    for v in views:
        n = held.get(v.id, 0)
        if n <= v.lanes:
            out.append(v)
            continue
        hit = kept.get(v.id) if kept is not None else None
        view = hit[2] if hit is not None and hit[0] is v and hit[1] == n else with_lanes(v, n)
        made[v.id] = (v, n, view)
        out.append(view)
    if kept is not None:
        kept.clear()
        kept.update(made)
    return tuple(out)


def with_lanes(v: WorkerView, lanes: int) -> WorkerView:
    """``replace(v, lanes=lanes)``, made directly: a pass makes thousands."""
    return WorkerView(id=v.id, state=v.state, occupancy=v.occupancy, busy=v.busy, total=v.total, lanes=lanes,
                      fresh=v.fresh, is_reception=v.is_reception, started=v.started, ready_at=v.ready_at,
                      turns=v.turns, protected_until=v.protected_until)


def snapshot(tier: str, views: tuple[WorkerView, ...], signals: TierSignals,
             rates: TierRates = TierRates(),
             kept: dict[str, tuple[WorkerView, int, WorkerView]] | None = None) -> TierSnapshot:
    """The decide() input for one tier (``kept``: see :func:`holding`)."""
    return TierSnapshot(tier=tier, workers=holding(views, signals.held, kept),
                        active_users=signals.active_users, backlog=signals.backlog, rps=rates.turns_per_s,
                        handler_rate=rates.handler_busy,
                        pressure_events=signals.pressure_events, observed=signals.observed)
