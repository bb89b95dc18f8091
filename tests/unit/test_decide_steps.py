"""The scale-up and scale-in steps of ``decide`` (``commander.scaleup``, the batch scale-in) as
tables of cases: what asks for workers, how far a step goes, how a burst doubles, and how the
excess goes in one batch per hold."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from commander.decide import Plan, TierState, decide
from commander.scaleup import Step, queued_since, record_step, step_target
from commander.signals import load_proposal, pressure_proposal
from commander.snapshot import TierSnapshot, WorkerView, classify
from protocol.policy import ScaleRules, turns_policy

NOW = 1_699_999_200.0


def policy(**changes: Any) -> ScaleRules:
    """Only occupancy, buffer, pressure and load speak; no step cap; a 30 s hold."""
    base: dict[str, Any] = {"users_per_instance": None, "target_backlog_per_worker": None,
                            "min_workers": 1, "max_workers": 32, "concurrency": 8,
                            "scale_down_stabilization_s": 30.0}
    base.update(changes)
    return turns_policy(**base).scale_rules()


def wk(i: int, occ: float = 0.0, *, state: str = "ready", busy: int | None = None,
       fresh: bool = True) -> WorkerView:
    """Worker ``w<i>`` (w0 the reception); busy slots follow occupancy unless given."""
    if busy is None:
        busy = 0 if occ == 0 else max(1, min(8, round(occ * 8)))
    return WorkerView(id=f"w{i}", state=state, occupancy=occ, busy=busy, total=8,  # type: ignore[arg-type]
                      lanes=busy, fresh=fresh, started=float(i))


def ready(*occs: float) -> tuple[WorkerView, ...]:
    return tuple(wk(i, o) for i, o in enumerate(occs))


def snap(workers: tuple[WorkerView, ...], **signals: Any) -> TierSnapshot:
    return TierSnapshot("chat", workers, **signals)


# --- the proposals that size and ask -----------------------------------------------------------

@pytest.mark.parametrize(
    ("name", "workers", "expected"),
    [
        ("no load", ready(0, 0), 0),
        ("idle workers' own cpu is no load", (wk(0, 0.02, busy=0), wk(1, 0.01, busy=0)), 0),
        ("under the reception's threshold", ready(0.3), 1),
        ("C(2) = 1.3 > 1.2", ready(0.6, 0.6), 2),
        ("C(3) = 2.1 > 1.3 + 0.5", ready(0.9, 0.9), 3),  # 1.8: C(2) = 1.3 is not enough
        ("exactly at C(n) needs one more", ready(0.5, 0.8), 3),  # 1.3 = C(2): nobody admits
        ("an unreported worker counts as full", (wk(0, 0.3), wk(1, fresh=False)), 2),
    ],
)
def test_load_proposal(name: str, workers: tuple[WorkerView, ...], expected: int) -> None:
    assert load_proposal(classify(workers), policy()) == expected, name


@pytest.mark.parametrize(
    ("name", "workers", "signals", "expected"),
    [
        ("nothing waits", ready(0.9, 0.9), {}, 0),
        ("free slots take the waiting turns: hold", ready(0.2, 0.2), {"backlog": 6}, 2),
        ("pressure: no slot is free", ready(0.2, 0.2), {"backlog": 6, "pressure_events": 1}, 3),
        ("unmeasured: every waiting turn asks a slot", ready(0.9, 0.9),
         {"backlog": 17, "pressure_events": 1}, 5),
        # 16 slots, 2 s a turn: 8 free a second, 4 start within 0.5 s
        ("measured: the running slots start 4 in time", ready(0.9, 0.9),
         {"backlog": 4, "pressure_events": 1, "rps": 8.0, "handler_rate": 16.0}, 2),
        ("measured: 5 more ask a worker", ready(0.9, 0.9),
         {"backlog": 9, "pressure_events": 1, "rps": 8.0, "handler_rate": 16.0}, 3),
        ("a longer target wait starts more", ready(0.9, 0.9),
         {"backlog": 9, "pressure_events": 1, "rps": 8.0, "handler_rate": 16.0, "_wait": 1.2}, 2),
        ("empty tier: a slot per waiting turn", (), {"backlog": 9}, 2),
    ],
)
def test_pressure_proposal(name: str, workers: tuple[WorkerView, ...], signals: dict[str, Any],
                           expected: int) -> None:
    pol = policy(target_wait_s=signals.pop("_wait", 0.5))
    s = snap(workers, **signals)
    assert pressure_proposal(s, classify(workers), pol) == expected, name


@pytest.mark.parametrize(
    ("name", "workers", "signals", "since", "expected"),
    [
        ("nothing waits", ready(0.9, 0.9), {}, NOW - 3, None),
        ("the free slots take them", ready(0.2, 0.2), {"backlog": 6}, NOW - 3, None),
        ("a worker starting takes them", ready(0.9) + (wk(1, state="starting", fresh=False),),
         {"backlog": 6, "pressure_events": 1}, NOW - 3, None),
        ("a queue starts", ready(0.9, 0.9), {"backlog": 1, "pressure_events": 1}, None, NOW),
        ("and stands", ready(0.9, 0.9), {"backlog": 1, "pressure_events": 1}, NOW - 3, NOW - 3),
        ("a clock that went back starts afresh", ready(0.9, 0.9), {"backlog": 1, "pressure_events": 1},
         NOW + 3, NOW),
    ],
)
def test_queued_since(name: str, workers: tuple[WorkerView, ...], signals: dict[str, Any],
                      since: float | None, expected: float | None) -> None:
    state = TierState(queued_since=since)
    assert queued_since(state, snap(workers, **signals), classify(workers), policy(), NOW) == expected, name


def test_a_queue_that_stood_for_the_target_wait_asks_a_slot_per_turn() -> None:
    """16 slots of 2 s turns start 4 waiting turns within 0.5 s: a fresh queue of 4 asks for
    nothing, the same queue 0.5 s later (its turns waited that long) asks for a worker."""
    s = snap(ready(0.45, 0.75), backlog=4, pressure_events=1, rps=8.0, handler_rate=16.0)
    plan, state = decide(s, policy(), TierState(), NOW)
    assert plan.spawn == 0 and state.queued_since == NOW
    plan, state = decide(s, policy(), state, NOW + 0.5)
    assert plan.spawn == 1 and plan.proposals["pressure"] == 3 and state.queued_since == NOW
    _, state = decide(snap(ready(0.45, 0.75), rps=8.0, handler_rate=16.0), policy(), state, NOW + 1)
    assert state.queued_since is None


# --- how far a scale-up goes ---------------------------------------------------------------

def props(**values: int) -> dict[str, int | None]:
    base: dict[str, int | None] = {"users": None, "backlog": None, "rps": None, "buffer": 0,
                                   "occupancy": 0, "pressure": 0, "load": 0}
    base.update(values)
    return base


BURST = TierState(last_scale_up=NOW - 1.0, steps=((NOW - 1.0, 3),))


@pytest.mark.parametrize(
    ("name", "proposals", "state", "expected"),
    [
        ("the load alone asks for nothing", props(load=6, occupancy=4), TierState(), Step(4, 4)),
        ("what asked, when the load is lower", props(pressure=6, load=5), TierState(), Step(6, 6)),
        ("sized by the load", props(pressure=5, load=9), TierState(), Step(9, 5, "load")),
        ("within a burst: double the last step", props(pressure=5, load=6), BURST,
         Step(10, 5, "doubling (the last step +3)")),
        ("the burst is over after a report interval", props(pressure=5, load=6),
         dataclasses.replace(BURST, steps=((NOW - 5.0, 3),)), Step(6, 5, "load")),
        ("a target signal never doubles", props(users=6, load=4), BURST, Step(6, 6)),
        ("no scale-up asked: nothing doubles", props(pressure=4, load=4), BURST, Step(4, 4)),
    ],
)
def test_step_target(name: str, proposals: dict[str, int | None], state: TierState, expected: Step) -> None:
    fleet = classify(ready(0.9, 0.9, 0.9, 0.9))
    assert step_target(proposals, fleet, policy(), state, NOW) == expected, name


def test_a_repeated_pass_sees_the_step_the_first_one_saw() -> None:
    steps = record_step(BURST, NOW, 6)
    assert steps == ((NOW - 1.0, 3), (NOW, 6))
    assert record_step(dataclasses.replace(BURST, steps=steps), NOW, 6) == steps
    assert record_step(BURST, NOW, 0) == BURST.steps


def test_a_burst_gets_its_workers_in_doubling_steps() -> None:
    """Pressure every second from 2 saturated workers: +1, +2, +4, +8 (each step's workers are
    ready and full at the next pass), not one worker per pass."""
    pol, state, n, spawned = policy(), TierState(), 2, []
    for i in range(4):
        workers = tuple(wk(k, 0.95) for k in range(n))
        plan, state = decide(snap(workers, backlog=1, pressure_events=1), pol, state, NOW + i)
        spawned.append(plan.spawn)
        n += plan.spawn
    assert spawned == [1, 2, 4, 8]
    assert plan.why()["step"] == {"asked": 10, "sized_by": "doubling (the last step +4)"}
    assert plan.reason == ("scale up 9->17: occupancy, pressure propose 10, "
                           "sized by doubling (the last step +4) to 17")


def test_max_step_up_still_caps_a_sized_step() -> None:
    plan, _ = decide(snap(ready(*[0.95] * 8), backlog=1, pressure_events=1), policy(max_step_up=1),
                     TierState(), NOW)
    assert plan.spawn == 1 and "step capped at 1" in plan.reason


# --- scale-in: one batch per hold ----------------------------------------------------------

def retired(plan: Plan) -> list[tuple[str, str]]:
    return [(r.worker, r.action) for r in plan.retire]


def test_consolidations_go_in_one_batch() -> None:
    plan, _ = decide(snap(ready(0.1, 0.1, 0.1, 0.1, 0.1, 0.1)), policy(scale_down_stabilization_s=0.0),
                     TierState(), NOW)
    assert retired(plan) == [(f"w{i}", "consolidate") for i in (1, 2, 3, 4)]  # the ledger keeps 2


@pytest.mark.parametrize(
    ("name", "since_last", "n_retired"),
    [
        ("no scale-in yet", None, 2),
        ("the last one a hold ago", 30.0, 2),
        ("the last one within the hold: wait", 10.0, 0),
        ("the same pass repeated", 0.0, 2),
    ],
)
def test_one_scale_in_per_hold(name: str, since_last: float | None, n_retired: int) -> None:
    state = TierState(last_scale_down=None if since_last is None else NOW - since_last)
    plan, _ = decide(snap(ready(0, 0, 0)), policy(), state, NOW)
    assert len(plan.retire) == n_retired, (name, plan.reason)
    if not n_retired:
        assert "one scale-in per hold" in plan.reason


def test_recycling_is_not_a_scale_in_for_the_hold() -> None:
    pol = policy(max_worker_age_s=3600)
    workers = (dataclasses.replace(wk(0, 0.3), started=NOW - 4000), wk(1, 0.3),
               dataclasses.replace(wk(2, 0.3), started=NOW - 10))  # w2: the replacement, up
    state = TierState(recycling=(("w0", NOW - 20, "replacing"),))
    plan, after = decide(snap(workers), pol, state, NOW)
    assert retired(plan) == [("w0", "recycle")]
    assert after.last_scale_down is None


def test_the_load_keeps_the_scale_in_target() -> None:
    """A pass that asks for nothing still keeps the measured load's count over the hold."""
    plan, _ = decide(snap(ready(0.7, 0.7, 0.7, 0.1)), policy(scale_down_stabilization_s=0.0),
                     TierState(), NOW)
    assert plan.proposals["load"] == 4 and plan.target == 4 and plan.retire == ()
