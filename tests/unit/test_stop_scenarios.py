"""Stop and deadlines on the simulator (the real workers, clients and Lua on a faulty network),
by controlled schedules (``sim.scenario``): a cancel at the moments that matter (the turn
queued, the handler just returned, the worker killed right after the cancel's record) and a
turn queued past its deadline. The checks (``sim.checks``) include ``cancel`` (a cancelled
turn is never answered ``ok``; exactly one reply, I1) and ``deadline`` (no handler starts
after it); and they find a commit that ignores the cancel."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import pytest

from protocol import keys
from protocol.codec import decode
from protocol.models import Reply
from sim.clock import virtual_time
from sim.explore import Outcome, Schedule, run
from sim.scenario import Act, Event, Scenario, handler, lane_holder, script
from sim.world import Planned, Workload, World
from tests.unit.test_sim import plant

IGNORES_THE_CANCEL = ("status ~= 'cancelled' and cancelled then", "false then")


def replies(scenario: Scenario, user: str, turn: str) -> list[Reply]:
    """The turn's replies as the store holds them at the run's end (in its virtual time: a
    reply's TTL runs on it)."""
    assert scenario.world is not None
    with virtual_time(scenario.world.loop):
        raw = scenario.world.net.sync_client().lrange(keys.reply(user, turn), 0, -1)
    return [decode(Reply, x) for x in raw]


def cancel(user: str, turn: str) -> Act:
    def act(world: World, _e: Event) -> None:
        world.cancel(user, turn)
    return act


def kill_the_lane_holder(user: str) -> Act:
    def act(world: World, _e: Event) -> None:
        holder = lane_holder(world, user)
        assert holder is not None
        world.inject("kill", holder)
    return act


def test_a_queued_turn_cancelled_is_answered_cancelled_without_running() -> None:
    scenario = Scenario([Planned("u0", sleep_ms=1000), Planned("u0", cancel_after_s=0.0)])
    outcome = scenario.run()
    assert outcome.ok, outcome.violations
    assert [r.status for r in replies(scenario, "u0", "u0-t1")] == ["cancelled"]
    assert scenario.world is not None
    assert [c.turn for c in scenario.world.record.calls] == ["u0-t0"]


@pytest.mark.parametrize("seed", range(4))
def test_a_cancel_racing_the_commit_gives_one_reply_never_ok_once_recorded(seed: int) -> None:
    """The cancel is sent as the handler returns: the commit or the cancel's record comes
    first (the drawn order decides); either way one reply, ``cancelled`` if the cancel won."""
    scenario = Scenario([Planned("u0", sleep_ms=200)], seed=seed, strategy="random")
    scenario.on(handler("exit", user="u0"), cancel("u0", "u0-t0"))
    outcome = scenario.run()
    assert outcome.ok and scenario.unfired() == [], outcome.violations
    got = replies(scenario, "u0", "u0-t0")
    assert len(got) == 1


def test_a_cancel_outlives_the_worker_killed_right_after_it() -> None:
    """The lane's holder dies as the cancel is recorded (before it hears of it): the turn's
    retry on the other worker finds the record and answers ``cancelled`` without running."""
    scenario = Scenario([Planned("u0", sleep_ms=3000)], workers=2)
    scenario.on(handler("enter", user="u0"), cancel("u0", "u0-t0"))
    scenario.on(script("turn_cancel", user="u0"), kill_the_lane_holder("u0"))
    outcome = scenario.run()
    assert outcome.ok and scenario.unfired() == [], outcome.violations
    assert [r.status for r in replies(scenario, "u0", "u0-t0")] == ["cancelled"]
    assert scenario.world is not None
    assert len([c for c in scenario.world.record.calls if c.turn == "u0-t0"]) == 1  # not run again


def test_a_turn_queued_past_its_deadline_expires_without_running() -> None:
    scenario = Scenario([Planned("u0", sleep_ms=1500), Planned("u0", timeout_s=0.5)])
    outcome = scenario.run()
    assert outcome.ok, outcome.violations
    assert [r.status for r in replies(scenario, "u0", "u0-t1")] == ["expired"]
    assert scenario.world is not None
    assert [c.turn for c in scenario.world.record.calls] == ["u0-t0"]


def record_only(user: str, turn: str) -> Act:
    """A raw client's cancel that only records (the documented function, without telling the
    worker): the running handler is not stopped, its commit must be refused."""
    def act(world: World, _e: Event) -> None:
        r = world.net.sync_client()
        entry = next(e for e, f in r.xrange(keys.inbox(user)) if f[b"turn_id"] == turn.encode())
        r.hsetnx(keys.state(user), f"cancel:{entry.decode()}", 1)
        next(s for s in world.record.turns if s.turn == turn).cancelled = "cancelled"
    return act


def test_the_record_alone_makes_the_commit_answer_cancelled() -> None:
    scenario = Scenario([Planned("u0", sleep_ms=200)])
    scenario.on(handler("enter", user="u0"), record_only("u0", "u0-t0"))
    outcome = scenario.run()
    assert outcome.ok and scenario.unfired() == [], outcome.violations
    assert [r.status for r in replies(scenario, "u0", "u0-t0")] == ["cancelled"]
    assert scenario.world is not None
    (call,) = scenario.world.record.calls
    # it ran to its end, unheard (virtual seconds: enter + 0.2 - enter may round below 0.2)
    assert call.exit is not None and call.exit - call.enter >= 0.2 - 1e-9


def test_a_commit_that_ignores_the_cancel_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    plant(monkeypatch, "turn_commit", IGNORES_THE_CANCEL)
    scenario = Scenario([Planned("u0", sleep_ms=200)])
    scenario.on(handler("enter", user="u0"), record_only("u0", "u0-t0"))
    outcome = scenario.run()
    assert {v.kind for v in outcome.violations} == {"cancel"}, outcome.violations


# --- the explorer's drawn schedules with stops (scripts/explore --stop) -------------------------
def _stop_schedules(seeds: range, streamed: bool = False, **faults: int) -> Iterator[Outcome]:
    for seed in seeds:
        workload = replace(Workload.draw(random.Random(seed)), stop=0.5, streamed=streamed)
        yield run(Schedule(seed=seed, workload=workload, **faults))


def test_drawn_schedules_with_cancels_and_deadlines_hold() -> None:
    """120 random schedules, faults and all, whose clients cancel a quarter of their turns and
    give another quarter deadlines."""
    bad = [(o.schedule.seed, o.violations) for o in _stop_schedules(range(1, 121)) if o.violations]
    assert bad == []


def test_streamed_turns_with_cancels_and_deadlines_hold() -> None:
    """The same with every turn streamed: a streamed turn's deadline is honoured too (the
    explorer's streamed submit once dropped it, and found handlers run after their deadline)."""
    outcomes = _stop_schedules(range(1, 41), streamed=True)
    bad = [(o.schedule.seed, o.violations) for o in outcomes if o.violations]
    assert bad == []


def test_drawn_schedules_with_cancels_find_a_commit_that_ignores_the_cancel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plant(monkeypatch, "turn_commit", IGNORES_THE_CANCEL)
    found = next((o for o in _stop_schedules(range(1, 120), max_faults=0) if o.violations), None)
    assert found is not None and {v.kind for v in found.violations} == {"cancel"}


def test_a_streamed_turn_run_again_under_the_same_lease_starts_with_a_restart() -> None:
    """Seed 52326 (scripts/explore --streamed --stop 0.5): a worker paused past its lane's
    deadline stops its turn, takes the lane again under the same lease (nobody took it), and
    runs the same attempt again: its text must follow a restart, or the reader shows it twice."""
    seed = 52326
    workload = replace(Workload.draw(random.Random(seed)), stop=0.5, streamed=True)
    got = run(Schedule(seed=seed, workload=workload))
    assert got.ok, [str(v) for v in got.violations]
