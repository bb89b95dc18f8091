"""stores.takeover on fakeredis (its Lua runs the real scripts through lupa).

A dead worker's pending notifications are handed on at once: its lanes cleared (fencing a
worker that was only paused), fresh notifications posted *before* the old ones are acked, and
its consumer removed from the group once it has no pending entry left.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
import redis

from protocol import keys
from stores.functions import Functions
from stores.takeover import Takeover, consumers, sweep, take_over
from stores.turns import Fenced, Lease, StoreConfig, UserStore, Writes

T = "chat"
READY = keys.ready(T)


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def r(server: fakeredis.FakeServer) -> Iterator[fakeredis.FakeRedis]:
    client = fakeredis.FakeRedis(server=server)
    client.xgroup_create(READY, keys.GROUP, id="0", mkstream=True)
    yield client
    client.close()


def notify(r: redis.Redis, *users: str) -> list[str]:
    return [r.xadd(READY, {"user": u}).decode() for u in users]


def deliver(r: redis.Redis, worker: str, count: int = 100) -> list[str]:
    """What ``worker``'s XREADGROUP would take: the next ``count`` undelivered notifications."""
    resp = r.xreadgroup(keys.GROUP, worker, {READY: ">"}, count=count)
    return [nid.decode() for _stream, rows in resp or [] for nid, _fields in rows]


def pending_of(r: redis.Redis, worker: str) -> list[str]:
    rows = r.xpending_range(READY, keys.GROUP, "-", "+", 1000, consumername=worker)
    return [row["message_id"].decode() for row in rows]


def undelivered(r: redis.Redis) -> list[dict[bytes, bytes]]:
    """The notifications no consumer has read yet (the fresh ones), oldest first."""
    group = next(g for g in r.xinfo_groups(READY) if g["name"] == keys.GROUP.encode())
    rows = r.xrange(READY, min=f"({group['last-delivered-id'].decode()}", max="+")
    return [fields for _nid, fields in rows]


def undelivered_users(r: redis.Redis) -> list[str]:
    return [fields[b"user"].decode() for fields in undelivered(r)]


def lane(r: redis.Redis, user: str) -> str | None:
    raw = r.get(keys.lane(user))
    return raw.decode() if raw is not None else None


# --- lanes ------------------------------------------------------------------------------

def test_dead_workers_lanes_are_cleared_and_others_untouched(r: fakeredis.FakeRedis) -> None:
    notify(r, "alice", "bob", "carol")
    deliver(r, "w1")
    notify(r, "dave")
    deliver(r, "w2")
    r.set(keys.lane("alice"), "w1|3", px=30_000)  # the dead worker's
    r.set(keys.lane("bob"), "w2|4", px=30_000)  # a live worker's: bob's notification came to w1 too
    r.set(keys.lane("dave"), "w2|5", px=30_000)  # a live worker's, not in w1's PEL
    r.set(keys.lane("erin"), "w10|6", px=30_000)  # a worker whose id starts like w1's

    done = take_over(r, T, "w1")

    assert done.users == ("alice", "bob", "carol")  # every user of its PEL is handed on
    assert done.lanes_cleared == ("alice",)
    assert lane(r, "alice") is None
    assert (lane(r, "bob"), lane(r, "dave"), lane(r, "erin")) == ("w2|4", "w2|5", "w10|6")
    assert undelivered_users(r) == ["alice", "bob", "carol"]
    assert done.acked == 3 and pending_of(r, "w1") == []
    assert done.consumer_removed and not done.pending_left
    assert set(consumers(r, T)) == {"w2"} and len(pending_of(r, "w2")) == 1


def test_lane_clear_script_needs_the_owner_part_to_match(r: fakeredis.FakeRedis) -> None:
    scripts = Functions(r)
    for held, worker, cleared in [("w1|7", "w1", 1), ("w1|7", "w2", 0), ("w10|7", "w1", 0),
                                  ("w1|7", "w1|7", 0), (None, "w1", 0)]:
        r.delete(keys.lane("alice"))
        if held:
            r.set(keys.lane("alice"), held)
        assert scripts.lane_clear(keys=[keys.lane("alice")], args=[worker]) == cleared, (held, worker)
        assert lane(r, "alice") == (None if cleared else held)


# --- notifications: fresh ones first, then the acks ----------------------------------------

def test_the_whole_pel_is_visited_in_batches_with_one_notification_per_user(r: fakeredis.FakeRedis) -> None:
    users = [f"u{i % 7}" for i in range(25)]  # several entries of the same users
    notify(r, *users)
    deliver(r, "w1")

    done = take_over(r, T, "w1", batch=4)

    assert done.acked == 25 and pending_of(r, "w1") == []
    assert sorted(done.users) == sorted(set(users)) and len(done.users) == 7
    assert sorted(undelivered_users(r)) == sorted(set(users))  # one fresh notification each
    assert done.consumer_removed


def test_fresh_notifications_are_posted_after_the_lane_clear_and_before_the_ack(
        r: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    notify(r, "alice", "bob")
    deliver(r, "w1")
    r.set(keys.lane("alice"), "w1|1")
    calls: list[str] = []
    real_pipeline, real_xack = r.pipeline, r.xack

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        def execute(*a: Any, **kw: Any) -> Any:
            calls.extend(str(cmd[0][0]).split()[0] for cmd in pipe.command_stack)
            return real_execute(*a, **kw)

        pipe.execute = execute
        return pipe

    def xack(*args: Any) -> Any:
        calls.append("XACK")
        return real_xack(*args)

    monkeypatch.setattr(r, "pipeline", pipeline)
    monkeypatch.setattr(r, "xack", xack)
    take_over(r, T, "w1")

    order = [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]
    # (EXISTS: which ready shards exist; FCALL: lane_clear)
    assert order == ["EXISTS", "XRANGE", "FCALL", "XADD", "XACK"], calls


def test_a_failure_before_the_ack_leaves_the_old_notifications_pending(
        r: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    old = notify(r, "alice")
    deliver(r, "w1")

    def broken(*_args: Any) -> None:
        raise redis.ConnectionError("Redis went away")

    monkeypatch.setattr(r, "xack", broken)
    with pytest.raises(redis.ConnectionError):
        take_over(r, T, "w1")
    assert pending_of(r, "w1") == old and undelivered_users(r) == ["alice"]  # a duplicate, no loss
    assert "w1" in consumers(r, T)

    monkeypatch.undo()
    again = take_over(r, T, "w1")  # the next pass finishes the job
    assert again.acked == 1 and again.consumer_removed and pending_of(r, "w1") == []


def test_trimmed_entries_are_just_acked(r: fakeredis.FakeRedis) -> None:
    gone, kept = notify(r, "alice", "bob")
    deliver(r, "w1")
    r.xdel(READY, gone)

    done = take_over(r, T, "w1")

    assert (done.acked, done.trimmed, done.users) == (2, 1, ("bob",))
    assert undelivered_users(r) == ["bob"] and pending_of(r, "w1") == []
    assert done.consumer_removed


def test_a_notification_naming_no_valid_user_is_handed_on_as_it_was(r: fakeredis.FakeRedis) -> None:
    r.xadd(READY, {"user": "bad{user}"})
    r.xadd(READY, {"other": "x"})
    deliver(r, "w1")

    done = take_over(r, T, "w1")

    assert (done.acked, done.unreadable, done.users) == (2, 2, ())
    assert undelivered(r) == [{b"user": b"bad{user}"}, {b"other": b"x"}]  # a worker dead-letters them


# --- the consumer ---------------------------------------------------------------------------

def test_consumer_is_removed_only_once_it_has_no_pending_entry(r: fakeredis.FakeRedis) -> None:
    ids = notify(r, "alice")
    deliver(r, "w1")
    drop = Functions(r).consumer_drop

    assert drop(keys=[READY], args=[keys.GROUP, "w1"]) == -1  # pending: deleting it would lose them
    assert consumers(r, T) == {"w1": 1} and pending_of(r, "w1") == ids
    r.xack(READY, keys.GROUP, *ids)
    assert drop(keys=[READY], args=[keys.GROUP, "w1"]) == 1
    assert consumers(r, T) == {}
    assert drop(keys=[READY], args=[keys.GROUP, "w1"]) == 0


def test_takeover_of_a_worker_without_a_consumer_or_a_stream(r: fakeredis.FakeRedis) -> None:
    assert take_over(r, T, "w9") == Takeover(T, "w9")
    assert not take_over(r, T, "w9").changed
    assert take_over(r, "other", "w1") == Takeover("other", "w1")  # no stream, no group
    assert consumers(r, "other") == {} and sweep(r, "other") == []


def test_sweep_takes_over_consumers_that_are_not_live_workers(r: fakeredis.FakeRedis) -> None:
    notify(r, "alice")
    deliver(r, "dead1")  # SIGKILLed with a pending notification
    notify(r, "bob")
    deliver(r, "alive")  # heartbeat alive
    notify(r, "carol")
    deliver(r, "ours")  # no heartbeat (paused) but the caller runs it and knows it alive
    r.xreadgroup(keys.GROUP, "dead2", {READY: ">"}, count=1)  # empty: consumer without pending
    r.xreadgroup(keys.GROUP, "not a worker", {READY: ">"}, count=1)  # not a Fleet consumer name
    r.set(keys.heartbeat("alive"), "1", px=5_000)
    r.set(keys.lane("alice"), "dead1|2")

    done = {t.worker: t for t in sweep(r, T, live={"ours"})}

    assert set(done) == {"dead1", "dead2"}
    assert done["dead1"].users == ("alice",) and done["dead1"].lanes_cleared == ("alice",)
    assert done["dead2"].acked == 0 and done["dead2"].consumer_removed
    assert consumers(r, T) == {"alive": 1, "ours": 1, "not a worker": 0}
    assert undelivered_users(r) == ["alice"]
    assert sweep(r, T, live={"ours"}) == []  # nothing left to do


# --- fencing: a paused worker cannot write after the takeover -------------------------------

async def test_a_paused_workers_commit_and_its_release_are_fenced(server: fakeredis.FakeServer,
                                                             r: fakeredis.FakeRedis) -> None:
    aio = fakeredis.FakeAsyncRedis(server=server)
    w1, w2 = (UserStore(aio, w, StoreConfig(lane_ttl_ms=30_000)) for w in ("w1", "w2"))
    entry = (await aio.xadd(keys.inbox("alice"), {"text": "hi"})).decode()
    notify(r, "alice")
    deliver(r, "w1")
    lease = await w1.acquire("alice")  # w1 takes the lane and is paused mid-turn (SIGSTOP)
    assert isinstance(lease, Lease) and lease.owner.startswith("w1|")

    done = take_over(r, T, "w1")
    assert done.lanes_cleared == ("alice",) and undelivered_users(r) == ["alice"]

    with pytest.raises(Fenced):  # w1 wakes up: its write-back is refused
        await w1.commit(lease, entry, "t1", Writes(turn_id="t1", reply=b"late"), 1)
    assert await w1.renew([lease]) == [False]
    assert await aio.hget(keys.state("alice"), "cursor") is None  # nothing was written
    assert await aio.llen(keys.reply("alice", "t1")) == 0

    other = await w2.acquire("alice")  # the fresh notification's worker takes over
    assert isinstance(other, Lease) and other.owner.startswith("w2|") and other.cursor == ""
    with pytest.raises(Fenced):  # and w1 stays fenced under the new holder
        await w1.commit(lease, entry, "t1", Writes(turn_id="t1", reply=b"late"), 1)
    assert (await w2.commit(other, entry, "t1", Writes(turn_id="t1", reply=b"ok"), 2)).result == "ok"
    await aio.aclose()
