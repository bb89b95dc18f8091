"""Rollout operations, pure: the weights a rollout sets, and the guard's verdict on a canary."""

from __future__ import annotations

from typing import Any

import pytest

from commander.evaluator import rows_of
from commander.rollouts.canary import GroupWindow, judge_canary, pool_window, worker_window
from protocol.groups import RolloutGuard, assign, rollout_weights
from protocol.models import Counters, OccupancyReport, Slots
from protocol.policy import turns_policy

# (weights now, group, percent, weights after)
WEIGHTS_TABLE: list[Any] = [
    pytest.param([("blue", 95), ("green", 5)], "green", 10, (("blue", 90.0), ("green", 10.0)), id="5->10"),
    pytest.param([("blue", 90), ("green", 10)], "green", 100, (("blue", 0.0), ("green", 100.0)), id="to-100"),
    pytest.param([("blue", 90), ("green", 10)], "green", 0, (("blue", 100.0), ("green", 0.0)), id="abort"),
    pytest.param([("blue", 0), ("green", 100)], "green", 0, (("blue", 100.0), ("green", 0.0)),
                 id="abort-others-at-0"),
    pytest.param([("blue", 3), ("green", 1)], "green", 50, (("blue", 50.0), ("green", 50.0)),
                 id="not-summing-to-100"),
    pytest.param([("a", 60), ("b", 20), ("c", 20)], "c", 40, (("a", 45.0), ("b", 15.0), ("c", 40.0)),
                 id="three-groups-proportional"),
    pytest.param([("a", 0), ("b", 0), ("c", 100)], "c", 40, (("a", 30.0), ("b", 30.0), ("c", 40.0)),
                 id="others-all-0-share-equally"),
    pytest.param([("a", 1)], "a", 100, (("a", 100.0),), id="single"),
]
REJECTED_TABLE: list[Any] = [
    pytest.param([("a", 0), ("b", 100), ("x", 0)], "b", 0, {"x"}, (("a", 100.0), ("b", 0.0), ("x", 0.0)),
                 id="abort-skips-rejected"),
    pytest.param([("a", 50), ("b", 25), ("x", 25)], "b", 50, {"x"}, (("a", 50.0), ("b", 50.0), ("x", 0.0)),
                 id="rejected-weight-goes-to-the-rest"),
    pytest.param([("b", 100), ("x", 0)], "b", 0, {"x"}, (("b", 0.0), ("x", 100.0)), id="only-rejected-left"),
]


@pytest.mark.parametrize(("weights", "group", "percent", "rejected", "want"), REJECTED_TABLE)
def test_rollout_weights_with_rejected_groups(weights: list[tuple[str, float]], group: str, percent: float,
                                              rejected: set[str], want: tuple[tuple[str, float], ...],
                                              ) -> None:
    assert rollout_weights(weights, group, percent, frozenset(rejected)) == want


@pytest.mark.parametrize(("weights", "group", "percent", "want"), WEIGHTS_TABLE)
def test_rollout_weights(weights: list[tuple[str, float]], group: str, percent: float,
                         want: tuple[tuple[str, float], ...]) -> None:
    assert rollout_weights(weights, group, percent) == want


@pytest.mark.parametrize(("group", "percent", "error"), [
    ("red", 10, "no group 'red'"), ("green", 101, "0..100"), ("green", -1, "0..100")])
def test_rollout_weights_refuses(group: str, percent: float, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        rollout_weights([("blue", 90), ("green", 10)], group, percent)


def test_a_single_group_cannot_go_to_zero() -> None:
    with pytest.raises(ValueError, match="only group"):
        rollout_weights([("a", 1)], "a", 0)


def test_a_rollout_step_moves_only_the_users_between_the_thresholds() -> None:
    users = [f"u{i}" for i in range(5_000)]
    before = rollout_weights([("blue", 50), ("green", 50)], "green", 5)
    after = rollout_weights(before, "green", 10)
    moved = [u for u in users if assign(u, before) != assign(u, after)]
    assert all(assign(u, before) == "blue" and assign(u, after) == "green" for u in moved)
    assert 0.03 < len(moved) / len(users) < 0.07  # about 5 % of the users, no more


def test_with_weights_keeps_the_rest_of_the_policy() -> None:
    policy = turns_policy(concurrency=3, groups=[{"name": "blue", "weight": 90, "max_workers": 4},
                                                 {"name": "green", "weight": 10}])
    new = policy.with_weights((("blue", 0.0), ("green", 100.0)))
    assert new.rollout.weights() == (("blue", 0.0), ("green", 100.0))
    assert new.concurrency == 3 and new.for_group("blue").max_workers == 4


GUARD = RolloutGuard(window_s=60, error_rate_margin=0.05, latency_margin=0.5, min_turns=20)

# (canary, baseline, verdict fragment or None)
GUARD_TABLE: list[Any] = [
    pytest.param(GroupWindow(100, 1, 10), GroupWindow(900, 9, 90), None, id="healthy"),
    pytest.param(GroupWindow(100, 20, 10), GroupWindow(900, 9, 90), "error rate 16.7%", id="errors"),
    pytest.param(GroupWindow(24, 33, 6), GroupWindow(900, 9, 90),
                 "error rate 57.9% of handler calls over 24 turns",
                 id="retried-turns-more-errors-than-turns"),
    pytest.param(GroupWindow(100, 6, 10), GroupWindow(900, 9, 90), None, id="errors-inside-margin"),
    pytest.param(GroupWindow(100, 7, 10), GroupWindow(900, 9, 90), "error rate 6.5%", id="errors-just-over"),
    pytest.param(GroupWindow(100, 0, 16), GroupWindow(900, 0, 90), "handler latency 160 ms", id="slow"),
    pytest.param(GroupWindow(100, 0, 14), GroupWindow(900, 0, 90), None, id="slower-inside-margin"),
    pytest.param(GroupWindow(10, 10, 100), GroupWindow(900, 0, 90), None, id="too-few-canary-turns"),
    pytest.param(GroupWindow(100, 100, 100), GroupWindow(5, 0, 1), None, id="too-few-baseline-turns"),
    pytest.param(GroupWindow(100, 0, 10), GroupWindow(900, 0, 0), None, id="baseline-latency-0"),
]


@pytest.mark.parametrize(("canary", "baseline", "verdict"), GUARD_TABLE)
def test_judge_canary(canary: GroupWindow, baseline: GroupWindow, verdict: str | None) -> None:
    got = judge_canary(canary, baseline, GUARD)
    assert (got is None) == (verdict is None), got
    if verdict is not None:
        assert got is not None and verdict in got


def test_a_disabled_signal_never_aborts() -> None:
    guard = RolloutGuard(error_rate_margin=None, latency_margin=None, min_turns=1)
    assert judge_canary(GroupWindow(100, 100, 100), GroupWindow(100, 0, 1), guard) is None


def report(ts: float, turns: int, errors: int, handler_s: float) -> OccupancyReport:
    return OccupancyReport(worker="w", tier="chat.green", ts=ts, state="ready", users=0, active_users=0,
                           slots=Slots(busy=0, total=1, queue_depth=0), cpu=None, rss=0,
                           counters=Counters(turns=turns, errors=errors, handler_seconds=handler_s),
                           load=(0.0, 0.0, 0.0))


def test_the_window_counts_the_counter_deltas_inside_it() -> None:
    rows = rows_of([report(0, 0, 0, 0), report(50, 10, 1, 1.0), report(100, 30, 2, 3.0),
                    report(150, 60, 5, 6.0)])
    assert worker_window(rows, now=150, window_s=100) == GroupWindow(50, 4, 5.0)
    assert worker_window(rows, now=150, window_s=10) == GroupWindow()  # one row: no delta
    restarted = rows_of([report(100, 30, 2, 3.0), report(150, 5, 0, 0.5)])
    assert worker_window(restarted, now=150, window_s=100) == GroupWindow()
    assert pool_window([rows, rows], now=150, window_s=100) == GroupWindow(100, 8, 10.0)
