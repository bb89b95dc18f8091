"""The commander hands a dead worker's users on at once (stores.takeover), on fakeredis.

A recording runtime stands for the process runtime: ``reap`` returns the exits the test makes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import fakeredis
import pytest

from commander.commander import Commander
from commander.metrics import Metrics, sample
from commander.runtime import Lifecycle, WorkerHandle
from protocol import keys
from protocol.models import LedgerEvent
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.helpers import register, wait_until
from tests.unit.commander_helpers import RecordingRuntime, VirtualClock, leading, ledger

T = "chat"
READY = keys.ready(T)


@pytest.fixture
def r() -> Iterator[fakeredis.FakeRedis]:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    client.xgroup_create(READY, keys.GROUP, id="0", mkstream=True)
    write_policy(client, T, TurnsPolicy(min_workers=0, max_workers=4))
    yield client
    client.close()


@pytest.fixture
def rig(r: fakeredis.FakeRedis) -> tuple[Commander, RecordingRuntime, Metrics]:
    runtime, metrics = RecordingRuntime(T), Metrics()
    commander = leading(r, runtime, metrics, always_tiers=(T,))  # heartbeat_grace_s=0: its own test below
    return commander, runtime, metrics


def held_by(r: fakeredis.FakeRedis, worker: str, *users: str) -> None:
    """``worker`` read a notification of each user and holds their lanes."""
    for user in users:
        r.xadd(READY, {"user": user})
        r.set(keys.lane(user), f"{worker}|1", px=30_000)
    r.xreadgroup(keys.GROUP, worker, {READY: ">"}, count=len(users))


def consumers(r: fakeredis.FakeRedis) -> set[str]:
    return {c["name"].decode() for c in r.xinfo_consumers(READY, keys.GROUP)}


def exits(r: fakeredis.FakeRedis) -> list[LedgerEvent]:
    return ledger(r, "worker-exited")


def test_a_crashed_worker_is_taken_over_in_the_next_pass(r, rig) -> None:
    commander, runtime, metrics = rig
    held_by(r, "chat-w1", "alice", "bob")
    runtime.exit("chat-w1", code=-9)

    commander.pass_once(time.time())

    assert r.get(keys.lane("alice")) is None and r.get(keys.lane("bob")) is None
    assert "chat-w1" not in consumers(r)
    assert r.xpending(READY, keys.GROUP)["pending"] == 0 and r.xlen(READY) == 4  # 2 fresh ones
    (event,) = exits(r)
    assert event.victims == ["chat-w1"] and "handed 2 users on" in event.reason
    assert event.why["takeover"]["users"] == 2 and event.why["takeover"]["consumer_removed"]
    assert sample(metrics, "fleet_takeovers_total", {"tier": T}) == 1
    assert sample(metrics, "fleet_takeover_users_total", {"tier": T}) == 2

    commander.pass_once(time.time())
    assert len(exits(r)) == 1  # done once


def test_a_clean_drained_exit_needs_no_takeover(r, rig) -> None:
    commander, runtime, metrics = rig
    runtime.exit("chat-w2", code=0, drained=True, retire_reason="reclaim-idle")
    commander.pass_once(time.time())
    assert exits(r) == [] and sample(metrics, "fleet_takeovers_total", {"tier": T}) is None


def test_a_drain_killed_at_its_deadline_hands_its_users_on(r, rig) -> None:
    commander, runtime, _metrics = rig
    held_by(r, "chat-w3", "carol")
    runtime.exit("chat-w3", code=None, killed=True, retire_reason="consolidate")
    commander.pass_once(time.time())
    assert r.get(keys.lane("carol")) is None and "chat-w3" not in consumers(r)
    assert [e.victims for e in exits(r)] == [["chat-w3"]]


def test_an_expired_heartbeat_of_a_worker_it_does_not_run(r, rig) -> None:
    commander, runtime, _metrics = rig
    held_by(r, "chat-far", "dave")
    register(r, "chat-far", alive=False)
    held_by(r, "chat-live", "erin")
    register(r, "chat-live", alive=True)
    held_by(r, "chat-ours", "fay")  # ours: judged by its process, not by its heartbeat
    runtime.handles["chat-ours"] = WorkerHandle("chat-ours", T, 7, Lifecycle.RUNNING, time.time())

    commander.pass_once(time.time())

    assert r.get(keys.lane("dave")) is None and "chat-far" not in consumers(r)
    assert r.get(keys.lane("erin")) == b"chat-live|1" and r.get(keys.lane("fay")) == b"chat-ours|1"
    assert consumers(r) == {"chat-live", "chat-ours"}
    assert [e.victims for e in exits(r)] == [["chat-far"]]
    assert "heartbeat of worker chat-far expired" in exits(r)[0].reason
    commander.pass_once(time.time())
    assert len(exits(r)) == 1  # the registry entry stays, the takeover is not repeated


def test_the_sweep_removes_consumers_of_workers_long_gone(r, rig) -> None:
    commander, _runtime, _metrics = rig
    r.xreadgroup(keys.GROUP, "chat-old", {READY: ">"}, count=1)  # no registry entry, no pending
    commander.pass_once(time.time())
    assert consumers(r) == set()
    assert exits(r)[0].victims == ["chat-old"] and "no live worker" in exits(r)[0].reason


def test_the_sweep_asks_no_heartbeat_the_passs_registry_read_found_alive(r, rig, monkeypatch) -> None:
    """A registered worker whose heartbeat this pass read is alive is live for the sweep too: at
    10,000 workers a sweep (every 5 s) read 10,000 heartbeats again, one EXISTS each, and probed
    each tier's 63 higher shards one EXISTS each."""
    commander, _runtime, _metrics = rig
    for wid in ("chat-a", "chat-b"):
        register(r, wid, alive=True)
        r.xreadgroup(keys.GROUP, wid, {READY: ">"}, count=1)
    r.xreadgroup(keys.GROUP, "chat-old", {READY: ">"}, count=1)  # no registry entry
    asked: list[tuple[object, ...]] = []
    real = type(r.pipeline()).exists

    def exists(pipe, *names):
        asked.append(names)
        return real(pipe, *names)

    monkeypatch.setattr(type(r.pipeline()), "exists", exists)
    commander.pass_once(time.time())
    assert consumers(r) == {"chat-a", "chat-b"}  # the old one swept, as ever
    # one EXISTS of a key alone: the old consumer's heartbeat; the shards probed in one EXISTS
    assert [names for names in asked if len(names) == 1] == [(keys.heartbeat("chat-old"),)], asked


def test_a_failed_takeover_is_logged_and_retried_next_pass(r, rig, monkeypatch, caplog) -> None:
    commander, runtime, _metrics = rig
    held_by(r, "chat-w4", "gus")
    runtime.exit("chat-w4")
    import commander.dead_workers as module

    real = module.take_over
    calls = []

    def flaky(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 1:
            raise ConnectionError("Redis went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "take_over", flaky)
    commander.pass_once(time.time())  # does not raise
    assert "takeover of worker chat-w4" in caplog.text and r.get(keys.lane("gus")) is not None
    commander.pass_once(time.time())
    assert r.get(keys.lane("gus")) is None and "chat-w4" not in consumers(r)


def test_only_the_leader_takes_over(r, rig) -> None:
    commander, runtime, _metrics = rig
    r.set(keys.LEADER, "c2|99", px=30_000)  # another commander leads now
    held_by(r, "chat-w5", "hal")
    runtime.exit("chat-w5")
    commander.pass_once(time.time())
    assert r.get(keys.lane("hal")) == b"chat-w5|1" and "chat-w5" in consumers(r)


def test_a_worker_exit_ends_the_wait_for_the_next_pass(r) -> None:
    """The takeover starts when the commander sees the exit: not up to a whole pass interval
    later (a process the commander runs is taken over within a second of its death)."""
    import threading

    runtime = RecordingRuntime(T)
    runtime.handles["chat-w1"] = WorkerHandle("chat-w1", T, 1, Lifecycle.RUNNING, 0.0)
    commander = leading(r, runtime, interval_s=30.0, lease_ttl_ms=60_000, always_tiers=(T,))
    held_by(r, "chat-w1", "ida")
    stop = threading.Event()
    loop = threading.Thread(target=commander.run, args=(stop,))
    killer = threading.Timer(0.3, runtime.exit, args=("chat-w1",))
    started = time.monotonic()
    loop.start()
    killer.start()
    try:
        wait_until(lambda: exits(r), 15, "the takeover", every=0.02)
    finally:
        stop.set()
        killer.join()
        loop.join(timeout=30)
    assert [e.victims for e in exits(r)] == [["chat-w1"]]
    assert time.monotonic() - started < 15  # woke on the exit, not at the next pass 30 s on


def test_right_after_an_outage_a_missing_heartbeat_is_not_believed(r) -> None:
    """Every heartbeat expires in an outage longer than its TTL: the live workers' too. A
    takeover of a live worker is safe (fenced) but costs it every turn in flight, so the
    commander waits until they could have beaten again."""
    clock = VirtualClock()
    commander = leading(r, RecordingRuntime(T), clock=clock.time, monotonic=clock.monotonic,
                        heartbeat_grace_s=6.0, always_tiers=(T,))
    held_by(r, "chat-far", "dave")
    register(r, "chat-far", alive=False)  # no heartbeat: dead, or not beaten again yet

    commander.pass_once(clock.time())  # the first pass of a leadership: an outage just ended
    assert r.get(keys.lane("dave")) == b"chat-far|1" and "chat-far" in consumers(r)
    assert exits(r) == []

    for _ in range(14):  # passes every 0.5 s: after 7 s the grace has passed, no beat came
        clock.advance(0.5)
        commander.pass_once(clock.time())
    assert r.get(keys.lane("dave")) is None and "chat-far" not in consumers(r)
    assert [e.victims for e in exits(r)] == [["chat-far"]]
