"""The chaos run's short mode: faults of every kind, then the invariants I1-I6 must hold.

Timing figures (waits, takeover) are measured and must be present, never asserted: the
workers and the commander change speed, the invariants do not.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

KINDS = {"worker-kill", "drain-kill", "worker-pause", "commander-kill", "redis-restart", "redis-pause"}


@pytest.mark.smoke
def test_chaos_quick_holds_every_invariant(tmp_path):
    """Chat users and users whose turns stream (``--streamed``), some of them stopped."""
    out = tmp_path / "chaos.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--quick", "--streamed", "4",
                          "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    result = json.loads(out.read_text()) if out.exists() else {}
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert result["invariants_failed"] == []
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["out_of_order_users"] == 0
    assert result["context_gaps"] == 0
    assert result["orphans"] == 0
    assert result["submitted"] > 0 and result["answered"] == result["submitted"]
    # streamed turns, some stopped: every stream as its reply says, every recorded cancel obeyed
    streams = result["streams"]
    assert streams["streamed_turns"] > 0 and streams["cancelled"] > 0 and streams["violations"] == 0, streams
    assert result["stopped_entries_not_cut"] == 0
    # every kind of fault was injected at least once, and the scaled quotas were met
    assert set(result["faults"]) >= KINDS and set(result["quota"]) >= KINDS, result["faults"]
    assert result["quota_missed"] == []
    # I3 from the handler trace: the workers wrote it, and no unfenced overlap
    assert result["trace"].get("exit", 0) > 0, result["trace"]
    assert result["i3_violations"] == 0, result["i3_examples"]
    assert result["i3_overlaps"] == result["i3_violations"] + result["i3_fenced"]
    # the measured figures are there (their values are not asserted)
    assert result["longest_wait_s"] >= result["p99_wait_s"] > 0
    for row in ("kill", "pause"):
        assert {"n", "p50_s", "p99_s", "max_s"} <= set(result["takeover"][row])
    for line in ("I3 overlaps", "longest wait", "p99 wait", "takeover after a worker SIGKILL",
                 "takeover after a worker pause", "faults: worker-pause"):
        assert line in run.stdout, run.stdout


@pytest.mark.smoke
def test_chaos_quick_hostile_answers_every_injection_and_holds_the_invariants(tmp_path):
    """Bad tier members, bad registry entries, users' keys of the wrong type and poison
    notifications written during the load: each turn and notification answered, no Fleet
    process exited, and the load's users' invariants hold as without them."""
    out = tmp_path / "chaos.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--quick", "--hostile",
                          "--seed", "3", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    result = json.loads(out.read_text()) if out.exists() else {}
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert result["invariants_failed"] == []
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["out_of_order_users"] == 0
    assert result["submitted"] > 0 and result["answered"] == result["submitted"]
    hostile = result["hostile"]
    assert hostile["failed"] == [] and hostile["injected"] == hostile["planned"] > 0, hostile
    turns, notes = hostile["turns"], hostile["notifications"]
    assert turns["injected"] > 0 and turns["unanswered"] == 0 and turns["ok_reply"] == 0, turns
    assert turns["error_reply"] + turns["dead_lettered"] >= turns["injected"], turns
    assert notes["injected"] > 0 and notes["dead_lettered"] == notes["injected"], notes
    assert hostile["state_entries"] > 0 and hostile["process_exits"] == []
    for line in ("hostile: turns of users with a wrong-type key", "hostile: poison notifications",
                 "HOSTILE: every injection answered, no process exited", "INVARIANTS: all hold"):
        assert line in run.stdout, run.stdout


def test_exclusivity_check_tells_fenced_overlaps_from_violations(tmp_path, monkeypatch):
    """The I3 check on a hand-made trace: a paused worker overlapped by its successor is
    fenced (the successor committed the turn), two committed overlapping turns are a violation,
    a SIGKILLed worker's open entry ends at its kill."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import chaos_check as ck

    def ev(kind, t, worker, user, turn):
        return json.dumps({"ev": kind, "t": t, "worker": worker, "lease": f"{worker}|{ord(worker)}",
                           "user": user, "turn": turn})

    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join([
        ev("enter", 2.0, "A", "u", "u-1"),  # A paused from 2.05 to 5.5
        ev("enter", 4.5, "B", "u", "u-1"), ev("exit", 4.6, "B", "u", "u-1"),
        ev("enter", 4.7, "B", "u", "u-2"), ev("exit", 4.8, "B", "u", "u-2"),
        ev("exit", 5.6, "A", "u", "u-1"),
        ev("enter", 7.0, "C", "v", "v-0"),  # C SIGKILLed at 7.5
        ev("enter", 7.6, "D", "v", "v-0"), ev("exit", 7.7, "D", "v", "v-0"),
        ev("enter", 8.0, "E", "w", "w-0"), ev("enter", 8.1, "F", "w", "w-1"),  # both commit: violation
        ev("exit", 8.2, "E", "w", "w-0"), ev("exit", 8.3, "F", "w", "w-1"),
        '{"ev": "ent',  # a torn last line is counted, not fatal
    ]) + "\n")
    intervals, stats = ck.read_trace(trace, {"C": 7.5}, end=100.0)
    assert stats == {"exit": 6, "kill": 1, "unreadable lines": 1}
    answers = {("u", "u-1"): ck.Answer("B", 4.6), ("u", "u-2"): ck.Answer("B", 4.8),
               ("v", "v-0"): ck.Answer("D", 7.7), ("w", "w-0"): ck.Answer("E", 8.2),
               ("w", "w-1"): ck.Answer("F", 8.3)}
    res = ck.check_exclusivity(intervals, answers)
    assert (res["i3_overlaps"], res["i3_fenced"], res["i3_violations"]) == (3, 2, 1), res
    faults = [ck.Injected("worker-pause", 2.05, 5.5, "A"), ck.Injected("worker-kill", 7.5, 7.5, "C")]
    take = ck.takeovers(faults, intervals, answers)
    assert take["pause"]["n"] == 1 and take["pause"]["max_s"] == pytest.approx(2.55)
    assert take["kill"]["n"] == 1 and take["kill"]["max_s"] == pytest.approx(0.2)


def test_the_sampler_reads_each_workers_latest_state(monkeypatch):
    """A draining worker is not capacity (its replacement may start while it finishes): the
    I6 sampler tells it by the worker's latest report, and an unreadable report is skipped."""
    import fakeredis

    from protocol import keys
    from protocol.codec import encode
    from protocol.models import Counters, OccupancyReport, Slots

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import chaos

    def report(worker, state):
        return encode(OccupancyReport(worker=worker, tier="chat", ts=1.0, state=state, users=0,
                                      active_users=0, slots=Slots(busy=0, total=4), rss=1,
                                      counters=Counters(), load=(0, 0, 0)))

    r = fakeredis.FakeRedis()
    r.xadd(keys.REPORTS, {"m": report("a", "starting")})
    r.xadd(keys.REPORTS, {"m": report("b", "ready")})
    r.xadd(keys.REPORTS, {"m": report("a", "ready")})
    r.xadd(keys.REPORTS, {"m": report("b", "draining")})
    r.xadd(keys.REPORTS, {"m": b"not a report"})
    assert chaos.latest_states(r) == {"a": "ready", "b": "draining"}


def test_the_sampler_leaves_out_a_worker_told_to_drain_before_it_reports_it(monkeypatch):
    """Seed 1, issue I6: the commander consolidated a worker that chaos had SIGSTOPped (its
    last report, 1.5 s old, was still fresh), counted it as draining and started replacements;
    the sampler saw 7 'ready' workers against max_workers 6, because the frozen worker could not
    report 'draining' until its SIGCONT. A drain ordered on the worker's control stream makes it
    no capacity, whoever sent it and whatever its last report says."""
    import fakeredis

    from protocol import keys
    from protocol.codec import encode
    from protocol.models import Control, Counters, OccupancyReport, Slots, WorkerInfo

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import chaos

    def report(worker, state):
        return encode(OccupancyReport(worker=worker, tier="chat", ts=1.0, state=state, users=0,
                                      active_users=0, slots=Slots(busy=0, total=4), rss=1,
                                      counters=Counters(), load=(0, 0, 0)))

    def info(worker):
        return WorkerInfo(worker=worker, tier="chat", pid=1, host="h", started=1.0)

    r = fakeredis.FakeRedis()
    for worker, state in (("a", "ready"), ("paused", "ready"), ("c", "draining")):
        r.xadd(keys.REPORTS, {"m": report(worker, state)})
    drain = encode(Control(kind="drain", ts=2.0, reason="consolidate: scale in 6->5"))
    r.xadd(keys.control("paused"), {"m": drain})
    r.xadd(keys.control("a"), {"m": b"not a control message"})
    running = [info(w) for w in ("a", "paused", "c", "chaos-drained", "new")]
    capacity, labels = chaos.capacity_of(r, running, drained={"chaos-drained"})
    assert [w.worker for w in capacity] == ["a", "new"]
    assert labels == {"a": "ready", "paused": "drain ordered (report: ready)", "c": "draining",
                      "chaos-drained": "drain sent", "new": "no report"}


def test_a_worker_told_to_drain_that_never_shows_it_fails_i6(monkeypatch):
    """Leaving a worker told to drain out of the count is sound only if it drains: one still
    not draining DRAIN_OBEYED_S after the order was first seen is a surplus kept."""
    import threading

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import chaos
    import chaos_check

    sampler = chaos.Sampler(None, threading.Event(), set())
    sampler.note_orders({"p": "drain ordered (report: ready)", "q": "ready"}, 100.0)
    sampler.note_orders({"p": "drain ordered (report: ready)"}, 100.0 + chaos.DRAIN_OBEYED_S)
    assert sampler.ignored == set()
    sampler.note_orders({"p": "drain ordered (report: ready)"}, 100.1 + chaos.DRAIN_OBEYED_S)
    assert sampler.ignored == {"p"}
    res = {"lost": 0, "duplicated": 0, "out_of_order_users": 0, "context_gaps": 0, "i3_violations": 0,
           "answered": 0, "trace": {}, "orphans": 0, "max_live_workers": 6, "max_workers": 6,
           "drains_ignored": ["p"]}
    assert chaos_check.failures(res, True) == ["I6 workers told to drain kept serving: ['p']"]
