"""The relay: every committed deferral reaches RQ exactly once, whatever point a
relay dies at, on fakeredis (RQ's unique enqueue is a Lua script: fakeredis runs it).

A crash is a ``Crash`` (a BaseException: nothing in the relay catches it) raised at a chosen
call; the relay object is then dropped, as a killed process would be, and a new relay (another
consumer name) takes over its pending notification."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
import redis

from protocol import keys
from protocol.codec import encode
from protocol.deferral import Deferral
from stores import outbox, rqjobs
from stores.turns import Lease, UserStore, Writes
from worker.rq import rq_worker
from worker.rq.relay import Relay, RelaySettings

QUEUE = "writeback"


class Crash(BaseException):
    """The relay process dies here."""


@pytest.fixture
def server() -> Iterator[fakeredis.FakeServer]:
    yield fakeredis.FakeServer()


def sync(server: fakeredis.FakeServer) -> redis.Redis:
    return fakeredis.FakeRedis(server=server)


def deferral(user: str, turn_id: str, index: int) -> Deferral:
    return Deferral(name="count", queue=QUEUE, user=user, turn_id=turn_id, index=index, ts=1.0)


async def _commit_turn(server: fakeredis.FakeServer, user: str, turn_id: str, n: int) -> None:
    """One turn of ``user`` committed with ``n`` deferrals of job ``count``, the worker's way."""
    ar = fakeredis.FakeAsyncRedis(server=server)
    store = UserStore(ar, "w1")
    entry = (await ar.xadd(keys.inbox(user), {"text": "hi", "turn_id": turn_id, "tier": "chat"})).decode()
    await ar.zadd(keys.active("chat"), {user: 1.0})
    lease = await store.acquire(user)
    assert isinstance(lease, Lease)
    ds = [deferral(user, turn_id, i) for i in range(n)]
    w = Writes(turn_id=turn_id, reply=b"r", deferrals=[(d.job_id, encode(d)) for d in ds])
    assert (await store.commit(lease, entry, turn_id, w, 1)).result == "ok"
    await ar.aclose()


def commit(server: fakeredis.FakeServer, turns: list[tuple[str, str, int]]) -> int:
    for user, turn_id, n in turns:
        asyncio.run(_commit_turn(server, user, turn_id, n))
    return sum(n for _, _, n in turns)


TURNS = [("alice", "t1", 2), ("alice", "t2", 1), ("bob", "t1", 3)]


def relay(server: fakeredis.FakeServer, name: str) -> Relay:
    s = RelaySettings(relay_id=name, claim_idle_ms=0, block_ms=1, sweep_interval_s=3600)
    return Relay(s, r=sync(server))


def rq_state(server: fakeredis.FakeServer) -> tuple[list[str], int]:
    r = sync(server)
    queued = [x.decode() for x in r.lrange(f"rq:queue:{QUEUE}", 0, -1)]
    return queued, int(r.xlen(keys.OUTBOX_READY))


def run_jobs(server: fakeredis.FakeServer) -> dict[str, int]:
    r = sync(server)
    rq_worker.build(r, [QUEUE], "rq-test").work(burst=True)
    return {u: int(r.hget(keys.usage(u), "jobs_run") or 0) for u in ("alice", "bob")}


def expected_ids() -> set[str]:
    return {deferral(u, t, i).job_id for u, t, n in TURNS for i in range(n)}


def test_a_pass_moves_every_entry_once_and_acks(server: fakeredis.FakeServer) -> None:
    total = commit(server, TURNS)
    rl = relay(server, "r1")
    outbox.join_relay_group(rl.r)
    rl.step()
    queued, hints = rq_state(server)
    assert sorted(queued) == sorted(expected_ids()) and len(queued) == total
    assert hints == 0  # acked and deleted
    assert all(outbox.outbox_length(rl.r, u) == 0 for u in ("alice", "bob"))
    rl.step()  # nothing new: nothing changes
    assert len(rq_state(server)[0]) == total
    assert (rl.stats.enqueued, rl.stats.duplicates) == (total, 0)
    assert run_jobs(server) == {"alice": 3, "bob": 3}


CRASH_POINTS = {
    "before-the-first-enqueue": ("stores.rqjobs.enqueue", 0),
    "after-two-enqueues": ("stores.rqjobs.enqueue", 2),
    "after-the-enqueues-before-the-delete": ("stores.outbox.delete_entries", 0),
    "after-the-delete-before-the-ack": ("stores.outbox.ack_hints", 0),
}


@pytest.mark.parametrize("point", CRASH_POINTS.values(), ids=CRASH_POINTS.keys())
def test_a_relay_killed_anywhere_leaves_each_job_once_in_rq(server: fakeredis.FakeServer,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            point: tuple[str, int]) -> None:
    total = commit(server, TURNS)
    target, after = point
    module_name, fn_name = target.rsplit(".", 1)
    module: Any = {"stores.rqjobs": rqjobs, "stores.outbox": outbox}[module_name]
    real = getattr(module, fn_name)
    calls = {"n": 0}

    def dies(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > after:
            raise Crash(target)
        return real(*args, **kwargs)

    first = relay(server, "r1")
    outbox.join_relay_group(first.r)
    monkeypatch.setattr(module, fn_name, dies)
    with pytest.raises(Crash):
        first.step()
    monkeypatch.setattr(module, fn_name, real)
    assert sync(server).xpending(keys.OUTBOX_READY, keys.RELAY_GROUP)["pending"] > 0  # the duty stays

    second = relay(server, "r2")  # a new process: another consumer, claims what r1 left pending
    second.step()
    second.step()
    queued, hints = rq_state(server)
    assert sorted(queued) == sorted(expected_ids()) and len(queued) == total  # once each
    assert hints == 0
    assert run_jobs(server) == {"alice": 3, "bob": 3}  # the job's own effect: exactly once


def test_two_relays_on_the_same_user_enqueue_once(server: fakeredis.FakeServer) -> None:
    total = commit(server, TURNS)
    a, b = relay(server, "r1"), relay(server, "r2")
    outbox.join_relay_group(a.r)
    # both see the same outbox before either deletes it (a hint read by one, a sweep by the other)
    entries = {u: outbox.read_outbox(a.r, u, 100) for u in ("alice", "bob")}
    for user, rows in entries.items():
        for e in rows:
            a.relay_entry(user, e)
            b.relay_entry(user, e)
    assert a.stats.enqueued == total and b.stats.duplicates == total
    assert len(rq_state(server)[0]) == total


def test_the_sweep_finds_an_outbox_whose_notification_was_never_written(server: fakeredis.FakeServer) -> None:
    total = commit(server, TURNS)
    r = sync(server)
    r.delete(keys.OUTBOX_READY)  # the worker died between its commit and the notification
    r.sadd(keys.TIERS, "chat")
    rl = relay(server, "r1")
    outbox.join_relay_group(r)
    rl.handle(outbox.read_hints(r, "r1", 100, 1))
    assert rq_state(server)[0] == []  # no notification: nothing relayed by the notifications
    assert rl.sweep() == 2
    assert len(rq_state(server)[0]) == total
    commit(server, [("alice", "t9", 1)])
    r.delete(keys.OUTBOX_READY)
    outbox.join_relay_group(r)
    fresh = relay(server, "r2")  # a relay started anew sweeps in its first pass
    fresh.step()
    assert fresh.stats.enqueued == 1


def test_an_entry_that_is_no_deferral_is_dead_lettered_not_retried(server: fakeredis.FakeServer) -> None:
    r = sync(server)
    good = deferral("alice", "t1", 0)
    r.xadd(keys.outbox("alice"), {"job": "x", "d": b"\x00not msgpack"})
    r.xadd(keys.outbox("alice"), {"job": "fleet-other-0", "d": encode(good)})  # id mismatch
    r.xadd(keys.outbox("alice"), {"job": good.job_id, "d": encode(good)})
    r.xadd(keys.OUTBOX_READY, {"user": "alice"})
    r.xadd(keys.OUTBOX_READY, {"user": "not a user!"})
    rl = relay(server, "r1")
    outbox.join_relay_group(r)
    rl.step()
    assert (rl.stats.dead, rl.stats.enqueued) == (2, 1)
    assert r.xlen(keys.OUTBOX_DEAD) == 2 and r.xlen(keys.outbox("alice")) == 0
    assert rq_state(server) == ([good.job_id], 0)


def test_a_delayed_deferral_waits_in_the_scheduled_registry(server: fakeredis.FakeServer) -> None:
    r = sync(server)
    d = Deferral(name="noop", queue=QUEUE, user="alice", turn_id="t1", index=0, ts=1e10, delay_s=5)
    assert rqjobs.enqueue(r, d) and not rqjobs.enqueue(r, d)
    st = rqjobs.queue_stats(r, QUEUE)
    assert (st.queued, st.scheduled) == (0, 1)


def test_a_relay_recreates_its_group_when_redis_lost_it(server: fakeredis.FakeServer) -> None:
    r = sync(server)
    rl = relay(server, "r1")
    t = threading.Thread(target=rl.run)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while rl.stats.passes < 2 and time.monotonic() < deadline:  # running, with its group
            rl.stop.wait(0.01)
        r.delete(keys.OUTBOX_READY)  # a Redis restarted without its data: stream and group gone
        commit(server, [("alice", "t1", 1)])  # the worker's XADD creates the stream, not the group
        while rl.stats.enqueued < 1 and time.monotonic() < deadline:
            rl.stop.wait(0.01)
    finally:
        rl.stop.set()
        t.join(10)
    assert rl.stats.enqueued == 1 and len(rq_state(server)[0]) == 1
