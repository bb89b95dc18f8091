"""``decide`` as tables of cases, one rule at a time (like the HPA's replica calculator tests)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from commander.capacity import capacity, fits, ledger_floor, may_compact, threshold
from commander.decide import Plan, TierState, decide, utc_weekday_minute
from commander.signals import ceil_ratio, occupancy_proposal
from commander.snapshot import TierSnapshot, WorkerView, classify
from protocol.policy import ScaleRules, turns_policy
from protocol.policy_controls import TimeWindow

DAY0 = 1_699_920_000.0  # 2023-11-14 00:00 UTC, a Tuesday
NOW = DAY0 + 22 * 3600.0


def policy(**changes: Any) -> ScaleRules:
    """A policy where only occupancy, buffer and pressure speak, and scale-in is immediate."""
    base: dict[str, Any] = {
        "users_per_instance": None, "target_backlog_per_worker": None,
        "target_rps_per_worker": None, "min_workers": 1, "max_workers": 10,
        "scale_down_stabilization_s": 0.0, "max_step_up": 4, "concurrency": 8,
    }
    base.update(changes)
    return turns_policy(**base).scale_rules()


def wk(i: int, occ: float = 0.0, *, state: str = "ready", busy: int | None = None,
       fresh: bool = True, reception: bool = False) -> WorkerView:
    """Worker ``w<i>`` started at ``i`` (so w0 is the reception); busy slots follow occupancy."""
    if busy is None:
        busy = 0 if occ == 0 else max(1, min(8, round(occ * 8)))
    return WorkerView(id=f"w{i}", state=state, occupancy=occ, busy=busy, total=8,  # type: ignore[arg-type]
                      lanes=busy, fresh=fresh, is_reception=reception, started=float(i))


def ready(*occs: float) -> tuple[WorkerView, ...]:
    """Ready, freshly reported workers w0, w1, ... with these occupancies."""
    return tuple(wk(i, o) for i, o in enumerate(occs))


def starting(*ids: int) -> tuple[WorkerView, ...]:
    return tuple(wk(i, state="starting", fresh=False) for i in ids)


def snap(workers: Sequence[WorkerView] = (), **signals: Any) -> TierSnapshot:
    return TierSnapshot("chat", tuple(workers), **signals)


def run(snapshot: TierSnapshot, pol: ScaleRules, state: TierState | None = None,
        now: float = NOW) -> Plan:
    return decide(snapshot, pol, state or TierState(), now)[0]


def retired(plan: Plan) -> list[tuple[str, str]]:
    return [(r.worker, r.action) for r in plan.retire]


# --- one table for the whole rule set ------------------------------------------------------

CASES: list[tuple[str, dict[str, Any], TierSnapshot, int, list[tuple[str, str]]]] = [
    # name, policy changes, snapshot, expected spawn, expected retirements
    ("steady under thresholds", {}, snap(ready(0.4, 0.6)), 0, []),
    ("nobody admits: one more", {}, snap(ready(0.6, 0.85, 0.9)), 1, []),
    ("reception under its threshold still admits", {}, snap(ready(0.45, 0.85, 0.9)), 0, []),
    ("reception over its threshold does not", {}, snap(ready(0.55, 0.85)), 1, []),
    ("lone reception admits up to admission", {}, snap(ready(0.7)), 0, []),
    ("lone reception saturated", {}, snap(ready(0.8)), 1, []),
    ("users signal", {"users_per_instance": 10}, snap(ready(0.1), active_users=35), 3, []),
    # short turns (0.1 s): the running slots start the 40 within target_wait_s, so only the
    # backlog signal asks
    ("backlog signal", {"target_backlog_per_worker": 16},
     snap(ready(0.1), backlog=40, rps=80.0, handler_rate=8.0), 2, []),
    ("rps signal", {"target_rps_per_worker": 5}, snap(ready(0.1), rps=12.0), 2, []),
    ("warm buffer", {"target_buffer": 2}, snap(ready(0.3, 0.3)), 1, []),
    ("max of the proposals", {"users_per_instance": 10, "target_backlog_per_worker": 10},
     snap(ready(0.1), active_users=25, backlog=41), 4, []),
    ("pressure: one more at least", {}, snap(ready(0.4, 0.4), pressure_events=1, backlog=1), 1, []),
    ("pressure sized by the slots it missed", {}, snap(ready(0.9, 0.9), pressure_events=20, backlog=20),
     3, []),
    ("waiting turns take the free slots first", {}, snap(ready(0.4, 0.4), backlog=4), 0, []),
    ("the running slots start some in time", {},  # 16 slots, 2 s a turn: 4 start within 0.5 s
     snap(ready(0.45, 0.75), pressure_events=1, backlog=4, rps=8.0, handler_rate=16.0), 0, []),
    ("... and the rest asks for slots", {},
     snap(ready(0.45, 0.75), pressure_events=1, backlog=13, rps=8.0, handler_rate=16.0), 2, []),
    ("a scale-up is sized by the measured load", {},  # 9 asked; C(n) > 7.6 from n = 10
     snap(ready(*[0.95] * 8), pressure_events=1, backlog=1), 2, []),
    ("pressure wakes an empty tier", {"min_workers": 0}, snap((), pressure_events=1), 1, []),
    ("backlog wakes an empty tier, signal off", {"min_workers": 0}, snap((), backlog=3), 1, []),
    ("empty and quiet stays empty", {"min_workers": 0}, snap(()), 0, []),
    ("min_workers from nothing", {"min_workers": 2}, snap(()), 2, []),
    ("max_step_up caps a step", {"users_per_instance": 1, "max_step_up": 2},
     snap(ready(0.1), active_users=9), 2, []),
    ("max_workers caps desired", {"users_per_instance": 1, "max_workers": 3},
     snap(ready(0.1), active_users=9), 2, []),
    ("anti-windup: net of starting", {"users_per_instance": 1},
     snap(ready(0.1, 0.1) + starting(2, 3), active_users=5), 1, []),
    ("anti-windup: saturated while one starts", {}, snap(ready(0.9, 0.9) + starting(2)), 0, []),
    ("anti-windup: pressure while one starts", {}, snap(ready(0.9) + starting(1), pressure_events=3),
     0, []),
    ("draining is not capacity", {"users_per_instance": 1},
     snap(ready(0.1, 0.1) + (wk(2, 0.5, state="draining"),), active_users=3), 1, []),
    ("idle reclaimed, reception kept", {}, snap(ready(0, 0, 0)), 0,
     [("w1", "reclaim-idle"), ("w2", "reclaim-idle")]),
    ("min_workers is a floor", {"min_workers": 2}, snap(ready(0, 0, 0)), 0, [("w1", "reclaim-idle")]),
    ("scale to zero", {"min_workers": 0}, snap(ready(0)), 0, [("w0", "reclaim-idle")]),
    ("no scale to zero with backlog", {"min_workers": 0}, snap(ready(0), backlog=1), 0, []),
    ("idle first, then one consolidation", {}, snap(ready(0.3, 0.2, 0.0, 0.25)), 0,
     [("w2", "reclaim-idle"), ("w1", "consolidate")]),
    ("consolidate the least occupied, never the reception", {}, snap(ready(0.1, 0.3, 0.2)), 0,
     [("w2", "consolidate")]),
    ("an idle reception is not reclaimed while others exist", {}, snap(ready(0.0, 0.3, 0.3)), 0,
     [("w1", "consolidate")]),
    ("ledger without headroom keeps everyone", {}, snap(ready(0.3, 0.5, 0.5)), 0, []),
    ("over max_workers: consolidate when it fits", {"max_workers": 2},
     snap(ready(0.2, 0.5, 0.45)), 0, [("w2", "consolidate")]),
    ("over max_workers: keep when it does not fit", {"max_workers": 2},
     snap(ready(0.45, 0.75, 0.7)), 0, []),
    ("stale workers are never idle", {}, snap(ready(0, 0, 0) + (wk(3, fresh=False),)), 0,
     [("w1", "reclaim-idle"), ("w2", "reclaim-idle")]),
    ("most reports missing: no scale-in", {"max_workers": 1},
     snap((wk(0), wk(1, fresh=False), wk(2, fresh=False))), 0, []),
    ("no consolidation while workers start", {"max_workers": 2, "users_per_instance": 1},
     snap(ready(0.2, 0.3) + starting(2), active_users=1), 0, []),
]


@pytest.mark.parametrize(("name", "changes", "snapshot", "spawn", "retire"), CASES,
                         ids=[c[0] for c in CASES])
def test_rules(name: str, changes: dict[str, Any], snapshot: TierSnapshot, spawn: int,
               retire: list[tuple[str, str]]) -> None:
    plan = run(snapshot, policy(**changes))
    assert (plan.spawn, retired(plan)) == (spawn, retire), plan.reason
    assert plan.reason


@pytest.mark.parametrize(("name", "changes", "snapshot", "spawn", "retire"), CASES,
                         ids=[c[0] for c in CASES])
def test_idempotent(name: str, changes: dict[str, Any], snapshot: TierSnapshot, spawn: int,
                    retire: list[tuple[str, str]]) -> None:
    """Deciding again on the same snapshot with the returned state changes nothing more."""
    pol = policy(**changes, scale_down_stabilization_s=300.0)
    plan1, state1 = decide(snapshot, pol, TierState(), NOW)
    plan2, state2 = decide(snapshot, pol, state1, NOW)
    assert plan2 == plan1
    assert state2 == state1


# --- the pieces --------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("amount", "per", "expected"),
    [(0, 10, 0), (1, 10, 1), (10, 10, 1), (11, 10, 2), (0.3, 0.1, 3), (-1, 10, 0)],
)
def test_ceil_ratio(amount: float, per: float, expected: int) -> None:
    assert ceil_ratio(amount, per) == expected


@pytest.mark.parametrize(
    ("name", "workers", "expected"),
    [
        ("no workers", (), 0),
        ("all idle asks for none", ready(0, 0, 0), 0),
        ("saturated asks one more", ready(0.6, 0.9), 3),
        ("starting: hold at current", ready(0.9) + starting(1), 2),
        ("nothing measured: hold", (wk(0, fresh=False), wk(1, fresh=False)), 2),
        ("ledger floor when admitting", ready(0.1, 0.1, 0.1, 0.1, 0.1), 2),
    ],
)
def test_occupancy_proposal(name: str, workers: tuple[WorkerView, ...], expected: int) -> None:
    assert occupancy_proposal(classify(workers), policy()) == expected, name


@pytest.mark.parametrize(
    ("n", "load", "allowed"),
    [
        (1, 0.0, False),  # the last worker is never compacted by the ledger
        (2, 0.0, True),  # H = 1.3 > 1.2
        (2, 0.15, False),  # H = 1.15: the margin holds the second worker
        (3, 0.85, True),  # H = 1.25
        (3, 0.95, False),  # H = 1.15
    ],
)
def test_ledger_margin(n: int, load: float, allowed: bool) -> None:
    pol = policy()
    assert capacity(n, pol) == pytest.approx(0.5 + (n - 1) * 0.8)
    assert may_compact(n, load, pol) is allowed


@pytest.mark.parametrize(("n", "load", "floor"), [(5, 0.0, 1), (5, 0.5, 2), (5, 1.3, 3), (5, 9, 5)])
def test_ledger_floor(n: int, load: float, floor: int) -> None:
    assert ledger_floor(n, load, policy()) == floor


@pytest.mark.parametrize(
    ("victim", "survivors", "ok"),
    [
        (0.3, ready(0.2, 0.6), True),  # room .3 + .2
        (0.6, ready(0.2, 0.6), False),
        (0.3, ready(0.45, 0.75), False),  # .05 + .05
        (0.3, (wk(0, 0.1), wk(1, fresh=False)), True),  # reception's .4
        (0.5, (wk(0, 0.1), wk(1, fresh=False)), False),  # the stale one has no room
        (0.5, ready(0.1), True),  # a lone reception takes up to admission
    ],
)
def test_fits(victim: float, survivors: tuple[WorkerView, ...], ok: bool) -> None:
    assert fits(wk(9, victim), survivors, "w0", policy()) is ok


@pytest.mark.parametrize(
    ("workers", "reception"),
    [
        ((), None),
        (ready(0.5, 0.1), "w0"),  # the oldest
        ((wk(3), wk(1), wk(2)), "w1"),
        ((wk(0), wk(1, reception=True)), "w1"),  # marked wins over age
        ((wk(0, state="draining"), wk(1)), "w1"),
        (starting(4, 5), "w4"),
    ],
)
def test_reception(workers: tuple[WorkerView, ...], reception: str | None) -> None:
    assert classify(workers).reception == reception


def test_marked_reception_is_never_consolidated() -> None:
    workers = (wk(0, 0.3), wk(1, 0.3), wk(2, 0.1, reception=True))
    plan = run(snap(workers), policy())
    assert retired(plan) == [("w0", "consolidate")]  # the oldest, but not the reception


# --- time: stabilization, change windows ---------------------------------------------------

def test_stabilization_window_over_time() -> None:
    """Scale-in waits for the highest desired of the last 300 s, one batch per hold; scale-up
    never waits."""
    pol = policy(users_per_instance=1, scale_down_stabilization_s=300.0)
    workers = ready(0, 0, 0, 0, 0)
    steps = [  # (t, active users, expected target, expected retirements)
        (0.0, 5, 5, 0),
        (60.0, 2, 5, 0),
        (200.0, 4, 5, 0),
        (299.0, 2, 5, 0),
        (301.0, 2, 4, 1),  # (0, 5) left the window; (200, 4) is the max
        (501.0, 2, 2, 0),  # one scale-in per hold: the next after 601
        (601.0, 2, 2, 3),  # down to the target in one batch
    ]
    state = TierState()
    for t, users, target, n_retired in steps:
        plan, state = decide(snap(workers, active_users=users), pol, state, t)
        assert (plan.target, len(plan.retire)) == (target, n_retired), (t, plan.reason)
    assert len(state.history) <= 2  # the monotone window stays small
    plan, state = decide(snap(workers, active_users=9), pol, state, 602.0)
    assert plan.spawn == 4  # up is immediate (max_step_up 4)


def test_hold_reason_names_the_scale_in_hold() -> None:
    pol = policy(users_per_instance=1, scale_down_stabilization_s=300.0)
    _, state = decide(snap(ready(0, 0, 0), active_users=3), pol, TierState(), 0.0)
    plan, _ = decide(snap(ready(0, 0, 0), active_users=1), pol, state, 10.0)
    assert not plan.changed and "scale-in hold keeps 3 (300 s, fixed)" in plan.reason


def test_clock_going_back_forgets_the_future() -> None:
    pol = policy(users_per_instance=1, scale_down_stabilization_s=300.0)
    _, state = decide(snap(ready(0, 0, 0), active_users=3), pol, TierState(), 1000.0)
    plan, state = decide(snap(ready(0, 0, 0), active_users=1), pol, state, 900.0)
    assert state.history == ((900.0, 1),) and len(plan.retire) == 2


FREEZE = TimeWindow(start="09:00", end="17:00")


@pytest.mark.parametrize(
    ("windows", "now", "n_retired"),
    [
        ((), DAY0 + 10 * 3600, 2),
        ((FREEZE,), DAY0 + 10 * 3600, 0),
        ((FREEZE,), DAY0 + 17 * 3600, 2),  # the end is exclusive
        ((TimeWindow(start="09:00", end="17:00", days=(0,)),), DAY0 + 10 * 3600, 2),  # Mondays only
        ((TimeWindow(start="22:00", end="06:00", days=(1,)),), DAY0 + 86400 + 3600, 0),  # wraps
    ],
)
def test_no_scale_in_window(windows: tuple[TimeWindow, ...], now: float, n_retired: int) -> None:
    plan = run(snap(ready(0, 0, 0)), policy(no_scale_in_windows=windows), now=now)
    assert len(plan.retire) == n_retired
    assert (plan.held is not None) is (n_retired == 0)


@pytest.mark.parametrize("ts", [0.0, DAY0, NOW, DAY0 + 5 * 86400 + 59.9, 2_000_000_000.5])
def test_utc_weekday_minute(ts: float) -> None:
    dt = datetime.fromtimestamp(ts, UTC)
    assert utc_weekday_minute(ts) == (dt.weekday(), dt.hour * 60 + dt.minute)


# --- fights, windup, convergence -----------------------------------------------------------

def apply(snapshot: TierSnapshot, plan: Plan, pol: ScaleRules, next_id: int = 100) -> TierSnapshot:
    """What the fleet looks like once the runtime has carried out ``plan``.

    New workers are starting; victims drain; a consolidated victim's load moves to the
    fresh survivors in proportion to their room under their thresholds (an idle one's
    residue just goes away).
    """
    victims = {r.worker: r.action for r in plan.retire}
    moved = sum(w.occupancy for w in snapshot.workers if victims.get(w.id) == "consolidate")
    survivors = tuple(w for w in snapshot.workers if w.state == "ready" and w.id not in victims)
    fleet = classify(survivors)
    room = {w.id: max(0.0, threshold(w, fleet.reception, len(survivors), pol) - w.occupancy)
            for w in survivors if w.fresh}
    total_room = sum(room.values()) or 1.0
    workers = []
    for w in snapshot.workers:
        if w.id in victims:
            w = dataclasses.replace(w, state="draining")
        elif w.id in room and moved:
            w = dataclasses.replace(w, occupancy=w.occupancy + moved * room[w.id] / total_room)
        workers.append(w)
    workers += [wk(next_id + i, state="starting", fresh=False) for i in range(plan.spawn)]
    return dataclasses.replace(snapshot, workers=tuple(workers))


def assert_no_reversal(snapshot: TierSnapshot, pol: ScaleRules) -> None:
    """Decide, act, decide again: the second pass never undoes the first."""
    plan1, state = decide(snapshot, pol, TierState(), NOW)
    assert decide(snapshot, pol, state, NOW) == (plan1, state)  # idempotent
    # the next pass, sooner than target_wait_s: a queue that stood longer than that, or a burst,
    # may ask again, on purpose (commander.scaleup)
    plan2, _ = decide(apply(snapshot, plan1, pol), pol, state, NOW + 0.25)
    assert not (plan1.spawn and plan2.retire), (plan1.reason, plan2.reason)
    assert not (plan1.retire and plan2.spawn), (plan1.reason, plan2.reason)
    if plan1.spawn and plan1.current + plan1.spawn >= plan1.desired:
        assert plan2.spawn == 0, (plan1.reason, plan2.reason)  # no windup


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_acting_on_a_plan_never_reverses_it(name: str) -> None:
    _, changes, snapshot, _, _ = next(c for c in CASES if c[0] == name)
    assert_no_reversal(snapshot, policy(**changes))


@st.composite
def worker_views(draw: st.DrawFn, i: int) -> WorkerView:
    state = draw(st.sampled_from(["ready", "ready", "ready", "starting", "draining"]))
    fresh = state == "ready" and draw(st.booleans() | st.just(True))
    busy = draw(st.integers(0, 8))
    occ = draw(st.floats(0.0, 1.2)) if busy else draw(st.sampled_from([0.0, 0.02, 0.3]))
    return WorkerView(id=f"w{i}", state=state, occupancy=occ, busy=busy, total=8,
                      lanes=busy, fresh=fresh, started=float(draw(st.integers(0, 20))))


@st.composite
def tiers(draw: st.DrawFn) -> tuple[TierSnapshot, ScaleRules]:
    n = draw(st.integers(0, 12))
    workers = tuple(draw(worker_views(i)) for i in range(n))
    snapshot = snap(workers, active_users=draw(st.integers(0, 50)),
                    backlog=draw(st.integers(0, 60)), rps=draw(st.floats(0, 40)),
                    pressure_events=draw(st.integers(0, 3)))
    admission = draw(st.floats(0.5, 1.0))
    pol = policy(
        min_workers=draw(st.integers(0, 3)), max_workers=draw(st.integers(3, 14)),
        users_per_instance=draw(st.none() | st.sampled_from([5.0, 20.0])),
        target_backlog_per_worker=draw(st.none() | st.sampled_from([8.0, 32.0])),
        target_rps_per_worker=draw(st.none() | st.sampled_from([2.0, 10.0])),
        target_buffer=draw(st.integers(0, 2)), max_step_up=draw(st.integers(1, 5)),
        admission_threshold=admission,
        reception_threshold=admission * draw(st.floats(0.2, 1.0)),
        compaction_margin=draw(st.floats(1.0, 3.0)),
    )
    return snapshot, pol


@settings(max_examples=500, deadline=None)
@given(tiers())
def test_random_tiers_never_reverse(tier: tuple[TierSnapshot, ScaleRules]) -> None:
    assert_no_reversal(*tier)


def even_fleet(n: int, load: float) -> tuple[WorkerView, ...]:
    """``n`` ready workers sharing ``load`` evenly (an ideal balancer)."""
    return ready(*([load / n] * n)) if n else ()


@settings(max_examples=300, deadline=None)
@given(
    load=st.floats(0.0, 8.0),
    n0=st.integers(1, 12),
    admission=st.floats(0.5, 1.0),
    reception_share=st.floats(0.2, 1.0),
    margin=st.floats(1.0, 3.0),
)
@example(load=3.0, n0=1, admission=0.5, reception_share=1.0, margin=1.0)  # 7 x 3/7 < 3.0 in floats
def test_scale_up_and_compaction_never_chase(load: float, n0: int, admission: float,
                                             reception_share: float, margin: float) -> None:
    """With a steady load the worker count moves one way only, then stays."""
    pol = policy(admission_threshold=admission, reception_threshold=admission * reception_share,
                 compaction_margin=margin, max_workers=40, max_step_up=40)
    n, state, counts = n0, TierState(), [n0]
    for step in range(30):
        plan, state = decide(snap(even_fleet(n, load)), pol, state, NOW + step)
        n += plan.spawn - len(plan.retire)
        counts.append(n)
    deltas = [b - a for a, b in zip(counts, counts[1:], strict=False) if b != a]
    assert all(d > 0 for d in deltas) or all(d < 0 for d in deltas), counts
    assert counts[-1] == counts[-2], counts  # converged


@pytest.mark.parametrize(
    ("occs", "margin", "compacts"),
    [
        ((0.35, 0.35, 0.35), 1.5, False),  # H = 1.05 <= 1.2: keep three
        ((0.35, 0.35, 0.35), 1.0, True),  # the smallest margin compacts ...
        ((0.2, 0.2, 0.2), 1.5, True),  # H = 1.5 > 1.2
    ],
)
def test_margin_decides_compaction(occs: tuple[float, ...], margin: float, compacts: bool) -> None:
    pol = policy(compaction_margin=margin)
    snapshot = snap(ready(*occs))
    plan, state = decide(snapshot, pol, TierState(), NOW)
    assert bool(plan.retire) is compacts
    after, _ = decide(apply(snapshot, plan, pol), pol, state, NOW + 1)
    assert after.spawn == 0  # ... and even then the survivors still admit: no chase


def test_max_step_up_converges_over_passes() -> None:
    pol = policy(users_per_instance=1, max_step_up=3, max_workers=10)
    snapshot, state, spawned = snap(ready(0.1), active_users=9), TierState(), []
    for step in range(5):
        plan, state = decide(snapshot, pol, state, NOW + step)
        spawned.append(plan.spawn)
        snapshot = apply(snapshot, plan, pol, next_id=10 * (step + 1))
    assert spawned == [3, 3, 2, 0, 0]


def test_stale_majority_blocks_even_idle_reclaim() -> None:
    workers = (wk(0), wk(1), wk(2, fresh=False), wk(3, fresh=False), wk(4, fresh=False))
    plan = run(snap(workers), policy())
    assert plan.retire == () and plan.held is not None and "reports missing" in plan.held


def test_plan_why_is_plain_data() -> None:
    plan = run(snap(ready(0.9, 0.9), pressure_events=20, backlog=20), policy())
    why = plan.why()
    assert why["proposals"]["pressure"] == 5 and why["desired"] == 5 and why["clamp"] is None
    assert plan.reason.startswith("scale up 2->5")
