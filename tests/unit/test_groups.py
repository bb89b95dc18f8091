"""protocol.groups and the policy's groups: validation as a whole, per-group policies, sticky
assignment by a stable hash against the cumulative weights."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.groups import HASH_SPACE, assign, pool_name, split_pool, user_point, validate_pool
from protocol.ids import InvalidId
from protocol.policy import PolicyError, TurnsPolicy, parse_policy

BLUE_GREEN: dict[str, Any] = {"groups": [{"name": "blue", "weight": 90},
                                         {"name": "green", "weight": 10, "handler": "sleep"}]}

# (policy fields, error fragment or None when valid)
TABLE: list[Any] = [
    pytest.param({}, None, id="no-groups"),
    pytest.param(BLUE_GREEN, None, id="blue-green"),
    pytest.param({"groups": [{"name": "a", "weight": 1}]}, None, id="one-group"),
    pytest.param({"groups": [{"name": "a", "weight": 0}, {"name": "b", "weight": 0}]},
                 "at least one group needs a weight > 0", id="all-zero"),
    pytest.param({"groups": [{"name": "a", "weight": 1}, {"name": "a", "weight": 2}]},
                 "group names must be unique: a", id="duplicate"),
    pytest.param({"groups": [{"name": "a", "weight": -1}]}, "greater than or equal to 0", id="negative"),
    pytest.param({"groups": [{"name": "A", "weight": 1}]}, "invalid group 'A'", id="bad-name"),
    pytest.param({"groups": [{"name": "a.b", "weight": 1}]}, "invalid group", id="dot-in-name"),
    pytest.param({"groups": [{"name": "a", "weight": 1, "handler": "x.y:z"}]},
                 "group a: handler", id="import-path-handler"),
    pytest.param({"groups": [{"name": "a", "weight": 1, "min_workers": 4, "max_workers": 2}]},
                 "group a: policy: min_workers (4) > max_workers (2)", id="group-min>max"),
    pytest.param({"min_workers": 3, "groups": [{"name": "a", "weight": 1, "max_workers": 2}]},
                 "group a: policy: min_workers (3) > max_workers (2)", id="inherited-min>own-max"),
    pytest.param({"groups": [{"name": "a", "weight": 1, "scaling": {"concurrency": 0}}]},
                 "group a: concurrency", id="bad-override"),
    pytest.param({"groups": [{"name": "a", "weight": 1, "scaling": {"bogus": 1}}]},
                 "group a: bogus", id="unknown-override"),
    pytest.param({"groups": [{"name": "a", "weight": 1, "scaling": {"handler": "echo"}}]},
                 "scaling may not set handler", id="override-handler"),
    pytest.param({"groups": [{"name": "a", "weight": 1, "runtime": "py312"}]}, None, id="runtime-name"),
    pytest.param({"groups": [{"name": "a", "weight": 1, "runtime": "/opt/py/bin/python"}]},
                 "invalid runtime name", id="runtime-path"),
    pytest.param({"groups": [{"name": "a", "weight": 1, "python": "/opt/py/bin/python"}]},
                 "`python` may not be given in a policy", id="python-in-policy"),
    pytest.param({"groups": [{"name": "a", "weight": 1, "python": None, "image": None}]}, None,
                 id="null-python-and-image"),  # (as a policy written before runtimes holds them)
    pytest.param({"groups": [{"name": "a", "weight": 1, "image": "evil/miner:1"}]},
                 "name a runtime the commander allows instead, `runtime: <name>`", id="image-in-policy"),
    pytest.param({"groups": [{"name": "a", "weight": 1, "colour": "x"}]}, "colour", id="unknown-field"),
    pytest.param({"canary": "green"}, "the tier has none", id="canary-without-groups"),
    pytest.param({**BLUE_GREEN, "canary": "red"}, "canary 'red' is not one of the groups",
                 id="unknown-canary"),
    pytest.param({**BLUE_GREEN, "canary": "green", "rollout_guard": {"window_s": 60}}, None, id="guard"),
    pytest.param({**BLUE_GREEN, "rollout_guard": {"min_turns": 0}}, "min_turns", id="guard-bad"),
    pytest.param({"groups": [{"name": f"g{i}", "weight": 1} for i in range(9)]}, "groups", id="too-many"),
]


@pytest.mark.parametrize(("fields", "error"), TABLE)
def test_groups_are_validated_as_a_whole(fields: dict[str, Any], error: str | None) -> None:
    if error is None:
        parse_policy(fields)
        return
    with pytest.raises(PolicyError) as info:
        parse_policy(fields)
    assert error in str(info.value)
    assert "\n" not in str(info.value)


def test_a_tier_without_groups_dumps_as_before_plus_empty_fields() -> None:
    dumped = TurnsPolicy().model_dump()["rollout"]
    assert dumped["groups"] == () and dumped["canary"] is None and dumped["guard"] is None
    assert parse_policy(TurnsPolicy().to_json()) == TurnsPolicy()


def test_a_group_inherits_the_tier_unless_it_sets_its_own() -> None:
    policy = parse_policy({"concurrency": 4, "target_buffer": 2, "max_workers": 6,
                           "handler_options": {"k": 1}, "groups": [
                               {"name": "blue", "weight": 9},
                               {"name": "green", "weight": 1, "handler": "sleep", "min_workers": 0,
                                "max_workers": 2, "handler_options": {"k": 2},
                                "scaling": {"concurrency": 2}}]})
    blue, green = policy.for_group("blue"), policy.for_group("green")
    assert (blue.handler, blue.concurrency, blue.max_workers) == ("echo", 4, 6)
    assert blue.handler_options == {"k": 1}
    assert (green.handler, green.concurrency, green.min_workers, green.max_workers) == ("sleep", 2, 0, 2)
    assert green.scaling.target_buffer == 2 and green.handler_options == {"k": 2}
    assert blue.rollout.groups == () and green.rollout.canary is None
    with pytest.raises(KeyError):
        policy.for_group("red")


def test_the_handler_check_is_the_readers_groups() -> None:
    raw = {"handler": "echo", "groups": [{"name": "blue", "weight": 1},
                                          {"name": "green", "weight": 1, "handler": "v2"}]}
    assert parse_policy(raw, ["echo"], group="blue").rollout.groups  # blue runs echo: it has it
    parse_policy(raw, ["v2"], group="green")
    with pytest.raises(PolicyError, match="group green: handler: 'v2' is not registered"):
        parse_policy(raw, ["echo"], group="green")


@pytest.mark.parametrize(("tier", "group", "pool"), [("chat", "", "chat"), ("chat", "green", "chat.green"),
                                                     ("a-b_1", "g-2", "a-b_1.g-2")])
def test_pool_names(tier: str, group: str, pool: str) -> None:
    assert pool_name(tier, group) == pool
    assert split_pool(pool) == (tier, group)
    assert validate_pool(pool) == pool


@pytest.mark.parametrize("bad", ["Chat", "chat.", "chat.Green", ".green", "chat.g.h", "chat{x}", 3])
def test_bad_pools_are_refused(bad: object) -> None:
    with pytest.raises(InvalidId):
        validate_pool(bad)


# --- sticky assignment ------------------------------------------------------------------------
def test_the_point_is_stable_across_processes_and_hash_seeds() -> None:
    """BLAKE2b, not hash(): another interpreter with another PYTHONHASHSEED agrees."""
    users = ["alice", "bob", "u-1", "user.42@x"]
    code = ("import sys; from protocol.groups import user_point; "
            "print(*[user_point(u) for u in sys.argv[1:]])")
    out = subprocess.run([sys.executable, "-c", code, *users], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PYTHONPATH": "."})
    assert out.stdout.split() == [str(user_point(u)) for u in users]


# (weights, pin, unavailable, user point -> group): the slices of the cumulative weights
ASSIGN_TABLE: list[Any] = [
    pytest.param([("blue", 90), ("green", 10)], None, (), "blue", id="90-10"),
    pytest.param([("blue", 0), ("green", 10)], None, (), "green", id="all-green"),
    pytest.param([("blue", 90), ("green", 10)], "green", (), "green", id="pinned"),
    pytest.param([("blue", 90), ("green", 0)], "green", (), "green", id="pinned-to-weight-0"),
    pytest.param([("blue", 90), ("green", 10)], "red", (), None, id="pin-to-unknown-ignored"),
    pytest.param([("blue", 90), ("green", 10)], "green", ("green",), "blue", id="pin-to-rejected"),
    pytest.param([("blue", 90), ("green", 10)], None, ("blue",), "green", id="blue-rejected"),
    pytest.param([("blue", 0), ("green", 10)], None, ("green",), "blue", id="only-weight-rejected"),
    pytest.param([("blue", 1), ("green", 1)], None, ("blue", "green"), "blue", id="all-rejected"),
]


@pytest.mark.parametrize(("weights", "pin", "unavailable", "want"), ASSIGN_TABLE)
def test_assign(weights: list[tuple[str, float]], pin: str | None, unavailable: tuple[str, ...],
                want: str | None) -> None:
    users = [f"user-{i}" for i in range(200)]
    got = {assign(u, weights, pin, frozenset(unavailable)) for u in users}
    if want is None:  # the hash decides: both groups get users
        assert got == {"blue", "green"}
    elif pin is not None or want != "blue" or weights[1][1] == 0 or unavailable:
        assert got == {want}
    else:  # 90/10: most users blue, some green
        assert got == {"blue", "green"}


def test_a_90_10_split_is_near_90_10() -> None:
    users = [f"u{i}" for i in range(20_000)]
    green = sum(assign(u, [("blue", 90), ("green", 10)]) == "green" for u in users)
    assert 0.09 < green / len(users) < 0.11


def test_assign_follows_the_users_point() -> None:
    """The table of thresholds: the slice holding the point is the group."""
    for user in ("a", "b", "c", "d", "e", "f", "g"):
        p = user_point(user) / HASH_SPACE
        want = "blue" if p < 0.6 else "green" if p < 0.9 else "red"
        assert assign(user, [("blue", 6), ("green", 3), ("red", 1)]) == want


@settings(max_examples=200, deadline=None)
@given(before=st.integers(0, 100), after=st.integers(0, 100), order=st.booleans(),
       users=st.lists(st.text("abcdefghij0123456789-", min_size=1, max_size=12), max_size=60))
def test_raising_a_canary_moves_only_users_between_the_thresholds(
        before: int, after: int, order: bool, users: list[str]) -> None:
    """Canary from ``before`` % to ``after`` % (the total kept at 100, as ``fleet rollout``
    does): a user changes group iff its point lies between the two thresholds, and moves
    toward the group that grew."""
    def weights(canary: int) -> list[tuple[str, float]]:
        pair = [("stable", float(100 - canary)), ("canary", float(canary))]
        return pair if order else pair[::-1]
    for user in users:
        old, new = assign(user, weights(before)), assign(user, weights(after))
        p = user_point(user) * 100 / HASH_SPACE
        edge_before = 100 - before if order else before
        edge_after = 100 - after if order else after
        lo, hi = sorted((edge_before, edge_after))
        assert (old != new) == (lo <= p < hi), (user, p, before, after)
        if old != new:
            assert new == ("canary" if after > before else "stable")
