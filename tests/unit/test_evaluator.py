"""The evaluator: per-row components, 6-row averages, max = occupancy, rates."""

from __future__ import annotations

import pytest

from commander.evaluator import (
    AVERAGE_ROWS,
    FORGET_ABSENT_S,
    WINDOW_ROWS,
    Evaluator,
    Occupancy,
    memory_limit_bytes,
    occupancy_of,
    rates_of,
)
from protocol.codec import decode, encode
from protocol.models import Counters, OccupancyReport, Slots
from protocol.policy import turns_policy

MB = 1024 * 1024


def report(ts: float = 0.0, *, worker: str = "w1", tier: str = "chat", cpu: float | None = 0.0,
           rss: int = 0, busy: int = 0, total: int = 8, turns: int = 0, errors: int = 0,
           handler_s: float = 0.0, state: str = "ready") -> OccupancyReport:
    """A report with only what a test cares about set."""
    return OccupancyReport(
        worker=worker, tier=tier, ts=ts, state=state, users=0, active_users=0,
        slots=Slots(busy=busy, total=total), cpu=cpu, rss=rss,
        counters=Counters(turns=turns, errors=errors, handler_seconds=handler_s),
        load=(0.0, 0.0, 0.0),
    )


def rows(*kwargs: dict[str, object]) -> list[OccupancyReport]:
    """Reports one second apart, each with its own fields."""
    return [report(float(i), **kw) for i, kw in enumerate(kwargs)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "given", "limit", "expected"),
    [
        ("no rows reads 0", [], None, Occupancy()),
        ("cpu capped at one core", rows({"cpu": 1.7}), None, Occupancy(1.0, 1.0, None, 0.0, 1)),
        ("cpu None is absent, not 0", rows({"cpu": None, "busy": 2}), None,
         Occupancy(0.25, None, None, 0.25, 1)),
        ("first row without cpu is left out of the mean", rows({"cpu": None}, {"cpu": 0.4}), None,
         Occupancy(0.4, 0.4, None, 0.0, 2)),
        ("memory only with a limit", rows({"rss": 512 * MB}), None,
         Occupancy(0.0, 0.0, None, 0.0, 1)),
        ("memory as a fraction of the limit", rows({"rss": 512 * MB}), 1024 * MB,
         Occupancy(0.5, 0.0, 0.5, 0.0, 1)),
        ("slots busy/total", rows({"busy": 6, "total": 8}), None,
         Occupancy(0.75, 0.0, None, 0.75, 1)),
        ("no slots reported", rows({"busy": 0, "total": 0, "cpu": 0.1}), None,
         Occupancy(0.1, 0.1, None, None, 1)),
        ("max of the averages, not of the rows",
         rows({"cpu": 0.9, "busy": 0}, {"cpu": 0.1, "busy": 8, "handler_s": 8.0}),
         None, Occupancy(0.5, 0.5, None, 0.5, 2)),
    ],
)
def test_occupancy_components(name: str, given: list[OccupancyReport], limit: float | None,
                              expected: Occupancy) -> None:
    got = occupancy_of(given, limit)
    assert got == expected, name


def test_average_uses_only_the_last_six_rows() -> None:
    old = [report(float(i), cpu=1.0) for i in range(10)]
    recent = [report(10.0 + i, cpu=0.2) for i in range(AVERAGE_ROWS)]
    occ = occupancy_of(old + recent, None)
    assert occ.value == pytest.approx(0.2)
    assert occ.rows == AVERAGE_ROWS


def test_window_keeps_the_last_sixty_rows() -> None:
    ev = Evaluator()
    for i in range(WINDOW_ROWS + 15):
        ev.add(report(float(i)))
    window = ev.window("w1")
    assert len(window) == WINDOW_ROWS
    assert window[0].ts == 15.0 and window[-1].ts == WINDOW_ROWS + 14


@pytest.mark.parametrize(
    ("ts_sequence", "accepted"),
    [
        ([1.0, 2.0, 3.0], [True, True, True]),
        ([1.0, 1.0], [True, False]),  # the same stream entry read twice
        ([2.0, 1.0, 3.0], [True, False, True]),  # out of order
    ],
)
def test_add_ignores_rows_that_are_not_newer(ts_sequence: list[float], accepted: list[bool]) -> None:
    ev = Evaluator()
    assert [ev.add(report(ts)) for ts in ts_sequence] == accepted


def test_unknown_worker_reads_zero_and_no_rates() -> None:
    ev = Evaluator()
    assert ev.occupancy("ghost") == Occupancy()
    assert ev.rates("ghost") is None
    assert ev.window("ghost") == ()
    assert ev.last_report_ts("ghost") is None
    assert ev.latest("ghost") is None


@pytest.mark.parametrize(
    ("name", "given", "span", "expected"),
    [
        ("one row has no rate", rows({"turns": 5}), 60.0, None),
        ("deltas per second", [report(0, turns=10, errors=1, handler_s=2.0),
                               report(10, turns=30, errors=3, handler_s=12.0)], 60.0,
         (2.0, 0.2, 1.0, 10.0)),
        ("only rows within the span", [report(0, turns=0), report(50, turns=100),
                                       report(100, turns=200)], 60.0, (2.0, 0.0, 0.0, 50.0)),
        ("never across a counter reset", [report(0, turns=100), report(10, turns=2),
                                          report(20, turns=12)], 60.0, (1.0, 0.0, 0.0, 10.0)),
        ("reset on the newest row", [report(0, turns=100), report(10, turns=2)], 60.0, None),
    ],
)
def test_rates(name: str, given: list[OccupancyReport], span: float,
               expected: tuple[float, float, float, float] | None) -> None:
    got = rates_of(given, span)
    if expected is None:
        assert got is None, name
    else:
        assert got is not None, name
        assert (got.turns_per_s, got.errors_per_s, got.handler_busy, got.span_s) == pytest.approx(
            expected), name


def test_evaluator_end_to_end() -> None:
    ev = Evaluator()
    ev.add(report(100.0, worker="a", cpu=None, busy=4, turns=0))
    ev.add(report(105.0, worker="a", cpu=0.3, busy=2, turns=10, handler_s=10.0))  # 2 slots x 5 s
    ev.add(report(105.0, worker="b", tier="batch", busy=8))
    occ = ev.occupancy("a")
    assert (occ.value, occ.cpu, occ.slots) == pytest.approx((0.375, 0.3, 0.375))
    rates = ev.rates("a")
    assert rates is not None and rates.turns_per_s == pytest.approx(2.0)
    assert ev.workers() == ["a", "b"] and ev.workers("batch") == ["b"]
    assert ev.last_report_ts("a") == 105.0
    assert ev.is_fresh("a", now=114.0, max_age_s=10.0)
    assert not ev.is_fresh("a", now=116.0, max_age_s=10.0)
    rows = ev.window("a")  # each row's own components: slots at the instant, and over the interval
    assert [r.cpu for r in rows] == [None, 0.3]
    assert [(r.instant, r.slots) for r in rows] == [(0.5, 0.5), (0.25, 0.25)]
    ev.forget("a")
    assert ev.workers() == ["b"] and ev.occupancy("a").value == 0.0


@pytest.mark.parametrize(("mb", "expected"), [(None, None), (256.0, 256.0 * MB)])
def test_memory_limit_from_policy(mb: float | None, expected: float | None) -> None:
    assert memory_limit_bytes(turns_policy(memory_limit_mb=mb).scale_rules()) == expected


def test_workers_absent_from_the_registry_and_the_runtime_are_forgotten_after_a_bound() -> None:
    ev = Evaluator()
    for worker in ("kept", "registered", "gone"):
        ev.add(report(100.0, worker=worker))
    ev.add(report(1000.0, worker="kept"))  # still reporting, though no one lists it
    present = {"registered"}
    assert ev.forget_absent(present, now=100.0 + FORGET_ABSENT_S) == []  # not past the bound yet
    assert ev.forget_absent(present, now=101.0 + FORGET_ABSENT_S) == ["gone"]
    assert sorted(ev.workers()) == ["kept", "registered"] and ev.window("gone") == ()
    assert ev.forget_absent(set(), now=1001.0 + FORGET_ABSENT_S) == ["kept", "registered"]
    assert ev.workers() == []


def test_the_evaluators_kept_rows_read_as_its_reports_do() -> None:
    """Occupancy and rates from the rows derived as each report is kept equal those computed
    afresh from the worker's window of reports: past the window's length (the oldest rows
    dropped), over counter resets, with and without a memory limit, at every step, whether read
    for the first time since the newest row or again."""
    import random

    rnd = random.Random(5)
    ev, ts, turns, handler, kept = Evaluator(), 0.0, 0, 0.0, []
    for step in range(3 * WINDOW_ROWS):
        ts += rnd.choice((0.5, 1.0, 1.0, 7.0, 30.0))
        if rnd.random() < 0.08:
            turns, handler = 0, 0.0  # a restart under the same id: counting afresh
        turns += rnd.randrange(0, 20)
        handler += rnd.random() * 4
        kept.append(report(ts, cpu=rnd.choice((None, rnd.random() * 1.5)), rss=rnd.randrange(0, 900) * MB,
                           busy=rnd.randrange(0, 9), turns=turns, handler_s=handler))
        ev.add(kept[-1])
        window = kept[-WINDOW_ROWS:]
        for limit in (None, 512.0 * MB, 512.0 * MB, None):  # (each asked twice: once as kept)
            assert ev.occupancy("w1", limit) == pytest.approx(occupancy_of(window, limit)), step
        for span in (5.0, 60.0, 60.0, 5.0):
            assert ev.rates("w1", span) == rates_of(window, span), (step, span)
        assert ev.window("w1") == tuple(ev.window("w1")) and len(ev.window("w1")) == len(window)


def test_a_worker_costs_its_newest_report_and_a_few_hundred_bytes_a_row() -> None:
    """A commander keeps a minute of rows for every worker: 600,000 at 10,000 workers. Each row
    is what occupancy, rates and the monitor read of a report, not the report (a decoded report
    with its turn counts is several kB: kept whole, the windows of 10,000 workers grew past 4
    GB); only a worker's newest report is kept whole."""
    import gc
    import tracemalloc

    from protocol.metrics_buckets import BUCKET_COUNT
    from protocol.models import TurnHistogram, TurnStats

    def turn_stats(turns: int) -> TurnStats:  # a busy worker's counts, its histograms filled
        h = TurnHistogram(counts=tuple(turns * (i + 1) // 40 for i in range(BUCKET_COUNT)), sum=turns * 0.4)
        return TurnStats(ok=turns, error=turns // 100, retries=turns // 50,
                         queue_wait=h, handler=h, latency=h)

    workers = 50
    wire = [encode(report(float(ts), worker=f"w{w}", cpu=0.3, busy=ts % 8, turns=10 * ts, handler_s=1.5 * ts)
                   .model_copy(update={"turn_stats": turn_stats(10 * ts)}))
            for ts in range(1, WINDOW_ROWS + 1) for w in range(workers)]
    gc.collect()
    tracemalloc.start()
    ev = Evaluator()
    for data in wire:  # decoded as the commander reads them
        ev.add(decode(OccupancyReport, data))
    gc.collect()
    kept, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    newest = [decode(OccupancyReport, d) for d in wire[-workers:]]
    assert [ev.latest(f"w{w}") for w in range(workers)] == newest
    assert kept / (workers * WINDOW_ROWS) < 512, f"{kept / (workers * WINDOW_ROWS):.0f} bytes a row"
