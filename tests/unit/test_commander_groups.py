"""The commander and a tier's groups, on fakeredis with a recording runtime: one pool per group
scaled on its group's policy, the rollout ledger, a rejected group, a removed group's workers
drained, and the rollout guard aborting a failing canary."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest

from commander.commander import Commander
from commander.metrics import Metrics
from protocol import keys
from protocol.codec import encode
from protocol.groups import assign
from protocol.models import Counters, OccupancyReport, Slots
from protocol.policy import parse_policy, updated
from stores.group_assignment import known_pools, rejected_groups
from stores.policies import read_policy, write_policy
from tests.unit.commander_helpers import RecordingRuntime, leading, ledger

T = "chat"
GROUPS: dict[str, Any] = {"min_workers": 0, "groups": [
    {"name": "blue", "weight": 90, "min_workers": 2, "max_workers": 4},
    {"name": "green", "weight": 10, "min_workers": 1, "max_workers": 2, "handler": "sleep"}]}


Rig = tuple[Commander, RecordingRuntime]


@pytest.fixture
def r() -> Iterator[fakeredis.FakeRedis]:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    write_policy(client, T, parse_policy(GROUPS))
    yield client
    client.close()


@pytest.fixture
def rig(r: fakeredis.FakeRedis) -> Rig:
    runtime = RecordingRuntime()
    return leading(r, runtime), runtime


def test_each_group_is_a_pool_scaled_on_its_own_policy(rig: Rig) -> None:
    commander, runtime = rig
    commander.pass_once(time.time())
    assert (runtime.count("chat.blue"), runtime.count("chat.green"), runtime.count("chat")) == (2, 1, 0)
    seen = commander.board.seen
    assert seen is not None and set(seen.tiers) >= {"chat.blue", "chat.green"}
    assert seen.tiers["chat.green"].policy.handler == "sleep"


def test_a_weight_change_is_a_rollout_event(r: fakeredis.FakeRedis, rig: Rig) -> None:
    commander, _runtime = rig
    commander.pass_once(time.time())
    assert not ledger(r, "rollout")  # the first look is no change
    policy = read_policy(r, T).policy
    write_policy(r, T, updated(policy, {"canary": "green", "groups": [
        {**g.model_dump(mode="json"), "weight": 50} for g in policy.rollout.groups]}))
    commander.pass_once(time.time())
    (event,) = ledger(r, "rollout")
    assert event.tier == T and "blue 90, green 10 -> blue 50, green 50 (canary green)" in event.reason


def test_a_group_that_cannot_start_is_rejected_and_accepted_again(
        r: fakeredis.FakeRedis, rig: Rig) -> None:
    commander, runtime = rig
    runtime.broken["chat.green"] = "interpreter /nope/bin/python is missing or not executable"
    commander.pass_once(time.time())
    assert runtime.count("chat.green") == 0 and runtime.count("chat.blue") == 2  # the tier serves on
    assert "missing" in rejected_groups(r, T)["green"]
    (event,) = ledger(r, "group-rejected")
    assert event.tier == "chat.green" and "/nope/bin/python" in event.reason
    rejected = frozenset(rejected_groups(r, T))
    assert all(assign(f"u{i}", [("blue", 90), ("green", 10)], None, rejected) == "blue" for i in range(200))
    commander.pass_once(time.time())
    assert len(ledger(r, "group-rejected")) == 1  # recorded once
    del runtime.broken["chat.green"]
    commander.pass_once(time.time())
    assert runtime.count("chat.green") == 1 and rejected_groups(r, T) == {}
    assert len(ledger(r, "group-accepted")) == 1


def test_a_removed_groups_workers_are_drained(r: fakeredis.FakeRedis,
                                              rig: Rig) -> None:
    commander, runtime = rig
    commander.pass_once(time.time())
    policy = read_policy(r, T).policy
    write_policy(r, T, parse_policy({**policy.model_dump(mode="json"),
                                     "groups": [{"name": "blue", "weight": 100, "min_workers": 2}]}))
    commander.pass_once(time.time())
    assert sorted(runtime.retired) == ["chat.green-3"]
    (event,) = ledger(r, "group-removed")
    assert event.victims == ["chat.green-3"]
    commander.pass_once(time.time())
    assert runtime.retired == ["chat.green-3"]  # once


def _report(wid: str, pool: str, ts: float, turns: int, errors: int) -> OccupancyReport:
    return OccupancyReport(worker=wid, tier=pool, ts=ts, state="ready", users=0, active_users=0,
                           slots=Slots(busy=0, total=1, queue_depth=0), cpu=None, rss=0,
                           counters=Counters(turns=turns, errors=errors, handler_seconds=turns * 0.01),
                           load=(0.0, 0.0, 0.0))


def test_the_guard_aborts_a_failing_canary(r: fakeredis.FakeRedis, rig: Rig) -> None:
    commander, _runtime = rig
    policy = read_policy(r, T).policy
    write_policy(r, T, parse_policy({**policy.model_dump(mode="json"), "canary": "green",
                                     "rollout_guard": {"window_s": 60, "min_turns": 20}}))
    now = time.time()
    for ts, turns, errors in ((now - 30, 0, 0), (now - 1, 100, 30)):  # as the workers report them
        r.xadd(keys.REPORTS, {"m": encode(_report("g1", "chat.green", ts, turns, errors))})
    for ts, turns, errors in ((now - 30, 0, 0), (now - 1, 900, 9)):
        r.xadd(keys.REPORTS, {"m": encode(_report("b1", "chat.blue", ts, turns, errors))})
    commander.pass_once(now)
    (abort,) = ledger(r, "rollout-abort")
    assert "canary green aborted: error rate 23.1% of handler calls" in abort.reason
    assert read_policy(r, T).policy.rollout.weights() == (("blue", 100.0), ("green", 0.0))
    commander.pass_once(now + 1)
    assert len(ledger(r, "rollout-abort")) == 1 and not ledger(r, "rollout")  # (its own event only)


def _queued(r: fakeredis.FakeRedis, user: str, pool: str) -> None:
    """A turn of ``user`` queued on ``pool`` as a submit leaves it: inbox entry, active mark,
    notification on the pool's ready stream."""
    r.xadd(keys.inbox(user), {"text": "hello"})
    r.zadd(keys.active(pool), {user: time.time()})
    r.xadd(keys.ready(pool, 0), {"user": user})


def _notified(r: fakeredis.FakeRedis, pool: str) -> list[str]:
    return [fields[b"user"].decode() for _id, fields in r.xrange(keys.ready(pool, 0))]


def test_a_removed_pools_queued_users_are_notified_on_their_group_once_its_workers_are_gone(
        r: fakeredis.FakeRedis, rig: Rig) -> None:
    """A turn notified on a pool that a policy edit removes, while no worker of the pool reads
    it any more, would wait for the user's next submit: once the pool has no live worker, the
    commander notifies each of its users with a turn still to serve on the user's group now."""
    commander, runtime = rig
    commander.pass_once(time.time())
    weights = [("blue", 90.0), ("green", 10.0)]
    waiting, served = [u for u in (f"u{i}" for i in range(400)) if assign(u, weights) == "green"][:2]
    _queued(r, waiting, "chat.green")
    _queued(r, served, "chat.green")
    newest = r.xrevrange(keys.inbox(served), "+", "-", count=1)[0][0]
    r.hset(keys.state(served), "cursor", newest)  # its turn was served before the edit
    policy = read_policy(r, T).policy
    write_policy(r, T, parse_policy({**policy.model_dump(mode="json"),
                                     "groups": [{"name": "blue", "weight": 100, "min_workers": 2}]}))
    commander.pass_once(time.time())
    assert runtime.retired == ["chat.green-3"]
    assert _notified(r, "chat.blue") == []  # its draining worker may still serve them
    del runtime.handles["chat.green-3"]  # the drained worker exited and was reaped
    commander.pass_once(time.time())
    assert _notified(r, "chat.blue") == [waiting]
    (event,) = ledger(r, "renotified")
    assert event.tier == "chat.green" and waiting in event.reason
    commander.pass_once(time.time())
    assert _notified(r, "chat.blue") == [waiting]  # once per queued turn, not every pass


def test_a_removed_pool_is_forgotten_once_drained_and_empty_and_the_runtime_told(
        r: fakeredis.FakeRedis) -> None:
    runtime, metrics = RecordingRuntime(), Metrics()
    commander = leading(r, runtime, metrics)
    commander.pass_once(time.time())
    assert known_pools(r, T) == {"chat.blue", "chat.green"}
    policy = read_policy(r, T).policy
    write_policy(r, T, parse_policy({**policy.model_dump(mode="json"),
                                     "groups": [{"name": "blue", "weight": 100, "min_workers": 2}]}))
    commander.pass_once(time.time())
    assert runtime.retired == ["chat.green-3"] and runtime.forgotten == []  # its worker drains first
    del runtime.handles["chat.green-3"]
    assert b'tier="chat.green"' in metrics.render()
    commander.pass_once(time.time())  # no worker, nothing queued, nobody submitted: forgotten
    assert known_pools(r, T) == {"chat.blue"} and runtime.forgotten == ["chat.green"]
    assert b'tier="chat.green"' not in metrics.render()  # and so are its metrics
    commander.pass_once(time.time())
    assert runtime.forgotten == ["chat.green"]  # once
