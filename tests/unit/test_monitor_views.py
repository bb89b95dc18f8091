"""The monitor's pure parts: what the page shows of tiers, workers, charts, the ledger and
users (table tests), the request checks, the board the commander publishes, and the auth."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from commander.decide import Plan
from commander.evaluator import Evaluator, rows_of
from commander.monitor import views
from commander.monitor.access import Access, cookie_value, grant, is_loopback, refusal
from commander.monitor.board import Board, Sample, TierSeen
from commander.monitor.views import BadRequest
from commander.snapshot import TierSnapshot, WorkerView
from protocol.groups import Group
from protocol.models import Counters, LedgerEvent, OccupancyReport, Slots, WorkerInfo
from protocol.policy import Policy, TurnsPolicy, turns_policy
from stores.ledger import CorruptEvent

NOW = 10_000.0


def report(worker: str, ts: float, busy: int = 0, turns: int = 0, handler_s: float = 0.0,
           cpu: float | None = 0.1, rss: int = 100, total: int = 4) -> OccupancyReport:
    return OccupancyReport(worker=worker, tier="chat", ts=ts, state="ready", users=busy, active_users=busy,
                           slots=Slots(busy=busy, total=total), cpu=cpu, rss=rss,
                           counters=Counters(turns=turns, handler_seconds=handler_s), load=(0, 0, 0))


def seen(tier: str = "chat", workers: tuple[WorkerView, ...] = (), error: str | None = None,
         ts: float = NOW, desired: int = 2, policy: Policy | None = None) -> TierSeen:
    snap = TierSnapshot(tier=tier, workers=workers, active_users=7, backlog=3, rps=1.23456, pressure_events=1)
    plan = Plan(tier=tier, current=len(workers), desired=desired, target=desired + 1,
                proposals={"users": 2, "rps": None}, reason="users 7 / 4")
    return TierSeen(tier=tier, ts=ts, policy=policy or TurnsPolicy(min_workers=1, max_workers=5),
                    source="key" if error is None else "last-good", error=error, snapshot=snap, plan=plan,
                    starting=sum(1 for w in workers if w.state == "starting"))


# --- tiers ------------------------------------------------------------------------------
@pytest.mark.parametrize(("workers", "error", "want"), [
    ((), None, {"ready": 0, "starting": 0, "draining": 0, "busy_slots": 0, "slots": 0, "policy_error": None}),
    ((WorkerView("a", busy=1, total=4), WorkerView("b", state="starting"), WorkerView("c", state="draining")),
     None, {"ready": 1, "starting": 1, "draining": 1, "busy_slots": 1, "slots": 4}),
    ((WorkerView("a"),), "max_workers: must be >= 0", {"policy_error": "max_workers: must be >= 0",
                                                       "policy_source": "last-good"}),
], ids=["empty", "states", "rejected-edit"])
def test_tier_json(workers: tuple[WorkerView, ...], error: str | None, want: dict[str, Any]) -> None:
    got = views.tier_json(seen(workers=workers, error=error), dead_letters=4)
    assert {k: got[k] for k in want} == want
    assert (got["desired"], got["target"], got["min_workers"], got["max_workers"]) == (2, 3, 1, 5)
    assert (got["backlog"], got["active_users"], got["rps"], got["pressure"]) == (3, 7, 1.235, 1)
    assert got["dead_letters"] == 4 and got["proposals"] == {"users": 2, "rps": None}
    assert got["policy"]["max_workers"] == 5 and got["reason"] == "users 7 / 4"


GROUPED = turns_policy(groups=(Group(name="blue", weight=90), Group(name="green", weight=10)), canary="green")


def board(green_rejected: str | None = None) -> dict[str, TierSeen]:
    """A pass over a grouped tier: blue's pool (two ready workers) and green's (one starting);
    the tier's own pool is not judged (it has no worker)."""
    return {"chat.blue": seen("chat.blue", workers=(WorkerView("b1"), WorkerView("b2"))),
            "chat.green": replace(seen("chat.green", workers=(WorkerView("g1", state="starting"),)),
                                  group_rejected=green_rejected)}


def row(group: str, share: float, weight: float, ready: int, canary: bool = False,
        rejected: str | None = None) -> dict[str, Any]:
    return {"group": group, "pool": f"chat.{group}", "weight": weight, "share": share, "canary": canary,
            "rejected": rejected, "ready": ready}


GROUPS = [row("blue", 90.0, 90, 2), row("green", 10.0, 10, 0, canary=True)]
WHY = "no module named app_v2"


@pytest.mark.parametrize(("tier", "rejected", "want"), [
    ("chat.green", None, {"groups": GROUPS, "canary": "green",
                          "group": {**row("green", 10.0, 10, 0, canary=True), "tier": "chat"}}),
    ("chat.blue", None, {"groups": GROUPS, "canary": "green",
                         "group": {**row("blue", 90.0, 90, 2), "tier": "chat"}}),
    # a rejected group's users go to the others: its share is 0 whatever its weight
    ("chat.blue", WHY, {"groups": [row("blue", 100.0, 90, 2),
                                   row("green", 0.0, 10, 0, canary=True, rejected=WHY)],
                        "canary": "green", "group": {**row("blue", 100.0, 90, 2), "tier": "chat"}}),
    # the policy no longer names the pool's group: it drains
    ("chat.red", None, {"groups": GROUPS, "canary": "green",
                        "group": {"group": "red", "pool": "chat.red", "tier": "chat", "removed": True}}),
    # the tier's own pool, judged while its workers drain after groups were given to it
    ("chat", None, {"groups": GROUPS, "canary": "green"}),
], ids=["canary-pool", "blue-pool", "rejected-group", "removed-group", "tier-own-pool"])
def test_a_group_pool_shows_its_tiers_groups_and_its_own(tier: str, rejected: str | None,
                                                         want: dict[str, Any]) -> None:
    tiers = board(rejected)
    got = views.tier_json(tiers.get(tier) or seen(tier), 0, tiers, {"chat": GROUPED})
    assert {k: got[k] for k in ("groups", "group", "canary") if k in got} == want


def test_a_tier_without_groups_or_a_pool_whose_policy_was_not_read_shows_no_group() -> None:
    got = views.tier_json(seen(), 0, {"chat": seen()}, {})
    assert not {"groups", "group", "canary"} & set(got)
    assert not {"groups", "group"} & set(views.tier_json(seen("chat.green"), 0, board(), {}))


@pytest.mark.parametrize(("holder", "want"), [
    (None, {"leader": None, "epoch": None, "leader_url": None}),
    ("c1|4", {"leader": "c1", "epoch": 4, "leader_url": "http://127.0.0.1:9464/"}),
    ("c2|1", {"leader": "c2", "epoch": 1, "leader_url": None}),  # registered without an address
    ("odd", {"leader": "odd", "epoch": None, "leader_url": None}),
])
def test_leader_json(holder: str | None, want: dict[str, Any]) -> None:
    commanders = [{"commander": "c1", "monitor_url": "http://127.0.0.1:9464/"},
                  {"commander": "c2", "monitor_url": None}]
    assert views.leader_json(holder, commanders) == want


# --- workers ----------------------------------------------------------------------------
def test_worker_json_with_a_window_has_components_rates_and_history() -> None:
    window = rows_of([report("w", NOW - 3 + i, busy=i, turns=10 * i, handler_s=0.5 * i) for i in range(4)])
    info = WorkerInfo(worker="w", tier="chat", pid=42, host="h1", started=NOW - 100)
    view = WorkerView("w", occupancy=0.5, busy=3, total=4, started=NOW - 100, is_reception=True)
    got = views.worker_json(view, "chat", window, info, None, NOW)
    assert (got["pid"], got["host"], got["age_s"], got["reception"]) == (42, "h1", 100.0, True)
    assert got["turns_per_s"] == 10.0 and got["handler_s_per_turn"] == 0.05
    assert got["cpu"] == 0.1 and got["memory"] is None and got["report_age_s"] == 0.0
    # per report, in percent: the max component (cpu 10 %, then the slots)
    assert got["history"] == [10, 25, 50, 75] and got["history_span_s"] == 3.0


@pytest.mark.parametrize(("limit", "rss", "want_memory"), [(None, 100, None), (1000.0, 500, 0.5)])
def test_worker_memory_is_a_component_only_with_a_limit(limit: float | None, rss: int,
                                                       want_memory: float | None) -> None:
    got = views.worker_json(WorkerView("w"), "chat", rows_of([report("w", NOW, rss=rss)]), None, limit, NOW)
    assert got["memory"] == want_memory and got["pid"] is None


def test_a_worker_without_reports_has_an_empty_history_and_no_rates() -> None:
    got = views.worker_json(WorkerView("w", state="starting", fresh=False), "chat", (), None, None, NOW)
    assert got["history"] == [] and "turns_per_s" not in got and got["age_s"] is None


def test_the_worker_list_filters_by_tier_and_takes_the_registry() -> None:
    board = Board()
    ev = Evaluator()
    ev.add(report("a", NOW))
    board.tier(seen("chat", (WorkerView("a"),)))
    board.tier(seen("batch", (WorkerView("b"),)))
    board.publish(NOW, {"a": (WorkerInfo(worker="a", tier="chat", pid=1, host="h", started=0), True)}, ev)
    assert board.seen is not None
    assert [w["worker"] for w in views.workers_page(board.seen, NOW)["workers"]] == ["b", "a"]  # batch first
    only = views.workers_page(board.seen, NOW, "chat")["workers"]
    assert [(w["worker"], w["pid"], len(w["history"])) for w in only] == [("a", 1, 1)]


@pytest.mark.parametrize(("tier", "offset", "limit", "want", "total", "next_offset"), [
    (None, 0, 100, ["b1", "b2", "a1", "a2", "a3"], 5, None),
    (None, 0, 2, ["b1", "b2"], 5, 2),
    (None, 2, 2, ["a1", "a2"], 5, 4),
    (None, 4, 2, ["a3"], 5, None),
    (None, 9, 2, [], 5, None),
    ("chat", 1, 1, ["a2"], 3, 2),
    ("other", 0, 10, [], 0, None),
], ids=["all", "first", "middle", "last", "past-the-end", "one-tier", "no-such-tier"])
def test_the_worker_list_pages_by_tier_then_id(tier: str | None, offset: int, limit: int, want: list[str],
                                               total: int, next_offset: int | None) -> None:
    board = Board()
    board.tier(seen("chat", (WorkerView("a3"), WorkerView("a1"), WorkerView("a2"))))
    board.tier(seen("batch", (WorkerView("b2"), WorkerView("b1"))))
    board.publish(NOW, {}, Evaluator())
    assert board.seen is not None
    page = views.workers_page(board.seen, NOW, tier, offset, limit)
    assert [w["worker"] for w in page["workers"]] == want
    assert (page["total"], page["next_offset"]) == (total, next_offset)
    assert (page["offset"], page["limit"]) == (offset, limit)


def test_problems_are_the_leaders_crash_loops_and_the_handlers_live_workers_cannot_load() -> None:
    board = Board()
    info = lambda w, errors: WorkerInfo(worker=w, tier="chat", pid=1, host="h", started=0,  # noqa: E731
                                        handler_errors=errors)
    board.publish(NOW, {"a": (info("a", {"bot": "ImportError: no module x"}), True),
                        "b": (info("b", {"bot": "ImportError: no module x"}), True),
                        "c": (info("c", {"old": "gone"}), False)}, Evaluator())  # (a dead worker's)
    assert board.seen is not None
    commanders = {"leader": "c1|7",
                  "list": [{"commander": "c1", "crash_loop": {"chat": "exited with code 1: boom"}},
                           {"commander": "c2", "crash_loop": {"chat": "a standby's"}}]}
    assert views.problems_json(board.seen, commanders) == [
        {"kind": "crash-loop", "where": "chat", "text": "tier chat crash loop: exited with code 1: boom"},
        {"kind": "handler-unavailable", "where": "bot",
         "text": "handler bot unavailable on 2 workers (a, b): ImportError: no module x"}]
    # the commanders not read: the handlers are still shown
    assert [p["kind"] for p in views.problems_json(board.seen, {})] == ["handler-unavailable"]


# --- the board and the chart ------------------------------------------------------------
def test_board_samples_every_few_seconds_keeps_an_hour_and_publishes_generations() -> None:
    board = Board(sample_every_s=5.0, keep_s=60.0)
    for i in range(30):  # a pass every 2 s for 60 s
        board.tier(seen(ts=NOW + 2 * i))
        board.publish(NOW + 2 * i, {}, Evaluator())
    got = board.samples("chat")
    assert all(b.ts - a.ts >= 5.0 for a, b in zip(got, got[1:], strict=False))
    assert got[-1].ts - got[0].ts <= 60.0 and board.samples("chat", since=NOW + 50)[0].ts >= NOW + 50
    assert board.seen is not None and board.seen.generation == 30
    board.publish(NOW + 200, {}, Evaluator())  # the tier is gone for longer than the span
    assert board.samples("chat") == [] and board.seen is not None and board.seen.tiers == {}


def _event(ts: float, action: str, to: int, desired: int | None = None) -> tuple[str, LedgerEvent]:
    why = {} if desired is None else {"desired": desired}
    return f"{int(ts * 1000)}-0", LedgerEvent(ts=ts, tier="chat", epoch=1, commander="c1", action=action,
                                              from_count=to - 1, to_count=to, why=why)


@pytest.mark.parametrize(("samples_from", "want_ledger"), [
    (None, [[NOW - 3000, 2, 3], [NOW - 2000, 4, 4]]),  # no samples: every scale event is drawn
    (NOW - 2500, [[NOW - 3000, 2, 3]]),  # samples cover the rest: only the events before them
])
def test_chart_takes_the_ledger_before_the_commanders_own_samples(samples_from: float | None,
                                                                  want_ledger: list[list[float]]) -> None:
    events = [_event(NOW - 3000, "scale-up", 2, 3), _event(NOW - 2500, "hold", 2),
              _event(NOW - 2000, "scale-up", 4), ("1-0", CorruptEvent("chat", "bad"))]
    samples = [] if samples_from is None else [
        Sample(samples_from, 2, 1, 0, 3, 3, 9, 2, 1.5, 3)]
    got = views.chart_json("chat", samples, events, NOW - 3600, NOW)
    assert got["ledger"] == want_ledger
    assert got["samples"] == ([] if samples_from is None else [[samples_from, 2, 1, 0, 3, 3, 9, 2, 1.5, 3]])
    assert got["columns"][0] == "ts" and len(got["columns"]) == 10


def test_ledger_json_is_newest_first_and_keeps_corrupt_entries() -> None:
    entries = [_event(NOW - 2, "scale-up", 2), ("5-0", CorruptEvent("chat", "no field 'm'"))]
    got = views.ledger_json(entries)
    assert [e["id"] for e in got] == ["5-0", f"{int((NOW - 2) * 1000)}-0"]
    assert got[0]["corrupt"] == "no field 'm'" and views.corrupt_count(entries) == 1


def test_dead_letter_json_decodes_the_fields_and_the_payload() -> None:
    rows = [{"id": "1-0", "user": "alice", "reason": "max attempts", "payload": '{"text": "hi"}'},
            {"id": "2-0", "user": "bob", "payload": "not json"}]
    got = views.dead_letter_json(rows)
    assert got[0] == {"id": "1-0", "user": "alice", "reason": "max attempts", "payload": {"text": "hi"}}
    assert got[1]["payload"].startswith("not json")


@pytest.mark.parametrize(("outcomes", "want"), [
    ([{"id": "1-0", "outcome": "retried"}], "retried 1 of 1"),
    ([], "retried 0 of 0"),
    # a row the page still showed after someone else purged it: nothing was retried, and it says so
    ([{"id": "9-9", "outcome": "unknown", "reason": "no dead letter 9-9 in tier chat"}],
     "retried 0 of 1; not retried: 9-9 (no dead letter 9-9 in tier chat)"),
    ([{"id": "1-0", "outcome": "retried"},
      {"id": "2-0", "outcome": "not_retriable", "reason": "cannot retry: the turn's text was not kept"}],
     "retried 1 of 2; not retried: 2-0 (cannot retry: the turn's text was not kept)"),
    ([{"id": f"{i}-0", "outcome": "unknown", "reason": "gone"} for i in range(5)],
     "retried 0 of 5; not retried: 0-0 (gone), 1-0 (gone), 2-0 (gone) and 2 more"),
])
def test_retry_summary_counts_only_the_turns_retried(outcomes: list[dict[str, Any]], want: str) -> None:
    assert views.retry_summary(outcomes) == want


# --- population -------------------------------------------------------------------------
ROWS = [{"user": "alice", "turns": 5, "errors": 0}, {"user": "bob", "turns": 9, "errors": 2},
        {"user": "carol", "turns": 1}, {"user": "alfred", "turns": 7, "errors": 1}]


@pytest.mark.parametrize(("q", "sort", "want"), [
    ("", "turns", ["bob", "alfred", "alice", "carol"]),  # numbers: high first
    ("", "-turns", ["bob", "alfred", "alice", "carol"]),
    ("AL", "user", ["alfred", "alice"]),  # a case-blind substring; users alphabetically
    ("", "-user", ["carol", "bob", "alice", "alfred"]),
    ("", "errors", ["bob", "alfred", "alice", "carol"]),  # a missing value sorts last
    ("zed", "turns", []),
])
def test_population_filters_and_sorts(q: str, sort: str, want: list[str]) -> None:
    assert [row["user"] for row in views.population(ROWS, q, sort)] == want


def test_population_refuses_an_unknown_column() -> None:
    with pytest.raises(BadRequest, match="unknown sort column 'password'"):
        views.population(ROWS, "", "password")


def test_plain_takes_to_json_models_and_dataclasses() -> None:
    class WithJson:
        def to_json(self) -> dict[str, int]:
            return {"a": 1}

    assert views.plain(WithJson()) == {"a": 1}
    assert views.plain(Sample(1.0, 1, 0, 0, 1, 1, 0, 0, 0.0, 0))["ready"] == 1
    assert views.plain(Slots(busy=1, total=2))["total"] == 2
    assert views.plain(3) == 3


# --- request checks ---------------------------------------------------------------------
@pytest.mark.parametrize(("body", "want"), [
    ({"tier": "chat", "ids": ["1-0", "2-5"]}, ("chat", ["1-0", "2-5"])),
    ({"tier": "chat", "all": True}, ("chat", None)),
])
def test_dead_letter_request(body: Any, want: tuple[str, list[str] | None]) -> None:
    assert views.dead_letter_request(body) == want


@pytest.mark.parametrize(("body", "match"), [
    ([], "JSON object"),
    ({"tier": "Bad Tier", "all": True}, "invalid tier"),
    ({"tier": "chat"}, "give the dead letters' ids"),
    ({"tier": "chat", "ids": []}, "give the dead letters' ids"),
    ({"tier": "chat", "ids": ["1-0"], "all": True}, "not both"),
    ({"tier": "chat", "ids": ["x"]}, "not a stream entry id"),
    ({"tier": "chat", "ids": [1]}, "not a stream entry id"),
    ({"tier": "chat", "ids": ["1-0"] * 1001}, "at most 1000"),
])
def test_dead_letter_request_refuses(body: Any, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        views.dead_letter_request(body)


@pytest.mark.parametrize(("body", "want"), [
    ({"queue": "writeback", "ids": ["fleet-0123abcd-0"]}, ("writeback", ["fleet-0123abcd-0"])),
    ({"queue": "writeback", "all": True}, ("writeback", None)),
])
def test_requeue_request(body: Any, want: tuple[str, list[str] | None]) -> None:
    assert views.requeue_request(body) == want


@pytest.mark.parametrize(("body", "match"), [
    ("x", "JSON object {queue, ids}"),
    ({"queue": "Bad Queue", "all": True}, "invalid queue"),
    ({"queue": "writeback"}, "give the failed jobs' ids"),
    ({"queue": "writeback", "ids": ["a"], "all": True}, "not both"),
    ({"queue": "writeback", "ids": ["a b"]}, "not an RQ job id"),
    ({"queue": "writeback", "ids": ["x" * 129]}, "not an RQ job id"),
    ({"queue": "writeback", "ids": ["a"] * 1001}, "at most 1000"),
])
def test_requeue_request_refuses(body: Any, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        views.requeue_request(body)


def test_queue_param() -> None:
    assert views.queue_param("writeback") == "writeback"
    for bad, match in ((None, "give a queue"), ("", "give a queue"), ("rq:queue:x", "invalid queue")):
        with pytest.raises(BadRequest, match=match):
            views.queue_param(bad)


@pytest.mark.parametrize(("value", "want"), [(None, 50), ("", 50), ("10", 10), ("5000", 1000)])
def test_count_param(value: str | None, want: int) -> None:
    assert views.count_param(value, 50, 1000) == want


def test_offset_param() -> None:
    assert [views.offset_param(v) for v in (None, "", "0", "250")] == [0, 0, 0, 250]
    for bad in ("-1", "1.5", "x", "²"):
        with pytest.raises(views.BadRequest, match="offset"):
            views.offset_param(bad)


@pytest.mark.parametrize("value", ["0", "-1", "ten", "²"])
def test_count_param_refuses(value: str) -> None:
    with pytest.raises(BadRequest, match="positive integer"):
        views.count_param(value, 50, 1000)


def test_tier_and_user_params() -> None:
    assert views.tier_param(None) is None and views.tier_param("chat") == "chat"
    with pytest.raises(BadRequest, match="give a tier"):
        views.tier_param("", required=True)
    with pytest.raises(BadRequest, match="invalid tier"):
        views.tier_param("../etc")
    # a group's pool is a row of its own: its workers, chart and ledger are asked for by its name
    assert views.tier_param("chat.green", pools=True) == "chat.green"
    assert views.tier_param("chat", pools=True) == "chat"
    for bad in ("chat.", "chat.Green!", "../etc"):
        with pytest.raises(BadRequest, match="invalid"):
            views.tier_param(bad, pools=True)
    with pytest.raises(BadRequest, match="invalid tier"):
        views.tier_param("chat.green")  # dead letters and users are a tier's
    assert views.user_param("alice@x") == "alice@x"
    with pytest.raises(BadRequest, match="invalid user id"):
        views.user_param("a b")


# --- auth -------------------------------------------------------------------------------
BOTH = Access(read_token="r3ad", operator_token="0per")


@pytest.mark.parametrize(("header", "cookie", "access", "want"), [
    (None, None, Access(), "write"),  # no token: loopback-only and Host-checked, open
    (None, None, Access(read_token="s3cret"), "none"),
    ("Bearer s3cret", None, Access(read_token="s3cret"), "read"),
    ("Bearer wrong", None, Access(read_token="s3cret"), "none"),
    ("s3cret", None, Access(read_token="s3cret"), "none"),  # the scheme is required
    (None, cookie_value("s3cret"), Access(read_token="s3cret"), "read"),
    (None, "s3cret", Access(read_token="s3cret"), "none"),  # the cookie is a keyed hash, never the token
    (None, cookie_value("other"), Access(read_token="s3cret"), "none"),
    ("Bearer r3ad", None, BOTH, "read"),
    ("Bearer 0per", None, BOTH, "write"),
    (None, cookie_value("0per"), BOTH, "write"),
    ("Bearer 0per", None, Access(operator_token="0per"), "write"),
    (None, None, Access(operator_token="0per"), "none"),  # the operator token alone guards reads too
])
def test_grant(header: str | None, cookie: str | None, access: Access, want: str) -> None:
    assert grant(header, cookie, access) == want


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False), ("fleet.example", False)])
def test_a_bind_beyond_loopback_needs_a_token(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    why = refusal(host, Access())
    assert (why is None) is loopback
    if why is not None:
        assert "FLEET_COMMANDER_OPERATOR_TOKEN" in why and "\n" not in why
    assert refusal(host, Access(read_token="t")) is None


@pytest.mark.parametrize(("host", "allowed"), [
    ("127.0.0.1:9464", True), ("localhost", True), ("LOCALHOST:1", True), ("[::1]:9464", True),
    ("fleet.internal:8080", True), ("evil.example", False), ("127.0.0.1.evil.example", False),
    ("", False), ("[::1", False)])
def test_which_hosts_a_tokenless_monitor_answers(host: str, allowed: bool) -> None:
    assert Access(allowed_hosts=("fleet.internal",)).host_allowed(host) is allowed


def test_the_board_publishes_each_registry_and_every_window_as_they_are_at_the_pass() -> None:
    """A pass publishes a copy of its registry, made once while the registry is the same object,
    and every worker's window as the evaluator has it then (a later report is not in it)."""
    board, ev = Board(), Evaluator()
    info = WorkerInfo(worker="w1", tier="chat", pid=1, host="h", started=0.0)
    first, second = {"w1": (info, True)}, {"w1": (info, False)}
    ev.add(OccupancyReport(worker="w1", tier="chat", ts=1.0, state="ready", users=0, active_users=0,
                           slots=Slots(busy=0, total=4), cpu=None, rss=1, counters=Counters(),
                           load=(0.0, 0.0, 0.0)))
    board.publish(1.0, first, ev)
    seen = board.seen
    assert seen is not None and seen.registry == first and len(seen.windows["w1"]) == 1
    ev.add(OccupancyReport(worker="w1", tier="chat", ts=2.0, state="ready", users=0, active_users=0,
                           slots=Slots(busy=1, total=4), cpu=0.1, rss=1, counters=Counters(),
                           load=(0.0, 0.0, 0.0)))
    assert len(seen.windows["w1"]) == 1  # (what was published stays as it was)
    board.publish(2.0, first, ev)
    again = board.seen
    assert again is not None and again.registry is seen.registry and len(again.windows["w1"]) == 2
    board.publish(3.0, second, ev)
    assert board.seen is not None and board.seen.registry == second
