"""The pure builder of decide()'s worker views: freshness, state, reception (table tests)."""

from __future__ import annotations

import pytest

from commander.decide_inputs import stale_after, worker_views
from commander.evaluator import Evaluator, occupancy_of
from commander.runtime import Lifecycle, WorkerHandle
from protocol.models import Counters, OccupancyReport, Slots, WorkerInfo
from protocol.policy import turns_policy

POLICY = turns_policy(report_interval_s=1.0).scale_rules()
NOW = 1_000.0


def report(worker: str, ts: float, busy: int = 0, state: str = "ready", handler_s: float = 0.0,
           total: int = 4) -> OccupancyReport:
    return OccupancyReport(worker=worker, tier="chat", ts=ts, state=state, users=0, active_users=0,  # type: ignore[arg-type]
                           slots=Slots(busy=busy, total=total), cpu=0.0, rss=1,
                           counters=Counters(handler_seconds=handler_s), load=(0, 0, 0))


def handle(worker: str, state: Lifecycle = Lifecycle.RUNNING, started: float = 0.0) -> WorkerHandle:
    return WorkerHandle(worker, "chat", 1, state, started)


def views(handles, reports, registry=None, trusted_since=0.0):
    ev = Evaluator()
    for rep in reports:
        ev.add(rep)
    return {v.id: v for v in worker_views("chat", handles, registry or {}, ev, POLICY, NOW, trusted_since)}


@pytest.mark.parametrize(("reports", "handle_state", "want_state", "want_fresh"), [
    ([], Lifecycle.STARTING, "starting", False),  # spawned, no report yet
    ([report("w", NOW - 0.5)], Lifecycle.RUNNING, "ready", True),
    ([report("w", NOW - stale_after(POLICY) - 0.1)], Lifecycle.RUNNING, "ready", False),  # stale
    ([report("w", NOW - 0.5, state="draining")], Lifecycle.RUNNING, "draining", True),
    ([report("w", NOW - 0.5)], Lifecycle.DRAINING, "draining", True),  # retired by the runtime
    ([report("w", NOW - 0.5, state="starting")], Lifecycle.RUNNING, "starting", True),
], ids=["no-report", "fresh", "stale", "reports-draining", "runtime-draining", "reports-starting"])
def test_state_and_freshness(reports, handle_state, want_state, want_fresh):
    v = views([handle("w", handle_state)], reports)["w"]
    assert (v.state, v.fresh) == (want_state, want_fresh)


def test_a_stale_worker_is_never_idle():
    v = views([handle("w")], [report("w", NOW - 10)])["w"]
    assert not v.fresh and not v.idle


def test_reports_from_before_an_outage_are_not_fresh():
    reps = [report("w", NOW - 0.5)]
    assert views([handle("w")], reps, trusted_since=NOW - 5)["w"].fresh
    assert not views([handle("w")], reps, trusted_since=NOW - 1)["w"].fresh  # interval overlaps it


def test_exited_workers_are_gone_and_registered_ones_with_a_heartbeat_count():
    info = WorkerInfo(worker="remote", tier="chat", pid=9, host="other", started=5.0)
    dead = WorkerInfo(worker="dead", tier="chat", pid=8, host="other", started=5.0)
    other_tier = WorkerInfo(worker="gpu1", tier="gpu", pid=7, host="other", started=5.0)
    got = views([handle("gone", Lifecycle.EXITED)], [report("remote", NOW - 0.2)],
                {"remote": (info, True), "dead": (dead, False), "gpu1": (other_tier, True)})
    assert set(got) == {"remote"} and got["remote"].state == "ready" and got["remote"].started == 5.0


def test_the_oldest_ready_worker_is_the_reception():
    got = views([handle("b", started=2.0), handle("a", started=3.0), handle("c", Lifecycle.STARTING, 1.0)],
                [report("a", NOW - 0.1), report("b", NOW - 0.1)])
    assert [w for w, v in got.items() if v.is_reception] == ["b"]


@pytest.mark.parametrize(("rows", "want"), [
    ([report("w", 0.0, busy=0), report("w", 1.0, busy=0, handler_s=2.0)], (0.0 + 0.5) / 2),
    ([report("w", 0.0, busy=4), report("w", 1.0, busy=4, handler_s=1.0)], (1.0 + 0.25) / 2),
    ([report("w", 0.0, handler_s=5.0), report("w", 1.0, handler_s=1.0)], 0.0),  # counter reset
], ids=["between-instants", "interval-not-instant", "reset"])
def test_slot_use_is_time_averaged_from_handler_seconds(rows, want):
    assert occupancy_of(rows, None).slots == pytest.approx(want)
