"""``chaos --hostile``'s pure parts (scripts/chaos_hostile.py): the plan drawn from a seed, the
injections as written, how each is judged answered, and the verdict of the hostile section."""

from __future__ import annotations

import re
import sys
import threading
import time
from typing import Any

import fakeredis
import pytest

from tests.conftest import ROOT

if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import chaos_hostile as ch  # noqa: E402  (after the path)

from protocol import keys  # noqa: E402
from protocol.codec import encode  # noqa: E402
from protocol.models import LedgerEvent, Reply  # noqa: E402


def test_the_plan_is_one_per_seed_and_inside_the_load() -> None:
    first, again, other = ch.plan(7, 60), ch.plan(7, 60), ch.plan(8, 60)
    assert first == again and [i.at_s for i in first] != [i.at_s for i in other]
    assert [i.at_s for i in first] == sorted(i.at_s for i in first)
    assert all(ch.START_S <= i.at_s <= 60 - ch.ANSWER_ROOM_S for i in first)
    kinds = {(i.kind, i.what) for i in first}
    assert {("wrong-type", k) for k in ch.WRONG_TYPE_KEYS} <= kinds
    assert {("poison", k) for k in ch.POISON_KEYS} | {("poison", "invalid user")} <= kinds
    assert sum(i.kind == "bad-tier" for i in first) == len(ch.BAD_TIERS)
    assert sum(i.kind == "bad-registry" for i in first) == len(ch.BAD_WORKERS)
    # hostile users are none of the load's (c000, c001, ...)
    assert not any(i.target.startswith("c") for i in first if ch.expects_answer(i))


def test_a_run_too_short_for_the_window_still_gets_a_plan() -> None:
    assert all(ch.START_S <= i.at_s <= ch.START_S + 1 for i in ch.plan(1, 3))


class Submits:
    """Stands in for the client: records each submit."""

    def __init__(self) -> None:
        self.turns: list[tuple[str, str | None]] = []

    def submit(self, user: str, text: str, tier: str = "chat", turn_id: str | None = None) -> None:
        self.turns.append((user, turn_id))


def test_the_injector_writes_each_injection_and_clean_up_removes_the_bad_entries() -> None:
    r = fakeredis.FakeRedis()
    r.sadd(keys.TIERS, "chat")
    fleet = Submits()
    injector = ch.Injector(ch.plan(3, 30), r, fleet)  # type: ignore[arg-type]
    injector.run(threading.Event(), time.monotonic() - 60)  # every moment is past: all at once
    assert injector.errors == [] and len(injector.done) == len(injector.injections)
    assert r.smembers(keys.TIERS) == {b"chat", *ch.BAD_TIERS}
    assert r.hgetall(keys.WORKERS) == ch.BAD_WORKERS
    assert all(r.type(key(f"h{i}")) == b"string" for i, key in enumerate(ch.WRONG_TYPE_KEYS.values()))
    assert sorted(fleet.turns) == [(f"h{i}", f"h{i}-0") for i in range(len(ch.WRONG_TYPE_KEYS))]
    assert injector.turns == dict(fleet.turns)
    posted = sorted(f[b"user"].decode() for _id, f in r.xrange(keys.ready("chat")))
    assert posted == sorted(["p0", "p1", *ch.BAD_USER_IDS])
    assert r.type(keys.inbox("p0")) == r.type(keys.state("p1")) == b"string"
    ch.clean_up(r)
    assert r.smembers(keys.TIERS) == {b"chat"} and r.hlen(keys.WORKERS) == 0


def test_an_injection_redis_refuses_is_reported_not_fatal() -> None:
    class Refusing(Submits):
        def submit(self, user: str, text: str, tier: str = "chat", turn_id: str | None = None) -> None:
            raise ValueError("refused")

    injector = ch.Injector([ch.Injection(0.0, "wrong-type", "h0", "session")], fakeredis.FakeRedis(),
                           Refusing())  # type: ignore[arg-type]
    injector.run(threading.Event(), time.monotonic())
    assert injector.done == [] and injector.errors == ["wrong-type h0: ValueError: refused"]


def _dead(r: fakeredis.FakeRedis, user: str, kind: str) -> None:
    r.xadd(keys.dead("chat"), {"user": user, "kind": kind, "reason": "r", "entry": "", "turn_id": ""})


def _reply(r: fakeredis.FakeRedis, user: str, turn_id: str, ok: bool) -> None:
    r.rpush(keys.reply(user, turn_id), encode(Reply(turn_id=turn_id, user=user, ok=ok)))


def test_outcomes_read_error_replies_and_dead_letters_of_the_hostile_users_only() -> None:
    r = fakeredis.FakeRedis()
    done = [ch.Injection(1, "bad-tier", "Bad Tier!"), ch.Injection(2, "wrong-type", "h0", "session"),
            ch.Injection(3, "wrong-type", "h1", "usage"), ch.Injection(4, "wrong-type", "h2", "memory"),
            ch.Injection(5, "poison", "p0", "inbox"),
            ch.Injection(6, "poison", "Bad User! 0", "invalid user"),
            ch.Injection(7, "poison", "p1", "state")]
    turns = {"h0": "h0-0", "h1": "h1-0", "h2": "h2-0"}
    _reply(r, "h0", "h0-0", ok=False)
    _dead(r, "h0", "user_data")
    _dead(r, "h1", "user_data")  # its reply key is not read: the dead letter answers it
    _dead(r, "p0", "delivery_limit")
    _dead(r, "Bad User! 0", "bad_notification")
    _dead(r, "p1", "attempts")  # not a kind a poison notification gets
    got = {o.injection.target: o for o in ch.outcomes(r, done, turns)}
    assert set(got) == {"h0", "h1", "h2", "p0", "Bad User! 0", "p1"}  # the bad tier owes no answer
    assert got["h0"].error_reply and got["h0"].dead_letter == "user_data"
    assert not got["h1"].error_reply and got["h1"].answered
    assert not got["h2"].answered and not got["p1"].answered
    assert got["p0"].dead_letter == "delivery_limit" and got["Bad User! 0"].dead_letter == "bad_notification"


def test_wait_answered_stops_when_all_are_answered_or_at_the_grace() -> None:
    now = [0.0]
    answered = ch.Outcome(ch.Injection(1, "poison", "p0", "inbox"), dead_letter="delivery_limit")
    waiting = ch.Outcome(ch.Injection(1, "poison", "p1", "state"))
    readings = iter([[waiting], [answered]])

    def sleep(s: float) -> None:
        now[0] += s

    assert ch.wait_answered(lambda: next(readings), 10, sleep, lambda: now[0]) == [answered]
    assert now[0] == 0.5
    assert ch.wait_answered(lambda: [waiting], 3, sleep, lambda: now[0]) == [waiting]
    assert now[0] == pytest.approx(3.5)


def _exit(worker: str, reason: str) -> LedgerEvent:
    return LedgerEvent(ts=1.0, tier="chat", epoch=1, commander="c", action="worker-exited",
                       reason=reason, victims=[worker])


def test_unexpected_exits_leave_out_chaos_kills_clean_exits_and_takeovers() -> None:
    events = [_exit("w1", "worker w1 exited (code -9); handed 2 users on"),  # chaos killed it
              _exit("w2", "worker w2 exited (code 0); handed 0 users on"),  # a drain won the race
              _exit("w3", "worker w3 exited (code 1), its log ends: ValueError; handed 1 user on"),
              _exit("w4", "the heartbeat of worker w4 expired; handed 1 user on"),
              _exit("w5", "worker w5 was killed; handed 0 users on"),
              LedgerEvent(ts=1.0, tier="chat", epoch=1, commander="c", action="scale-up",
                          reason="worker w6 exited (code 1)")]
    exits = ch.worker_exits(events)
    assert exits == [("w1", -9), ("w2", 0), ("w3", 1)]
    assert ch.unexpected_exits(exits, killed={"w1"}) == ["worker w3 exited (code 1)"]


def test_the_ledger_reason_of_a_crash_is_the_one_read() -> None:
    """The commander's own wording of an unasked exit (commander/dead_workers.py) is what
    ``worker_exits`` parses: a crash of a worker it started is seen."""
    from commander.dead_workers import DeadWorkers

    handle = type("Handle", (), {"killed": False, "exit_code": 1, "error": "ValueError: boom",
                                 "worker_id": "w9", "tier": "chat", "retire_reason": None})()
    dead = DeadWorkers.__new__(DeadWorkers)
    dead._dead = {}
    dead.exited(handle)  # type: ignore[arg-type]
    why = dead._dead["w9"]
    reason = f"{why.why}; handed 1 user on at once (1 lanes cleared, 1 notifications acked); consumer removed"
    assert ch.worker_exits([_exit("w9", reason)]) == [("w9", 1)]


def _section(**over: Any) -> dict[str, Any]:
    planned = ch.plan(1, 60)
    answers = [ch.Outcome(i, error_reply=i.kind == "wrong-type", dead_letter="user_data")
               for i in planned if ch.expects_answer(i)]
    args: dict[str, Any] = {"planned": planned, "done": planned, "answers": answers, "exits": [],
                            "errors": []} | over
    return ch.section(**args)


def test_the_section_passes_when_every_injection_is_answered() -> None:
    res = _section()
    assert res["failed"] == []
    assert res["turns"] == {"injected": 5, "error_reply": 5, "dead_lettered": 5, "ok_reply": 0,
                            "unanswered": 0}
    assert res["notifications"] == {"injected": 4, "dead_lettered": 4, "unanswered": 0}
    assert res["state_entries"] == 4 and res["injected"] == res["planned"] == 13


@pytest.mark.parametrize(("over", "why"), [
    ({"answers": [ch.Outcome(ch.Injection(1, "poison", "p0", "inbox"))]}, "never answered"),
    ({"answers": [ch.Outcome(ch.Injection(1, "wrong-type", "h0", "session"), ok_reply=True)]},
     "served as if nothing was wrong"),
    ({"exits": ["worker w3 exited (code 1)"]}, "exited on their own"),
    ({"done": [], "answers": []}, "injections not written (0/13)"),
    ({"errors": ["bad-tier x: ConnectionError"]}, "injections not written"),
], ids=["unanswered", "ok-reply", "exit", "not-written", "error"])
def test_the_section_fails_for_each_reason(over: dict[str, Any], why: str) -> None:
    res = _section(**over)
    assert len(res["failed"]) == 1 and why in res["failed"][0], res["failed"]


def test_a_commander_exit_known_at_the_end_fails_the_section(capsys: pytest.CaptureFixture[str]) -> None:
    res = ch.with_exits(_section(), ["commander chaos-1 exited (code 1)"])
    assert res["process_exits"] == ["commander chaos-1 exited (code 1)"]
    assert res["failed"] and "exited on their own" in res["failed"][0]
    ch.table(res)
    out = capsys.readouterr().out
    assert re.search(r"hostile: Fleet processes exited on their own +1 \(", out)
    assert "HOSTILE: FAILED: Fleet processes exited on their own" in out
    ch.table(_section())
    out = capsys.readouterr().out
    assert "unanswered 0" in out and "HOSTILE: every injection answered, no process exited" in out
