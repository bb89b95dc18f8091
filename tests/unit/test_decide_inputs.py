"""The pure builder of decide()'s worker views: freshness, state, reception (table tests)."""

from __future__ import annotations

import pytest

from commander.decide_inputs import stale_after, tier_rates, worker_views
from commander.evaluator import Evaluator, occupancy_of
from commander.runtime import Lifecycle, WorkerHandle
from protocol.models import Counters, OccupancyReport, Slots, WorkerInfo
from protocol.policy import turns_policy

POLICY = turns_policy(report_interval_s=1.0).scale_rules()
NOW = 1_000.0


def report(worker: str, ts: float, busy: int = 0, state: str = "ready", handler_s: float = 0.0,
           total: int = 4, rss: int = 1) -> OccupancyReport:
    return OccupancyReport(worker=worker, tier="chat", ts=ts, state=state, users=0, active_users=0,  # type: ignore[arg-type]
                           slots=Slots(busy=busy, total=total), cpu=0.0, rss=rss,
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


def test_views_kept_from_the_last_pass_are_those_built_afresh(monkeypatch):
    """A worker's view is built again only when what it is made of changed: at every step of a
    sequence that changes one thing at a time, the kept views equal views built afresh. The
    steps share their registry objects, as a commander's passes do while nothing registered or
    left: then only the workers with a new report are built again (nothing new: the very views
    of the last pass)."""
    from commander import decide_inputs
    from commander.decide_inputs import ViewMemo
    from protocol.policy import turns_policy as policy_of

    built: list[str] = []
    real = decide_inputs._Build.view
    monkeypatch.setattr(decide_inputs._Build, "view",
                        lambda self, wid, *rest: built.append(wid) or real(self, wid, *rest))
    ev, memo = Evaluator(), ViewMemo()
    limited = policy_of(report_interval_s=1.0, memory_limit_mb=1.0).scale_rules()
    info = WorkerInfo(worker="remote", tier="chat", pid=9, host="other", started=5.0)
    none: dict[str, tuple[WorkerInfo, bool]] = {}
    remote = {"remote": (info, True)}
    def counted(worker: str, ts: float, **kw: object) -> OccupancyReport:  # (its handler busy half the time)
        return report(worker, ts, handler_s=(ts - 900) / 2, **kw)  # type: ignore[arg-type]

    steps = [  # (what changed, handles, registry, policy, now, trusted_since, a report added first)
        ("first pass", [handle("a"), handle("b")], none, POLICY, NOW, 0.0, [counted("a", NOW - 0.5, busy=1)]),
        ("nothing new", [handle("a"), handle("b")], none, POLICY, NOW, 0.0, []),
        ("a new report", [handle("a"), handle("b")], none, POLICY, NOW, 0.0,
         [counted("a", NOW - 0.2, busy=3, rss=3 * 1024 * 1024)]),  # (3 MB: over the limit below)
        ("b's first report", [handle("a"), handle("b")], none, POLICY, NOW, 0.0, [counted("b", NOW, busy=2)]),
        ("a later pass, nothing new", [handle("a"), handle("b")], none, POLICY, NOW + 0.5, 0.0, []),
        ("a goes stale, nothing else", [handle("a"), handle("b")], none, POLICY, NOW + 2.9, 0.0, []),
        ("a memory limit", [handle("a"), handle("b")], none, limited, NOW, 0.0, []),
        ("a drains", [handle("a", Lifecycle.DRAINING), handle("b")], none, limited, NOW, 0.0, []),
        ("time passes: stale", [handle("a"), handle("b")], none, POLICY, NOW + 10, 0.0, []),
        ("the clock goes back", [handle("a"), handle("b")], none, POLICY, NOW, 0.0, []),
        ("an outage", [handle("a"), handle("b")], none, POLICY, NOW, NOW - 0.1, []),
        ("a registered worker", [handle("a")], remote, POLICY, NOW, 0.0,
         [counted("remote", NOW - 0.1, busy=1)]),
        ("its new report", [handle("a")], remote, POLICY, NOW + 0.5, 0.0,
         [counted("remote", NOW + 0.4, busy=2)]),
        ("a stale one, the other's new report", [handle("a")], remote, POLICY, NOW + 3.2, 0.0,
         [counted("remote", NOW + 3.1, busy=1)]),
        ("restarted later", [handle("a", started=7.0)], remote, POLICY, NOW + 3.2, 0.0, []),
        ("forgotten", [handle("a")], remote, POLICY, NOW + 3.2, 0.0, "forget remote"),
        ("the same time again", [handle("a")], remote, POLICY, NOW + 3.2, 0.0,
         [counted("remote", NOW + 3.1, busy=4)]),
        ("all stale", [handle("a")], remote, POLICY, NOW + 20, 0.0, []),
        ("a fresh report", [handle("a")], remote, POLICY, NOW + 20, 0.0, [counted("remote", NOW + 19.9)]),
        ("it goes stale", [handle("a")], remote, POLICY, NOW + 23, 0.0, []),
        ("a pass that judged no tier", [handle("a")], remote, POLICY, NOW + 23, 0.0,
         [counted("remote", NOW + 22.9, busy=3)]),
        ("the pass after it", [handle("a")], remote, POLICY, NOW + 23, 0.0, []),
    ]
    previous, busy = None, []
    for what, handles, registry, policy, now, trusted, added in steps:
        if added == "forget remote":
            ev.forget("remote")
        else:
            for rep in added:
                ev.add(rep)
        memo.begin(ev.take_changed())
        if what == "a pass that judged no tier":  # (its changes are not the next pass's)
            continue
        built.clear()
        kept, rebuilt = worker_views("chat", handles, registry, ev, policy, now, trusted, memo), list(built)
        assert kept == worker_views("chat", handles, registry, ev, policy, now, trusted), what
        assert memo.rates("chat", kept) == tier_rates(kept, ev), what
        busy.append(tier_rates(kept, ev).handler_busy)
        if "nothing new" in what:
            assert kept is previous and rebuilt == [], what
        if what in ("its new report", "a fresh report"):  # (a's is kept without a look)
            assert rebuilt == ["remote"], what
        previous = kept
    assert 0.5 in busy and 1.0 in busy  # (rates that the memo carried: one worker, then two)


def test_the_memo_forgets_the_workers_of_tiers_no_longer_judged() -> None:
    """A tier's workers are indexed so that a pass finds its changed ones without a walk; the
    index does not outlive the tiers (a fleet's workers come and go over days)."""
    from commander.decide_inputs import ViewMemo

    ev, memo = Evaluator(), ViewMemo()
    handles = [handle(f"w{i}") for i in range(1500)]
    memo.begin([])
    worker_views("chat", handles, {}, ev, POLICY, NOW, 0.0, memo)
    memo.begin(["w7"])
    assert memo.changed("chat") == ["w7"]
    memo.retain(["chat"])
    memo.begin(["w7"])
    assert memo.changed("chat") == ["w7"]
    memo.retain([])
    memo.begin(["w7"])
    assert memo.changed("chat") == []
