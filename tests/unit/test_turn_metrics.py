"""Turn metrics: the workers' cumulative counts become tier counters that never go down
(commander.turn_metrics), their exposition, the worker's tally and the report's wire format."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from commander.metrics import Metrics, sample
from commander.turn_metrics import TurnTotals, combine, delta, went_down
from protocol.codec import CodecError, decode, encode
from protocol.metrics_buckets import BUCKET_COUNT, TURN_BUCKETS, bucket_of
from protocol.models import Counters, OccupancyReport, Slots, TurnHistogram, TurnStats
from worker.tally import TurnTally


def hist(*pairs: tuple[int, int], total: float | None = None) -> TurnHistogram:
    """A histogram with ``count`` observations in bucket ``index`` for each (index, count)."""
    if not pairs:
        return TurnHistogram()
    counts = [0] * BUCKET_COUNT
    for index, n in pairs:
        counts[index] += n
    return TurnHistogram(counts=tuple(counts), sum=sum(n for _, n in pairs) * 0.1 if total is None else total)


def st(ok: int = 0, error: int = 0, retries: int = 0, qw: tuple[tuple[int, int], ...] = (),
       **kw: Any) -> TurnStats:
    return TurnStats(ok=ok, error=error, retries=retries, queue_wait=hist(*qw), **kw)


def report(worker: str, ts: float, stats: TurnStats, tier: str = "chat") -> OccupancyReport:
    return OccupancyReport(worker=worker, tier=tier, ts=ts, state="ready", users=0, active_users=0,
                           slots=Slots(busy=0, total=4), rss=1, counters=Counters(), load=(0, 0, 0),
                           turn_stats=stats)


def same(a: TurnStats, b: TurnStats) -> bool:
    """Equal counts and sums (an empty histogram equals one of zeros; sums to rounding)."""
    def rounded(s: TurnStats) -> TurnStats:
        return s.model_copy(update={f: getattr(s, f).model_copy(update={"sum": round(getattr(s, f).sum, 9)})
                                    for f in ("queue_wait", "handler", "latency")})
    ra, rb = rounded(a), rounded(b)
    return not went_down(ra, rb) and not went_down(rb, ra)


# --- the pure steps -------------------------------------------------------------------------
@pytest.mark.parametrize(("last", "new", "want"), [
    (None, st(ok=3, qw=((1, 3),)), st(ok=3, qw=((1, 3),))),  # first seen: its whole count
    (st(ok=3, qw=((1, 3),)), st(ok=5, retries=1, qw=((1, 4), (2, 1))),
     st(ok=2, retries=1, qw=((1, 1), (2, 1)))),  # grown: the increase
    (st(ok=3), st(ok=3), st()),  # unchanged: nothing
    (st(ok=9, error=2), st(ok=1), st(ok=1)),  # went down: counting afresh, a fresh start
    (st(ok=2, qw=((3, 2),)), st(ok=2, qw=((3, 1), (4, 1))), st(ok=2, qw=((3, 1), (4, 1)))),  # a bucket down
    (st(ok=1, qw=((1, 1),)), st(ok=1), st(ok=1)),  # histogram gone: a restart
], ids=["first-seen", "grown", "unchanged", "reset", "bucket-reset", "histogram-reset"])
def test_delta(last: TurnStats | None, new: TurnStats, want: TurnStats) -> None:
    assert same(delta(last, new), want)


def test_combine_adds_field_by_field() -> None:
    a = st(ok=1, error=2, retries=3, qw=((0, 1),), fenced=4, dead_letters=5, dup=6, stale=7)
    b = st(ok=10, qw=((0, 2), (13, 1)))
    got = combine(a, b)
    assert (got.ok, got.error, got.retries, got.fenced, got.dead_letters, got.dup, got.stale) == \
        (11, 2, 3, 4, 5, 6, 7)
    assert got.queue_wait.counts[0] == 3 and got.queue_wait.counts[13] == 1
    assert got.queue_wait.sum == pytest.approx(0.4)
    assert combine(st(), st()).queue_wait == TurnHistogram()  # nothing observed stays empty


# --- the totals over reports ------------------------------------------------------------------
# each case: the reports in the order read (worker, ts, ok count, queue-wait observations in
# bucket 2), and the tier's totals after them (ok, observations)
CASES = [
    ("a worker appears", [("w1", 1, 4, 4)], (4, 4)),
    ("its counts grow", [("w1", 1, 4, 4), ("w1", 2, 6, 6), ("w1", 3, 9, 9)], (9, 9)),
    ("two workers add up", [("w1", 1, 4, 4), ("w2", 1, 1, 1), ("w1", 2, 5, 5), ("w2", 2, 3, 3)], (8, 8)),
    ("a worker vanishes: what it gave stays", [("w1", 1, 4, 4), ("w2", 1, 2, 2), ("w2", 5, 7, 7)], (11, 11)),
    ("a restart under a new id is a new worker", [("w1", 1, 5, 5), ("w1b", 2, 1, 1), ("w1b", 3, 2, 2)],
     (7, 7)),
    ("a count below the last seen is a fresh start", [("w1", 1, 5, 5), ("w1", 2, 1, 1), ("w1", 3, 3, 3)],
     (8, 8)),
    ("an old or repeated report adds nothing", [("w1", 2, 5, 5), ("w1", 2, 5, 5), ("w1", 1, 3, 3)], (5, 5)),
    ("an empty report, then turns", [("w1", 1, 0, 0), ("w1", 2, 2, 2)], (2, 2)),
]


@pytest.mark.parametrize(("reports", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_tier_totals_never_go_down(reports: list[tuple[str, float, int, int]], want: tuple[int, int]) -> None:
    totals = TurnTotals()
    previous = st()
    for worker, ts, ok, waits in reports:
        totals.add(report(worker, ts, st(ok=ok, qw=((2, waits),) if waits else ())))
        now = totals.tier("chat")
        assert not went_down(previous, now), "a tier counter went down"
        previous = now
    got = totals.tier("chat")
    assert (got.ok, got.queue_wait.count) == want


def test_tiers_are_apart_and_unknown_is_zero() -> None:
    totals = TurnTotals()
    totals.add(report("g1", 1, st(ok=2), tier="gpu"))
    totals.add(report("c1", 1, st(ok=5), tier="chat"))
    assert (totals.tier("gpu").ok, totals.tier("chat").ok, totals.tier("none").ok) == (2, 5, 0)


def test_workers_unreported_for_long_are_forgotten_but_their_counts_stay() -> None:
    totals = TurnTotals(forget_after_s=100)
    totals.add(report("old", 0, st(ok=3)))
    totals.add(report("new", 50, st(ok=1)))
    totals.add(report("new", 200, st(ok=2)))
    assert totals.workers() == ["new"]
    assert totals.tier("chat").ok == 5


# --- exposition --------------------------------------------------------------------------------
def test_metrics_expose_counters_and_summed_histograms() -> None:
    m = Metrics()
    h = hist((0, 2), (7, 1), (BUCKET_COUNT - 1, 1), total=70.5)
    m.observe_turns("chat", TurnStats(ok=3, error=1, dup=2, retries=4, dead_letters=1, fenced=2,
                                      queue_wait=h, handler=h))
    chat = {"tier": "chat"}
    assert sample(m, "fleet_turns_total", {**chat, "result": "ok"}) == 3
    assert sample(m, "fleet_turns_total", {**chat, "result": "error"}) == 1
    assert sample(m, "fleet_turns_total", {**chat, "result": "dup"}) == 2
    assert sample(m, "fleet_turns_total", {**chat, "result": "stale"}) == 0
    assert sample(m, "fleet_turn_retries_total", chat) == 4
    assert sample(m, "fleet_dead_letters_total", chat) == 1
    assert sample(m, "fleet_fenced_total", chat) == 2
    name = "fleet_turn_queue_wait_seconds"
    assert sample(m, f"{name}_bucket", {**chat, "le": "0.005"}) == 2
    assert sample(m, f"{name}_bucket", {**chat, "le": "0.5"}) == 2
    assert sample(m, f"{name}_bucket", {**chat, "le": "1.0"}) == 3  # cumulative
    assert sample(m, f"{name}_bucket", {**chat, "le": "60.0"}) == 3
    assert sample(m, f"{name}_bucket", {**chat, "le": "+Inf"}) == 4
    assert sample(m, f"{name}_count", chat) == 4 and sample(m, f"{name}_sum", chat) == 70.5
    assert sample(m, "fleet_turn_latency_seconds_count", chat) == 0
    assert b'fleet_turn_handler_seconds_bucket{le="+Inf",tier="chat"} 4.0' in m.render()
    m.forget_tier("chat")
    assert sample(m, "fleet_turns_total", {**chat, "result": "ok"}) is None


# --- the worker's side ---------------------------------------------------------------------------
@pytest.mark.parametrize(("seconds", "index"), [
    (0.0, 0), (0.005, 0), (0.0051, 1), (1.0, 7), (60.0, len(TURN_BUCKETS) - 1), (61.0, len(TURN_BUCKETS)),
])
def test_bucket_of_is_prometheus_le(seconds: float, index: int) -> None:
    assert bucket_of(seconds) == index


def test_tally_counts_and_freezes() -> None:
    tally = TurnTally()
    assert tally.stats() == TurnStats()
    tally.served("ok")
    tally.served("ok")
    tally.served("stale")
    tally.retries += 1
    tally.observe("queue_wait", 0.02)
    tally.observe("queue_wait", -3.0)  # a submitter's clock ahead: counted as no wait
    tally.observe("handler", 100.0)
    stats = tally.stats()
    assert (stats.ok, stats.stale, stats.retries) == (2, 1, 1)
    assert stats.queue_wait.counts[bucket_of(0.02)] == 1 and stats.queue_wait.counts[0] == 1
    assert stats.queue_wait.sum == pytest.approx(0.02)
    assert stats.handler.counts[-1] == 1 and stats.latency == TurnHistogram()


# --- the wire --------------------------------------------------------------------------------------
def test_a_report_without_turn_stats_still_decodes() -> None:
    """Reports of workers from before the turn counts decode, with zeros."""
    body = report("w1", 1.0, st()).model_dump(mode="json")
    del body["turn_stats"]
    body["v"] = 1
    old = decode(OccupancyReport, msgpack.packb(body))
    assert old.turn_stats == TurnStats()
    # and a worker with nothing counted yet adds only the field's name: zeros stay off the wire
    assert len(encode(old)) - len(msgpack.packb(body)) < 16


def test_turn_stats_round_trip_and_bad_bucket_counts_are_refused() -> None:
    every = hist(*((i, 1000 + i) for i in range(BUCKET_COUNT)))
    full = TurnStats(ok=10**6, error=5, retries=3, queue_wait=every, handler=every, latency=every)
    data = encode(report("chat-5f3c2a", 1.7e9, full))
    assert decode(OccupancyReport, data).turn_stats == full
    assert len(data) < 800, f"a report with every count set is {len(data)} bytes"
    body = msgpack.unpackb(data)
    body["turn_stats"]["handler"]["counts"] = [1, 2]
    with pytest.raises(CodecError, match="expected 14 bucket counts, got 2"):
        decode(OccupancyReport, msgpack.packb(body))
