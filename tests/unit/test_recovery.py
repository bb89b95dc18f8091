"""The recovery after a Cluster failover (stores.renotify, commander.failover): which users get a
fresh notification, and when the commander sweeps. The real failover is
tests/cluster/test_failover_recovery.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import fakeredis
import pytest

from commander.failover import FailoverRecovery
from commander.leadership import Leadership
from commander.ledger_writer import LedgerWriter
from protocol import keys
from stores.renotify import cluster_epoch, read_recovered, renotify_unserved, unserved, write_recovered


@pytest.mark.parametrize(("cursor", "newest", "expected"), [
    (None, [], False),  # never submitted
    (None, [(b"5-0", {})], True),  # a turn, none served yet
    (b"5-0", [], False),  # all served and deleted
    (b"5-0", [(b"5-0", {})], False),  # the cursor's own entry is kept (a raw client's copy): served
    (b"5-0", [(b"5-1", {})], True),  # same millisecond, next sequence
    (b"5-0", [(b"6-0", {})], True),
    (b"9-0", [(b"6-0", {})], False),  # the cursor is ahead of the inbox: nothing after it
    (b"10-0", [(b"9-7", {})], False),  # numeric, not string order
    (b"9-0", [(b"10-0", {})], True),
])
def test_unserved_compares_stream_ids_numerically(cursor, newest, expected) -> None:
    assert unserved(cursor, newest) is expected


@pytest.fixture
def r() -> Iterator[fakeredis.FakeRedis]:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    yield client
    client.close()


def queued(r: fakeredis.FakeRedis, user: str, served: int, waiting: int) -> None:
    """``user`` submitted ``served + waiting`` turns; the first ``served`` were answered."""
    ids = [r.xadd(keys.inbox(user), {"text": f"t{i}"}) for i in range(served + waiting)]
    if served:
        r.hset(keys.state(user), "cursor", ids[served - 1])
        r.xdel(keys.inbox(user), *ids[:served])
    r.zadd(keys.active("chat"), {user: 1.0})


def notifications(r: fakeredis.FakeRedis, tier: str = "chat", shards: int = 1) -> list[str]:
    return sorted(f[b"user"].decode() for k in range(shards) for _id, f in r.xrange(keys.ready(tier, k)))


def recovery(r: fakeredis.FakeRedis) -> FailoverRecovery:
    """A leading commander's recovery (its ledger entries are fenced by its lease)."""
    leadership = Leadership(r, "c1")
    leadership.campaign()
    return FailoverRecovery(r, LedgerWriter(leadership, time.time))


def test_only_users_with_a_turn_after_the_cursor_are_notified(r) -> None:
    queued(r, "done", served=2, waiting=0)
    queued(r, "stuck", served=1, waiting=2)
    queued(r, "new", served=0, waiting=1)
    r.zadd(keys.active("chat"), {"idle": 1.0, "no such user!": 2.0})  # never submitted; a bad member
    got = renotify_unserved(r, "chat", batch=2)
    assert sorted(got.users) == ["new", "stuck"] and got.checked == 4
    assert notifications(r) == ["new", "stuck"]  # one each


def test_notifications_go_to_each_users_ready_shard(r) -> None:
    users = [f"s{i}" for i in range(12)]
    for user in users:
        queued(r, user, served=0, waiting=1)
    renotify_unserved(r, "chat", shards=3)
    for k in range(3):
        assert sorted(f[b"user"].decode() for _id, f in r.xrange(keys.ready("chat", k))) == \
            sorted(u for u in users if keys.ready_shard(u, 3) == k)


def test_the_sweep_runs_once_per_failover_and_only_when_the_epoch_grows(r) -> None:
    queued(r, "stuck", served=0, waiting=1)
    rec = recovery(r)
    assert rec.run({"chat": 1}, None) is None  # one node: no failover to recover from
    assert rec.run({"chat": 1}, 6) is None  # the first epoch seen is recorded, not swept
    assert read_recovered(r) == 6 and notifications(r) == []
    assert rec.run({"chat": 1}, 6) is None
    assert rec.run({"chat": 1}, 5) is None  # a node that has not heard of a failover yet
    done = rec.run({"chat": 1}, 7)
    assert done is not None and (done.before, done.now) == (6, 7)
    assert [t.users for t in done.tiers] == [("stuck",)] and read_recovered(r) == 7
    assert rec.run({"chat": 1}, 7) is None
    assert notifications(r) == ["stuck"]


def test_a_new_leader_reads_the_epoch_its_predecessor_recovered_from(r) -> None:
    queued(r, "stuck", served=0, waiting=1)
    first, second = recovery(r), recovery(r)
    assert first.run({"chat": 1}, 6) is None
    assert first.run({"chat": 1}, 7) is not None
    assert second.run({"chat": 1}, 7) is None  # already recovered from epoch 7
    second.forget()
    write_recovered(r, 5)  # (lost in a failover of its own master: an older one read back)
    assert second.run({"chat": 1}, 7) is not None  # sweeps again: a spare notification, no loss
    assert notifications(r) == ["stuck", "stuck"]


def test_an_unreadable_record_is_taken_as_none(r) -> None:
    r.set(keys.RECOVERED, "garbage")
    assert read_recovered(r) is None
    assert cluster_epoch(r) is None  # not a cluster client
