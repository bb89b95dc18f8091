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
from commander.runtime import Handles, Runtime, WorkerHandle, WorkerIds, WorkerState
from commander.settings import CommanderSettings
from protocol import keys
from protocol.codec import decode
from protocol.groups import assign
from protocol.models import Counters, LedgerEvent, OccupancyReport, Slots
from protocol.policy import parse_policy
from stores.group_assignment import known_pools, rejected_groups
from stores.ledger import ledger_page
from stores.policies import read_policy, write_policy

T = "chat"
GROUPS: dict[str, Any] = {"min_workers": 0, "groups": [
    {"name": "blue", "weight": 90, "min_workers": 2, "max_workers": 4},
    {"name": "green", "weight": 10, "min_workers": 1, "max_workers": 2, "handler": "sleep"}]}


class Recording(Runtime):
    """Spawns are recorded as running handles; ``broken`` pools fail their group check."""

    name = "recording"

    def __init__(self) -> None:
        self.handles: dict[str, WorkerHandle] = {}
        self.retired: list[str] = []
        self.broken: dict[str, str] = {}
        self.forgotten: list[str] = []
        self.n = 0

    def spawn(self, tier: str, n: int = 1) -> WorkerIds:
        ids = []
        for _ in range(n):
            self.n += 1
            wid = f"{tier}-{self.n}"
            self.handles[wid] = WorkerHandle(wid, tier, 1000 + self.n, WorkerState.RUNNING, time.time())
            ids.append(wid)
        return ids

    def check_group(self, pool: str) -> str | None:
        return self.broken.get(pool)

    def pool_forgotten(self, pool: str) -> None:
        self.forgotten.append(pool)

    def retire(self, worker_id: str, reason: str = "", drain_timeout_s: float | None = None) -> None:
        self.retired.append(worker_id)
        self.handles[worker_id].state = WorkerState.DRAINING

    def reap(self) -> Handles:
        return []

    def adopt(self) -> Handles:
        return []

    def stop_all(self, timeout: float | None = None) -> Handles:
        return []

    def list(self) -> Handles:
        return list(self.handles.values())

    def count(self, pool: str) -> int:
        return sum(1 for h in self.handles.values() if h.tier == pool and h.state is WorkerState.RUNNING)


@pytest.fixture
def r() -> Iterator[fakeredis.FakeRedis]:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    write_policy(client, T, parse_policy(GROUPS))
    yield client
    client.close()


@pytest.fixture
def rig(r: fakeredis.FakeRedis) -> tuple[Commander, Recording]:
    runtime = Recording()
    commander = Commander(r, runtime, CommanderSettings(commander_id="c1", metrics_port=None,
                                                        heartbeat_grace_s=0))
    assert commander.leader.campaign()
    return commander, runtime


def events(r: fakeredis.FakeRedis, action: str) -> list[LedgerEvent]:
    rows = ledger_page(r, "+", 1000)
    out = [decode(LedgerEvent, fields[b"m"]) for _id, fields in rows]
    return [e for e in out if e.action == action]


def test_each_group_is_a_pool_scaled_on_its_own_policy(rig: tuple[Commander, Recording]) -> None:
    commander, runtime = rig
    commander.pass_once(time.time())
    assert (runtime.count("chat.blue"), runtime.count("chat.green"), runtime.count("chat")) == (2, 1, 0)
    assert set(commander.tiers) >= {"chat.blue", "chat.green"}
    assert commander.tiers["chat.green"].policy.handler == "sleep"


def test_a_weight_change_is_a_rollout_event(r: fakeredis.FakeRedis, rig: tuple[Commander, Recording]) -> None:
    commander, _runtime = rig
    commander.pass_once(time.time())
    assert not events(r, "rollout")  # the first look is no change
    policy = read_policy(r, T).policy
    write_policy(r, T, parse_policy({**policy.model_dump(mode="json"), "canary": "green", "groups": [
        {**g.model_dump(mode="json"), "weight": 50} for g in policy.groups]}))
    commander.pass_once(time.time())
    (event,) = events(r, "rollout")
    assert event.tier == T and "blue 90, green 10 -> blue 50, green 50 (canary green)" in event.reason


def test_a_group_that_cannot_start_is_rejected_and_accepted_again(
        r: fakeredis.FakeRedis, rig: tuple[Commander, Recording]) -> None:
    commander, runtime = rig
    runtime.broken["chat.green"] = "interpreter /nope/bin/python is missing or not executable"
    commander.pass_once(time.time())
    assert runtime.count("chat.green") == 0 and runtime.count("chat.blue") == 2  # the tier serves on
    assert "missing" in rejected_groups(r, T)["green"]
    (event,) = events(r, "group-rejected")
    assert event.tier == "chat.green" and "/nope/bin/python" in event.reason
    rejected = frozenset(rejected_groups(r, T))
    assert all(assign(f"u{i}", [("blue", 90), ("green", 10)], None, rejected) == "blue" for i in range(200))
    commander.pass_once(time.time())
    assert len(events(r, "group-rejected")) == 1  # recorded once
    del runtime.broken["chat.green"]
    commander.pass_once(time.time())
    assert runtime.count("chat.green") == 1 and rejected_groups(r, T) == {}
    assert len(events(r, "group-accepted")) == 1


def test_a_removed_groups_workers_are_drained(r: fakeredis.FakeRedis,
                                              rig: tuple[Commander, Recording]) -> None:
    commander, runtime = rig
    commander.pass_once(time.time())
    policy = read_policy(r, T).policy
    write_policy(r, T, parse_policy({**policy.model_dump(mode="json"),
                                     "groups": [{"name": "blue", "weight": 100, "min_workers": 2}]}))
    commander.pass_once(time.time())
    assert sorted(runtime.retired) == ["chat.green-3"]
    (event,) = events(r, "group-removed")
    assert event.victims == ["chat.green-3"]
    commander.pass_once(time.time())
    assert runtime.retired == ["chat.green-3"]  # once


def _report(wid: str, pool: str, ts: float, turns: int, errors: int) -> OccupancyReport:
    return OccupancyReport(worker=wid, tier=pool, ts=ts, state="ready", users=0, active_users=0,
                           slots=Slots(busy=0, total=1, queue_depth=0), cpu=None, rss=0,
                           counters=Counters(turns=turns, errors=errors, handler_seconds=turns * 0.01),
                           load=(0.0, 0.0, 0.0))


def test_the_guard_aborts_a_failing_canary(r: fakeredis.FakeRedis, rig: tuple[Commander, Recording]) -> None:
    commander, _runtime = rig
    policy = read_policy(r, T).policy
    write_policy(r, T, parse_policy({**policy.model_dump(mode="json"), "canary": "green",
                                     "rollout_guard": {"window_s": 60, "min_turns": 20}}))
    now = time.time()
    for ts, turns, errors in ((now - 30, 0, 0), (now - 1, 100, 30)):
        commander.observer.evaluator.add(_report("g1", "chat.green", ts, turns, errors))
    for ts, turns, errors in ((now - 30, 0, 0), (now - 1, 900, 9)):
        commander.observer.evaluator.add(_report("b1", "chat.blue", ts, turns, errors))
    commander.pass_once(now)
    (abort,) = events(r, "rollout-abort")
    assert "canary green aborted: error rate 23.1% of handler calls" in abort.reason
    assert read_policy(r, T).policy.weights() == (("blue", 100.0), ("green", 0.0))
    commander.pass_once(now + 1)
    assert len(events(r, "rollout-abort")) == 1 and not events(r, "rollout")  # (its own event only)


def _queued(r: fakeredis.FakeRedis, user: str, pool: str) -> None:
    """A turn of ``user`` queued on ``pool`` as a submit leaves it: inbox entry, active mark,
    notification on the pool's ready stream."""
    r.xadd(keys.inbox(user), {"text": "hello"})
    r.zadd(keys.active(pool), {user: time.time()})
    r.xadd(keys.ready(pool, 0), {"user": user})


def _notified(r: fakeredis.FakeRedis, pool: str) -> list[str]:
    return [fields[b"user"].decode() for _id, fields in r.xrange(keys.ready(pool, 0))]


def test_a_removed_pools_queued_users_are_notified_on_their_group_once_its_workers_are_gone(
        r: fakeredis.FakeRedis, rig: tuple[Commander, Recording]) -> None:
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
    (event,) = events(r, "renotified")
    assert event.tier == "chat.green" and waiting in event.reason
    commander.pass_once(time.time())
    assert _notified(r, "chat.blue") == [waiting]  # once per queued turn, not every pass


def test_a_removed_pool_is_forgotten_once_drained_and_empty_and_the_runtime_told(
        r: fakeredis.FakeRedis, rig: tuple[Commander, Recording]) -> None:
    commander, runtime = rig
    commander.pass_once(time.time())
    assert known_pools(r, T) == {"chat.blue", "chat.green"}
    policy = read_policy(r, T).policy
    write_policy(r, T, parse_policy({**policy.model_dump(mode="json"),
                                     "groups": [{"name": "blue", "weight": 100, "min_workers": 2}]}))
    commander.pass_once(time.time())
    assert runtime.retired == ["chat.green-3"] and runtime.forgotten == []  # its worker drains first
    del runtime.handles["chat.green-3"]
    commander.pass_once(time.time())  # no worker, nothing queued, nobody submitted: forgotten
    assert known_pools(r, T) == {"chat.blue"} and runtime.forgotten == ["chat.green"]
    commander.pass_once(time.time())
    assert runtime.forgotten == ["chat.green"]  # once
