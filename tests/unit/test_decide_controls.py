"""The policy controls in ``decide``, as tables: scheduled bounds, pause, rate limits,
fallback, disruption budget, protection, recycling, and the derived scale-in hold."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from commander import holdtime
from commander.bounds import in_force, tier_bounds
from commander.decide import Plan, TierState, decide
from commander.limits import budget_room, down_limit, up_limit
from commander.snapshot import TierSnapshot, WorkerView, classify
from protocol.policy import PolicyError, ScaleRules, parse_policy, turns_policy
from protocol.policy_controls import DisruptionBudget, ScaleBehavior, ScheduledBounds

MON = datetime(2024, 1, 8, tzinfo=UTC).timestamp()  # Monday 2024-01-08 00:00 UTC
NOW = MON + 12 * 3600


def policy(**changes: Any) -> ScaleRules:
    """Occupancy, buffer and pressure only; immediate scale-in (as in test_decide)."""
    base: dict[str, Any] = {"users_per_instance": None, "target_backlog_per_worker": None,
                            "min_workers": 1, "max_workers": 10, "scale_down_stabilization_s": 0.0}
    base.update(changes)
    return turns_policy(**base).scale_rules()


def wk(i: int, occ: float = 0.0, *, state: str = "ready", fresh: bool = True, started: float | None = None,
       **extra: Any) -> WorkerView:
    busy = 0 if occ == 0 else max(1, round(occ * 8))
    return WorkerView(id=f"w{i}", state=state, occupancy=occ, busy=busy, total=8, lanes=busy,  # type: ignore[arg-type]
                      fresh=fresh, started=NOW - 100 + i if started is None else started, **extra)


def snap(*workers: WorkerView, **signals: Any) -> TierSnapshot:
    return TierSnapshot("chat", tuple(workers), **signals)


def run(s: TierSnapshot, pol: ScaleRules, state: TierState | None = None,
        now: float = NOW) -> tuple[Plan, TierState]:
    return decide(s, pol, state or TierState(), now)


def moves(plan: Plan) -> tuple[int, list[tuple[str, str]]]:
    return plan.spawn, [(r.worker, r.action) for r in plan.retire]


def _with(schedule: ScheduledBounds, **changes: Any) -> ScheduledBounds:
    return schedule.model_copy(update=changes)


IDLE3 = snap(wk(0), wk(1), wk(2))
SATURATED = snap(wk(0, 0.9), wk(1, 0.9))

# --- scheduled floors and caps -----------------------------------------------------------
WEEKDAYS_9_18 = ScheduledBounds(start="0 9 * * 1-5", end="0 18 * * 1-5", min_workers=5)
NIGHT_CAP = ScheduledBounds(start="0 22 * * *", end="0 6 * * *", max_workers=2, name="night")


@pytest.mark.parametrize(
    ("schedule", "when", "active"),
    [
        (WEEKDAYS_9_18, MON + 8 * 3600 + 3599, False),
        (WEEKDAYS_9_18, MON + 9 * 3600, True),  # a fire exactly now counts
        (WEEKDAYS_9_18, MON + 17 * 3600 + 3599, True),
        (WEEKDAYS_9_18, MON + 18 * 3600, False),
        (WEEKDAYS_9_18, MON + 5 * 86400 + 10 * 3600, False),  # Saturday
        (NIGHT_CAP, MON + 23 * 3600, True),
        (NIGHT_CAP, MON + 86400 + 3 * 3600, True),  # across midnight
        (NIGHT_CAP, MON + 86400 + 7 * 3600, False),
        # Paris in summer is UTC+2: 09:00 there is 07:00 UTC
        (_with(WEEKDAYS_9_18, timezone="Europe/Paris"),
         datetime(2024, 7, 8, 7, 30, tzinfo=UTC).timestamp(), True),
        (_with(WEEKDAYS_9_18, timezone="Europe/Paris"),
         datetime(2024, 7, 8, 6, 30, tzinfo=UTC).timestamp(), False),
    ],
)
def test_schedule_in_force(schedule: ScheduledBounds, when: float, active: bool) -> None:
    assert in_force(schedule, when) is active


def test_schedule_follows_daylight_saving() -> None:
    paris = _with(WEEKDAYS_9_18, timezone="Europe/Paris")
    for day in (datetime(2024, 1, 8, 9, 0, 30), datetime(2024, 7, 8, 9, 0, 30)):
        when = day.replace(tzinfo=ZoneInfo("Europe/Paris")).timestamp()
        assert in_force(paris, when) and not in_force(paris, when - 60)


@pytest.mark.parametrize(
    ("schedules", "when", "floor", "cap", "by"),
    [
        ((), NOW, 1, 10, "min_workers"),
        ((WEEKDAYS_9_18,), NOW, 5, 10, "schedule 0 9 * * 1-5 .. 0 18 * * 1-5 UTC"),
        ((WEEKDAYS_9_18, NIGHT_CAP), MON + 23 * 3600, 1, 2, "min_workers"),
        ((_with(WEEKDAYS_9_18, start="0 21 * * *", end="0 23 * * *"), NIGHT_CAP),
         MON + 22 * 3600 + 60, 2, 2, "schedule night"),  # a floor above the cap: the cap wins
    ],
)
def test_tier_bounds(schedules: tuple[ScheduledBounds, ...], when: float, floor: int, cap: int,
                     by: str) -> None:
    b = tier_bounds(policy(schedules=schedules), when)
    assert (b.floor, b.cap, b.floor_by) == (floor, cap, by)


# --- every control on one table -------------------------------------------------------------
B1 = {"type": "workers", "value": 1, "period_s": 60}
CASES: list[tuple[str, dict[str, Any], TierSnapshot, TierState, int, list[tuple[str, str]], str]] = [
    # name, policy changes, snapshot, state, spawn, retirements, a word of the reason
    ("scheduled floor spawns", {"schedules": (WEEKDAYS_9_18,)}, IDLE3, TierState(), 2, [], "schedule"),
    ("scheduled cap retires", {"schedules": (_with(WEEKDAYS_9_18, min_workers=None,
                                                                max_workers=1),)},
     snap(wk(0, 0.1), wk(1), wk(2)), TierState(), 0, [("w1", "reclaim-idle"), ("w2", "reclaim-idle")],
     "scale in"),
    ("paused: saturated, no spawn", {"paused": True}, SATURATED, TierState(), 0, [], "paused"),
    ("paused: idle, no retire", {"paused": True}, IDLE3, TierState(), 0, [], "paused"),
    ("paused_scale_in keeps idle workers", {"paused_scale_in": True}, IDLE3, TierState(), 0, [], "paused"),
    ("paused_scale_in still scales up", {"paused_scale_in": True}, SATURATED, TierState(), 1, [], "scale up"),
    ("up rule: one per minute, used", {"scale_up": {"rules": [B1]}}, SATURATED,
     TierState(changes=((NOW - 30, 1),)), 0, [], "rate limit"),
    ("up rule: one per minute, free", {"scale_up": {"rules": [B1]}}, SATURATED,
     TierState(changes=((NOW - 61, 1),)), 1, [], "scale up"),
    ("up disabled", {"scale_up": {"select": "disabled"}}, SATURATED, TierState(), 0, [], "rate limit"),
    ("down rule: one per minute", {"scale_down": {"rules": [B1]}}, IDLE3, TierState(), 0,
     [("w1", "reclaim-idle")], "rate limit"),
    ("down rule: used up", {"scale_down": {"rules": [B1]}}, IDLE3, TierState(changes=((NOW - 5, -1),)),
     0, [], "rate limit"),
    ("down disabled", {"scale_down": {"select": "disabled"}}, IDLE3, TierState(), 0, [], "disabled"),
    ("budget: one draining already", {"disruption_budget": {"workers": 1}},
     snap(wk(0), wk(1), wk(2), wk(3, state="draining")), TierState(), 0, [], "budget"),
    ("budget: 50 % of 4 is 2", {"disruption_budget": {"percent": 50}},
     snap(wk(0), wk(1), wk(2), wk(3)), TierState(), 0, [("w1", "reclaim-idle"), ("w2", "reclaim-idle")],
     "budget"),
    ("protected idle worker stays", {}, snap(wk(0), wk(1, protected_until=NOW + 60), wk(2)), TierState(),
     0, [("w2", "reclaim-idle")], "scale in"),
    ("expired protection", {}, snap(wk(0), wk(1, protected_until=NOW - 1)), TierState(), 0,
     [("w1", "reclaim-idle")], "scale in"),
    ("protected workers are not consolidated", {},
     snap(wk(0, 0.1), wk(1, 0.05, protected_until=NOW + 9), wk(2, 0.05, protected_until=NOW + 9)),
     TierState(), 0, [], "protected"),
    ("fallback hold after 3 failures", {"fallback": {"after": 3}},
     snap(wk(0, 0.9, fresh=False), wk(1, 0.9, fresh=False), pressure_events=5),
     TierState(failures=2, failed_at=NOW - 1), 0, [], "fallback"),
    ("fallback fixed: up to 4", {"fallback": {"after": 3, "action": "fixed", "workers": 4}},
     snap(wk(0, fresh=False), wk(1, fresh=False)), TierState(failures=2, failed_at=NOW - 1), 2, [],
     "fallback"),
    ("fallback fixed never scales in", {"fallback": {"after": 1, "action": "fixed", "workers": 1}},
     snap(wk(0, fresh=False), wk(1, fresh=False), wk(2)), TierState(), 0, [], "fallback"),
    ("before the fallback: pressure still spawns", {"fallback": {"after": 3}},
     snap(wk(0, 0.9, fresh=False), wk(1, 0.9, fresh=False), pressure_events=5, backlog=5), TierState(), 1, [],
     "scale up"),
    ("signals unread: no scale-in", {}, snap(wk(0), wk(1), observed=False), TierState(), 0, [], "read"),
    ("recycle: start the replacement", {"max_worker_age_s": 3600},
     snap(wk(0, 0.3, started=NOW - 4000), wk(1, 0.3, started=NOW - 100)), TierState(), 1, [], "recycle"),
    ("recycle: wait while it starts", {"max_worker_age_s": 3600},
     snap(wk(0, 0.3, started=NOW - 4000), wk(1, 0.3, started=NOW - 100),
          wk(2, state="starting", fresh=False)),
     TierState(recycling=(("w0", NOW - 1, "replacing"),)), 0, [], "starting"),
    ("recycle: drain once it is up", {"max_worker_age_s": 3600},
     snap(wk(0, 0.3, started=NOW - 4000), wk(1, 0.3, started=NOW - 100), wk(2, 0.0, started=NOW - 1)),
     TierState(recycling=(("w0", NOW - 2, "replacing"),)), 0, [("w0", "recycle")], "recycle"),
    ("recycle by turns", {"max_turns_per_worker": 1000},
     snap(wk(0, 0.3, turns=1000), wk(1, 0.3, turns=10)), TierState(), 1, [], "served 1000 turns"),
    ("recycle waits for the budget", {"max_worker_age_s": 3600, "disruption_budget": {"workers": 1}},
     snap(wk(0, 0.3, started=NOW - 4000), wk(1, 0.3), wk(2, 0.3), wk(4, 0.3), wk(3, state="draining")),
     TierState(recycling=(("w0", NOW - 200, "replacing"),)), 0, [], "budget"),
]


@pytest.mark.parametrize(("name", "changes", "s", "state", "spawn", "retire", "word"), CASES,
                         ids=[c[0] for c in CASES])
def test_controls(name: str, changes: dict[str, Any], s: TierSnapshot, state: TierState, spawn: int,
                  retire: list[tuple[str, str]], word: str) -> None:
    plan, after = run(s, policy(**changes), state)
    assert moves(plan) == (spawn, retire), plan.reason
    assert word in plan.reason, plan.reason
    assert run(s, policy(**changes), state) == (plan, after)  # deterministic
    assert decide(s, policy(**changes), after, NOW)[1] == after  # a repeat changes nothing more


def test_recycling_is_remembered_and_not_a_scale_event() -> None:
    pol = policy(max_worker_age_s=3600, scale_up={"rules": [B1]})
    plan, state = run(snap(wk(0, 0.3, started=NOW - 4000), wk(1, 0.3)), pol)
    assert plan.spawn == 1 and state.recycling == (("w0", NOW, "replacing"),) and state.changes == ()


def test_failures_count_once_per_pass_and_reset() -> None:
    pol, bad = policy(fallback={"after": 2}), snap(wk(0, fresh=False))
    _, s1 = run(bad, pol, now=NOW)
    _, s1b = run(bad, pol, s1, now=NOW)
    _, s2 = run(bad, pol, s1b, now=NOW + 1)
    assert (s1.failures, s1b.failures, s2.failures) == (1, 1, 2)
    plan, s3 = run(snap(wk(0)), pol, s2, now=NOW + 2)
    assert s3.failures == 0 and plan.failures == 0


# --- the pieces ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("behavior", "current", "changes", "expected"),
    [
        ({}, 4, (), None),
        ({"rules": [{"type": "workers", "value": 2, "period_s": 60}]}, 4, ((NOW - 10, 1),), 5),
        ({"rules": [{"type": "percent", "value": 100, "period_s": 60}]}, 4, (), 8),
        ({"rules": [{"type": "percent", "value": 50, "period_s": 60}]}, 3, (), 5),  # 4.5 rounds up
        ({"rules": [{"type": "workers", "value": 4, "period_s": 60},
                    {"type": "percent", "value": 100, "period_s": 60}]}, 2, (), 6),  # max
        ({"select": "min", "rules": [{"type": "workers", "value": 4, "period_s": 60},
                                     {"type": "percent", "value": 100, "period_s": 60}]}, 2, (), 4),
        ({"select": "disabled"}, 3, (), 3),
    ],
)
def test_up_limit(behavior: dict[str, Any], current: int, changes: tuple[tuple[float, int], ...],
                  expected: int | None) -> None:
    assert up_limit(ScaleBehavior.model_validate(behavior), current, changes, NOW) == expected


@pytest.mark.parametrize(
    ("behavior", "current", "changes", "expected"),
    [
        ({"rules": [{"type": "workers", "value": 1, "period_s": 60}]}, 4, ((NOW - 10, -1),), 4),
        ({"rules": [{"type": "percent", "value": 50, "period_s": 60}]}, 5, (), 2),  # 2.5 rounds down
        ({"rules": [{"type": "workers", "value": 1, "period_s": 60},
                    {"type": "percent", "value": 50, "period_s": 60}]}, 8, (), 4),  # max: the most change
        ({"select": "min", "rules": [{"type": "workers", "value": 1, "period_s": 60},
                                     {"type": "percent", "value": 50, "period_s": 60}]}, 8, (), 7),
    ],
)
def test_down_limit(behavior: dict[str, Any], current: int, changes: tuple[tuple[float, int], ...],
                    expected: int) -> None:
    assert down_limit(ScaleBehavior.model_validate(behavior), current, changes, NOW) == expected


@pytest.mark.parametrize(
    ("budget", "draining", "room"),
    [(None, 0, None), ({"workers": 2}, 1, 1), ({"workers": 0}, 0, 0), ({"percent": 25}, 0, 2),
     ({"percent": 10}, 1, 0)],
)
def test_budget_room(budget: dict[str, Any] | None, draining: int, room: int | None) -> None:
    workers = tuple(wk(i) for i in range(6)) + tuple(wk(10 + i, state="draining") for i in range(draining))
    b = None if budget is None else DisruptionBudget.model_validate(budget)
    assert budget_room(b, classify(workers)) == room


@pytest.mark.parametrize(
    ("changes", "start_s", "rate", "seconds", "rule"),
    [
        ({"scale_down_stabilization_s": 300.0}, 0.1, 1.0, 300.0, "fixed"),
        ({}, None, 1.0, 300.0, "unmeasured"),
        ({}, 0.1, 1.4, 30.0, "break-even"),  # a fork: the measurement window (6 x 5 s)
        ({"report_interval_s": 1.0}, 0.1, 1.4, 15.0, "break-even"),  # ... or min_s
        ({}, 10.0, 1.4, 80.0, "break-even"),  # a container: 10 + 1.4 x 100 / 2
        ({}, 180.0, 1.0, 1800.0, "break-even"),  # a GPU worker: capped at max_s
        ({"scale_in_hold": {"max_s": 7200}}, 180.0, 1.0, 7200.0, "break-even"),
    ],
)
def test_the_derived_hold(changes: dict[str, Any], start_s: float | None, rate: float, seconds: float,
                          rule: str) -> None:
    h = holdtime.hold(policy(**{"scale_down_stabilization_s": None, **changes}), start_s, rate)
    assert (h.seconds, h.rule) == (pytest.approx(seconds), rule)


def test_start_cost_is_measured_from_spawn_to_first_ready_report() -> None:
    fleet = classify((wk(0, started=100.0, ready_at=100.2), wk(1, started=200.0, ready_at=200.05)))
    samples = holdtime.start_samples((), fleet)
    assert [(w, round(s, 3)) for w, s in samples] == [("w0", 0.2), ("w1", 0.05)]
    assert holdtime.start_samples(samples, fleet) == samples  # each worker once
    assert holdtime.start_cost(samples, fleet, 300.0) == pytest.approx(0.2)
    slow = classify(fleet.ready + (wk(2, state="starting", fresh=False, started=240.0),))
    assert holdtime.start_cost(samples, slow, 300.0) == pytest.approx(60.0)  # still starting: >= 60 s


def test_a_slow_starting_tier_holds_long_in_decide() -> None:
    pol = policy(scale_down_stabilization_s=None, users_per_instance=1.0)
    state = TierState(starts=(("w9", 180.0),))
    plan, state = run(snap(wk(0), wk(1), wk(2), active_users=3, rps=3.0), pol, state, now=NOW)
    plan, _ = run(snap(wk(0), wk(1), wk(2), active_users=1, rps=3.0), pol, state, now=NOW + 600)
    assert plan.retire == () and plan.hold is not None and plan.hold.seconds == 1800.0
    assert plan.why()["hold"]["rule"] == "break-even"


def test_tier_state_body_round_trip() -> None:
    state = TierState(history=((1.0, 3),), last_scale_up=2.0, changes=((3.0, -1),), starts=(("w1", 0.1),),
                      failures=2, failed_at=4.0, recycling=(("w0", 3.5, "draining"),),
                      steps=((1.0, 2), (3.0, 4)), queued_since=5.0)
    assert TierState.from_body(state.to_body()) == state
    assert TierState.from_body({"history": [[1, 2]]}) == TierState(history=((1.0, 2),))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"schedules": [{"start": "0 25 * * *", "end": "0 18 * * *", "min_workers": 2}]}, "cron"),
        ({"schedules": [{"start": "@daily", "end": "0 18 * * *", "min_workers": 2}]}, "cron"),
        ({"schedules": [{"start": "0 9 * * *", "end": "0 18 * * *", "min_workers": 2,
                         "timezone": "Nowhere/X"}]}, "time zone"),
        ({"schedules": [{"start": "0 9 * * *", "end": "0 18 * * *"}]}, "sets min_workers"),
        ({"schedules": [{"start": "0 9 * * *", "end": "0 18 * * *", "min_workers": 20}]}, "max_workers"),
        ({"fallback": {"action": "fixed"}}, "needs workers"),
        ({"fallback": {"action": "fixed", "workers": 50}}, "max_workers"),
        ({"disruption_budget": {"workers": 1, "percent": 10}}, "exactly one"),
        ({"disruption_budget": {}}, "exactly one"),
        ({"scale_up": {"rules": [{"type": "pods", "value": 1, "period_s": 60}]}}, "type"),
        ({"scale_up": {"rules": [{"type": "workers", "value": 1, "period_s": 3600}]}}, "period_s"),
        ({"scale_in_hold": {"min_s": 100, "max_s": 10}}, "min_s"),
        ({"max_worker_age_s": 0}, "max_worker_age_s"),
    ],
)
def test_invalid_controls_are_rejected_with_the_reason(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy({"handler": "echo", **fields})


def test_every_control_round_trips_through_json() -> None:
    pol = parse_policy({
        "handler": "echo", "scale_up": {"rules": [B1], "select": "min"},
        "scale_down": {"select": "disabled"}, "fallback": {"after": 5, "action": "fixed", "workers": 2},
        "schedules": [WEEKDAYS_9_18.model_dump()], "paused_scale_in": True,
        "disruption_budget": {"percent": 20}, "max_worker_age_s": 86400, "max_turns_per_worker": 10000})
    assert parse_policy(pol.to_json()) == pol


# --- the handler's side of protection ------------------------------------------------------
async def test_a_handler_protects_its_worker_with_an_expiry_capped_by_the_policy() -> None:
    import time

    import fakeredis

    from stores.policies import write_policy
    from worker.app import Worker
    from worker.handlers import TurnContext
    from worker.settings import WorkerSettings

    r = fakeredis.FakeAsyncRedis()
    worker = Worker(WorkerSettings(worker_id="w1"), r=r)
    await write_policy(r, "chat", turns_policy(max_protection_s=600))
    await worker.tier_policy.refresh()
    before = time.time()
    ctx = TurnContext(None, None, protector=worker.host.protect)  # type: ignore[arg-type]
    until = ctx.protect(3600)
    assert before + 600 <= until <= time.time() + 600  # capped
    assert worker.reports.protected_until == until
    assert ctx.protect(0) == 0.0 and worker.reports.protected_until == 0.0  # released
    assert TurnContext(None, None).protect(60) == 0.0  # type: ignore[arg-type]  # no worker: nothing


def test_the_start_is_measured_only_from_a_workers_first_report() -> None:
    from commander.evaluator import Evaluator
    from protocol.models import Counters, OccupancyReport, Slots

    def report(worker: str, ts: float, cpu: float | None) -> OccupancyReport:
        return OccupancyReport(worker=worker, tier="chat", ts=ts, state="ready", users=0, active_users=0,
                               slots=Slots(busy=0, total=8), cpu=cpu, rss=1, counters=Counters(),
                               load=(0.0, 0.0, 0.0))

    ev = Evaluator()
    ev.add(report("new", 100.2, None))  # its first report: the sensor had no cpu sample yet
    ev.add(report("new", 105.2, 0.1))
    ev.add(report("old", 3000.0, 0.3))  # a commander that restarted reads an old worker's window
    assert ev.ready_at("new") == 100.2 and ev.ready_at("old") is None
