"""A reader that keeps the registry (the commander, every pass) reads it whole only when its
version changed, when it has none, or every ``FULL_READ_EVERY_S``; otherwise one ``HGET``."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest

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
    """Counts the whole reads (HGETALL of the registry) of a fakeredis client."""

    def __init__(self, r: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = r.hgetall

        def counted(key: Any) -> Any:
            self.count += key == keys.WORKERS
            return real(key)

        monkeypatch.setattr(r, "hgetall", counted)


def test_the_registry_is_read_whole_only_when_a_worker_registers_or_leaves(monkeypatch) -> None:
    server = fakeredis.FakeServer()
    r, ar = fakeredis.FakeRedis(server=server), fakeredis.FakeAsyncRedis(server=server)
    asyncio.run(join_ready_group(ar, "chat"))
    asyncio.run(register_worker(ar, info("w1"), 60_000))
    whole, known, bad = Whole(r, monkeypatch), Known(Clock()), BadState()
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
    assert bad.entries == []  # the version field is no entry, and no bad one


def test_an_entry_written_without_a_bump_is_seen_at_the_next_whole_read(monkeypatch) -> None:
    r = fakeredis.FakeRedis()
    r.hset(keys.WORKERS, "w1", encode(info("w1")))
    r.hincrby(keys.WORKERS, keys.WORKERS_VERSION, 1)
    clock = Clock()
    whole, known = Whole(r, monkeypatch), Known(clock)
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
    whole, known = Whole(r, monkeypatch), Known(Clock())
    for n in range(1, 4):
        assert list(read_registry(r, BadState(), known).workers) == ["w1"] and whole.count == n


def test_a_registry_turned_another_type_or_a_bad_entry_is_told_at_every_whole_read(monkeypatch) -> None:
    r = fakeredis.FakeRedis()
    r.hset(keys.WORKERS, mapping={"w1": encode(info("w1")), "w2": b"\x00garbage", keys.WORKERS_VERSION: 7})
    known = Known(Clock())
    bad = BadState()
    reg = read_registry(r, bad, known)
    assert list(reg.workers) == ["w1"] and reg.unreadable == ("w2",)
    again = BadState()
    assert read_registry(r, again, known).unreadable == ("w2",)  # kept while the version stands
    assert [(e.kind, e.key) for e in again.entries] == [("registry", keys.WORKERS)]  # and told again
    r.delete(keys.WORKERS)
    r.lpush(keys.WORKERS, "x")
    bad = BadState()
    assert read_registry(r, bad, known).workers == {}
    assert [(e.kind, e.key) for e in bad.entries] == [("registry", keys.WORKERS)]
    assert registry.read_entries(r, BadState(), known) == ([], [])


def test_the_same_registry_while_nothing_changed_a_new_one_when_a_heartbeat_went() -> None:
    """A reader keeping the registry gets the very object of the last read while neither the
    entries nor any heartbeat changed (what it derived from it may be kept: by identity), and a
    new one as soon as a heartbeat is gone."""
    r = fakeredis.FakeRedis()
    for wid in ("w1", "w2"):
        r.hset(keys.WORKERS, wid, encode(info(wid)))
        r.set(keys.heartbeat(wid), "1")
    r.hincrby(keys.WORKERS, keys.WORKERS_VERSION, 1)
    known = Known(Clock())
    first = read_registry(r, BadState(), known)
    assert read_registry(r, BadState(), known) is first
    r.delete(keys.heartbeat("w2"))
    second = read_registry(r, BadState(), known)
    assert second is not first and second.workers["w2"][1] is False and second.workers["w1"][1] is True
    assert read_registry(r, BadState(), known) is second
