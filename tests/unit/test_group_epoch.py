"""A weight change takes effect for a user at one turn boundary and never flaps: the user's group
is recorded with the epoch of the weights it was chosen by (``protocol.groups.settle``), and a
reader whose view of the weights is older follows the record instead of its own view."""

from __future__ import annotations

import fakeredis

from protocol.groups import Group, Rollout, assign, settle
from protocol.policy import TurnsPolicy
from stores.policies import read_policy, write_policy

BEFORE = (("blue", 100.0), ("green", 0.0))
DURING = (("blue", 50.0), ("green", 50.0))


def movers(n: int = 400) -> list[str]:
    """Users whom the change moves (blue before, green during)."""
    return [u for u in (f"u{i}" for i in range(n)) if assign(u, DURING) == "green"]


def test_readers_with_old_and_new_views_never_flap_a_user() -> None:
    """Workers see a change at different moments: turn after turn meets a worker with the old
    view (epoch 1) or the new one (epoch 2), in any order. Without the record the user would go
    blue, green, blue, green...; with it, once to green and never back within the epoch."""
    for user in movers()[:20]:
        record: tuple[str, int] | None = None
        served = []
        for view in [(BEFORE, 1), (DURING, 2), (BEFORE, 1), (DURING, 2), (BEFORE, 1), (BEFORE, 1)]:
            group, record = settle(user, view[0], view[1], None, frozenset(), record)
            served.append(group)
        assert served == ["blue", "green", "green", "green", "green", "green"], (user, served)
        assert record == ("green", 2)


def test_an_abort_moves_the_user_back_once_and_a_pin_or_a_rejection_still_wins() -> None:
    user = movers()[0]
    group, record = settle(user, DURING, 2, None, frozenset(), ("blue", 1))
    assert (group, record) == ("green", ("green", 2))
    group, record = settle(user, BEFORE, 3, None, frozenset(), record)  # the abort: epoch 3
    assert (group, record) == ("blue", ("blue", 3))
    assert settle(user, DURING, 2, None, frozenset(), record) == ("blue", ("blue", 3))  # a stale view
    assert settle(user, DURING, 3, "green", frozenset(), record)[0] == "green"  # pinned
    # its recorded group rejected (its workers cannot start): chosen again at once
    assert settle(user, DURING, 3, None, frozenset({"blue"}), record) == ("green", ("green", 3))
    # a record of a newer epoch naming a group this view does not know: followed all the same
    assert settle(user, BEFORE, 3, None, frozenset(), ("violet", 4)) == ("violet", ("violet", 4))


def test_a_weight_change_written_bumps_the_epoch_and_other_edits_keep_it() -> None:
    r = fakeredis.FakeRedis()
    groups = (Group(name="blue", weight=100), Group(name="green", weight=0))
    write_policy(r, "chat", TurnsPolicy(rollout=Rollout(groups=groups)))
    first = read_policy(r, "chat").policy.rollout.epoch
    assert isinstance(read_policy(r, "chat").policy, TurnsPolicy)
    policy = TurnsPolicy(concurrency=4, rollout=Rollout(groups=groups))  # an edit, weights kept
    write_policy(r, "chat", policy)
    assert read_policy(r, "chat").policy.rollout.epoch == first
    moved = TurnsPolicy(concurrency=4, rollout=Rollout(groups=(Group(name="blue", weight=50),
                                                               Group(name="green", weight=50))))
    write_policy(r, "chat", moved)  # (written without an epoch, as a person's JSON would be)
    assert read_policy(r, "chat").policy.rollout.epoch == first + 1
