"""A reader that keeps the registry (the commander, every pass) reads it whole only when its
version changed, when it has none, or every ``FULL_READ_EVERY_S``; otherwise one ``GET``."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest
from redis.commands.core import HashCommands
from redis.crc import key_slot

from protocol import keys
from protocol.codec import encode
from protocol.models import WorkerInfo
from stores import registry
from stores.bad_state import BadState
from stores.registry import FULL_READ_EVERY_S, Known, forget_workers, read_registry
from stores.worker_ops import deregister_worker, join_ready_group, register_worker


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def info(wid: str, tier: str = "chat") -> WorkerInfo:
    return WorkerInfo(worker=wid, tier=tier, pid=1, host="h", started=1.0, handlers=["echo"])


class Whole:
    """Counts the whole reads (HGETALL of the registry) of every client, pipelined or not."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = HashCommands.hgetall

        def counted(client: Any, key: Any) -> Any:
            self.count += key == keys.WORKERS
            return real(client, key)

        monkeypatch.setattr(HashCommands, "hgetall", counted)


def test_the_registry_is_read_whole_only_when_a_worker_registers_or_leaves(monkeypatch) -> None:
    server = fakeredis.FakeServer()
    r, ar = fakeredis.FakeRedis(server=server), fakeredis.FakeAsyncRedis(server=server)
    asyncio.run(join_ready_group(ar, "chat"))
    asyncio.run(register_worker(ar, info("w1"), 60_000))
    whole, known, bad = Whole(monkeypatch), Known(Clock()), BadState()
    assert sorted(read_registry(r, bad, known).workers) == ["w1"] and whole.count == 1
    for _ in range(3):  # nothing changed: one HGET each, the same workers
        assert sorted(read_registry(r, bad, known).workers) == ["w1"]
    assert whole.count == 1
    asyncio.run(register_worker(ar, info("w2"), 60_000))
    assert sorted(read_registry(r, bad, known).workers) == ["w1", "w2"] and whole.count == 2
    asyncio.run(deregister_worker(ar, "chat", "w1"))
    assert sorted(read_registry(r, bad, known).workers) == ["w2"] and whole.count == 3
    forget_workers(r, ["w2"])
    assert read_registry(r, bad, known).workers == {} and whole.count == 4
    assert bad.entries == []


def test_an_entry_written_without_a_bump_is_seen_at_the_next_whole_read(monkeypatch) -> None:
    r = fakeredis.FakeRedis()
    r.hset(keys.WORKERS, "w1", encode(info("w1")))
    r.incr(keys.WORKERS_VERSION)
    clock = Clock()
    whole, known = Whole(monkeypatch), Known(clock)
    assert list(read_registry(r, BadState(), known).workers) == ["w1"]
    r.hset(keys.WORKERS, "w2", encode(info("w2")))  # a raw HSET: no bump
    clock.now += FULL_READ_EVERY_S - 0.1
    assert list(read_registry(r, BadState(), known).workers) == ["w1"] and whole.count == 1
    clock.now += 0.1
    assert sorted(read_registry(r, BadState(), known).workers) == ["w1", "w2"] and whole.count == 2


def test_a_registry_with_no_version_is_read_whole_every_time(monkeypatch) -> None:
    """Writers that do not bump it (workers of an older release): as before the version."""
    r = fakeredis.FakeRedis()
    r.hset(keys.WORKERS, "w1", encode(info("w1")))
    whole, known = Whole(monkeypatch), Known(Clock())
    for n in range(1, 4):
        assert list(read_registry(r, BadState(), known).workers) == ["w1"] and whole.count == n


def test_a_registry_turned_another_type_or_a_bad_entry_is_told_at_every_whole_read(monkeypatch) -> None:
    r = fakeredis.FakeRedis()
    r.hset(keys.WORKERS, mapping={"w1": encode(info("w1")), "w2": b"\x00garbage"})
    r.set(keys.WORKERS_VERSION, 7)
    clock = Clock()
    known = Known(clock)
    bad = BadState()
    reg = read_registry(r, bad, known)
    assert list(reg.workers) == ["w1"] and reg.unreadable == ("w2",)
    again = BadState()
    assert read_registry(r, again, known).unreadable == ("w2",)  # kept while the version stands
    assert [(e.kind, e.key) for e in again.entries] == [("registry", keys.WORKERS)]  # and told again
    r.delete(keys.WORKERS)
    r.lpush(keys.WORKERS, "x")  # (no bump: seen at the next whole read)
    clock.now += FULL_READ_EVERY_S
    bad = BadState()
    assert read_registry(r, bad, known).workers == {}
    assert [(e.kind, e.key) for e in bad.entries] == [("registry", keys.WORKERS)]
    assert registry.read_entries(r, BadState(), known) == ([], [])  # (read whole again: no version kept)


@pytest.mark.parametrize("version", ["list", "garbage"])
def test_a_version_that_is_no_counter_is_told_and_the_registry_read_whole_and_a_worker_still_registers(
        version: str, monkeypatch, caplog) -> None:
    """Hostile state: a version of another type, or a string no writer can bump. Readers read
    the registry whole every time (and say why); a worker registering or leaving is not stopped
    by it (its bump fails, with a warning)."""
    server = fakeredis.FakeServer()
    r, ar = fakeredis.FakeRedis(server=server), fakeredis.FakeAsyncRedis(server=server)
    if version == "list":
        r.lpush(keys.WORKERS_VERSION, "x")
    else:
        r.set(keys.WORKERS_VERSION, "not a number")
    asyncio.run(join_ready_group(ar, "chat"))
    with caplog.at_level("WARNING", "fleet.worker"):
        asyncio.run(register_worker(ar, info("w1"), 60_000))
    assert "cannot be bumped" in caplog.text and r.hexists(keys.WORKERS, "w1")
    whole, known = Whole(monkeypatch), Known(Clock())
    for n in (1, 2):
        bad = BadState()
        assert list(read_registry(r, bad, known).workers) == ["w1"] and whole.count == n
        assert [(e.kind, e.key) for e in bad.entries] == [("registry", keys.WORKERS_VERSION)]
    asyncio.run(deregister_worker(ar, "chat", "w1"))
    forget_workers(r, ["w1"])
    assert read_registry(r, BadState(), known).workers == {} and whole.count == 3


def test_the_same_registry_while_nothing_changed_a_new_one_when_a_heartbeat_went() -> None:
    """A reader keeping the registry gets the very object of the last read while neither the
    entries nor any heartbeat changed (what it derived from it may be kept: by identity), and a
    new one as soon as a heartbeat is gone."""
    r = fakeredis.FakeRedis()
    for wid in ("w1", "w2"):
        r.hset(keys.WORKERS, wid, encode(info(wid)))
        r.set(keys.heartbeat(wid), "1")
    r.incr(keys.WORKERS_VERSION)
    known = Known(Clock())
    first = read_registry(r, BadState(), known)
    assert read_registry(r, BadState(), known) is first
    r.delete(keys.heartbeat("w2"))
    second = read_registry(r, BadState(), known)
    assert second is not first and second.workers["w2"][1] is False and second.workers["w1"][1] is True
    assert read_registry(r, BadState(), known) is second


def test_the_version_is_a_key_of_its_own_in_the_registrys_slot_and_the_hash_holds_workers_alone() -> None:
    """Whoever counts or walks ``fleet:workers`` (HLEN, HKEYS) meets worker ids alone; the
    version shares the hash's slot, so one node orders a writer's entry and bump."""
    server = fakeredis.FakeServer()
    r, ar = fakeredis.FakeRedis(server=server), fakeredis.FakeAsyncRedis(server=server)
    asyncio.run(join_ready_group(ar, "chat"))
    for wid in ("w1", "w2"):
        asyncio.run(register_worker(ar, info(wid), 60_000))
    assert r.hlen(keys.WORKERS) == 2 and sorted(r.hkeys(keys.WORKERS)) == [b"w1", b"w2"]
    assert r.get(keys.WORKERS_VERSION) == b"2"
    assert key_slot(keys.WORKERS_VERSION.encode()) == key_slot(keys.WORKERS.encode())


def test_a_whole_read_that_finds_the_same_entries_keeps_the_same_registry(monkeypatch) -> None:
    """The read every FULL_READ_EVERY_S finds what the version said: the registry is the very
    object of the last read (what a reader derived from it is kept), and a new one when an
    entry changed without a bump."""
    r = fakeredis.FakeRedis()
    for wid in ("w1", "w2"):
        r.hset(keys.WORKERS, wid, encode(info(wid)))
        r.set(keys.heartbeat(wid), "1")
    r.incr(keys.WORKERS_VERSION)
    clock = Clock()
    whole, known = Whole(monkeypatch), Known(clock)
    first = read_registry(r, BadState(), known)
    clock.now += FULL_READ_EVERY_S
    assert read_registry(r, BadState(), known) is first and whole.count == 2
    r.hset(keys.WORKERS, "w2", encode(info("w2", tier="batch")))  # (no bump)
    clock.now += FULL_READ_EVERY_S
    second = read_registry(r, BadState(), known)
    assert second is not first and second.workers["w2"][0].tier == "batch" and whole.count == 3
