"""``stores.functions``: the library assembled from the per-operation files, its version, the
library state, and calls that meet a missing library waiting for it and sent again (nothing
ran), on either kind of client and on every pipelined path."""

from __future__ import annotations

import asyncio
import logging
import threading

import fakeredis
import pytest

from protocol import keys
from stores import functions, takeover, worker_ops
from stores.functions import NAMES, VERSION, Functions, function_name, library, library_state, source
from stores.turns import Lease, UserStore

OTHER_VERSION = ("#!lua name=fleet\nredis.register_function{function_name='fleet_version', "
                 "callback=function() return 'v0' end, flags={'no-writes'}}")


@pytest.fixture(autouse=True)
def quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(functions, "CHECK_EVERY_S", 0.01)


def test_the_library_holds_every_operation_under_its_versioned_name_and_the_version() -> None:
    text = library()
    assert text.startswith("#!lua name=fleet\n")
    for name in NAMES:
        assert source(name) in text  # each file's text, whole, as a function body
        assert f"redis.register_function('{function_name(name)}', {name})" in text
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    assert library_state(r) == ("ok", VERSION)
    assert r.fcall_ro("fleet_version", 0) == VERSION.encode()


def test_every_function_name_carries_the_version() -> None:
    assert function_name("lane_acquire") == f"fleet_lane_acquire_{VERSION}"
    assert len(VERSION) == 12 and int(VERSION, 16) >= 0


def test_the_state_says_missing_other_version_or_ok() -> None:
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    r.function_flush()
    assert library_state(r) == ("missing", None)
    r.function_load(OTHER_VERSION)
    assert library_state(r) == ("other version", "v0")
    assert functions.install(r) == VERSION
    assert library_state(r) == ("ok", VERSION)


def test_a_blocking_call_waits_for_the_library_says_so_once_and_runs_once(
        caplog: pytest.LogCaptureFixture) -> None:
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server)
    r.set(keys.lane("alice"), "w1|1")
    r.function_load(OTHER_VERSION, replace=True)
    cleared: list[int] = []
    call = threading.Thread(target=lambda: cleared.append(
        Functions(r).lane_clear(keys=[keys.lane("alice")], args=["w1"])))
    with caplog.at_level(logging.WARNING, "fleet.library"):
        call.start()
        while not caplog.records:
            call.join(0.01)
        assert call.is_alive()  # waiting
        functions.install(fakeredis.FakeRedis(server=server))
        call.join(5)
    assert cleared == [1]
    said = [rec.getMessage() for rec in caplog.records]
    assert len(said) == 2 and "version v0" in said[0] and f"needs version {VERSION}" in said[0]
    assert "`fleet install`" in said[0] and "going on" in said[1]


def test_a_stop_ends_the_wait() -> None:
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    r.function_flush()
    stop = threading.Event()
    stop.set()
    assert functions.wait_for_library(r, stop) is False


def test_the_takeovers_lane_clears_wait_for_the_library() -> None:
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server)
    users = ["alice", "bob"]
    for user in users:
        r.set(keys.lane(user), "dead|1")
    r.function_flush()
    threading.Timer(0.05, lambda: functions.install(fakeredis.FakeRedis(server=server))).start()
    assert takeover._clear_lanes(r, Functions(r), "dead", users) == users


async def test_renewals_and_touches_wait_for_the_library_and_are_sent_again() -> None:
    server = fakeredis.FakeServer()
    r = fakeredis.FakeAsyncRedis(server=server)
    store = UserStore(r, "w1")
    leases = []
    for user in ("alice", "bob"):
        await r.xadd(keys.inbox(user), {"text": "hi"})
        lease = await store.acquire(user)
        assert isinstance(lease, Lease)
        leases.append(lease)
    await worker_ops.join_ready_group(r, "chat", 1)
    nid = (await r.xadd(keys.ready("chat"), {"user": "alice"})).decode()
    await r.xreadgroup(keys.GROUP, "w1", {keys.ready("chat"): ">"})
    await r.function_flush()
    renew = asyncio.ensure_future(store.renew(leases))
    touch = asyncio.ensure_future(worker_ops.touch_and_beat(r, store.scripts, "chat", "w1", [nid], 5_000))
    await asyncio.sleep(0.05)
    assert not renew.done() and not touch.done()
    functions.install(fakeredis.FakeRedis(server=server))
    assert await renew == [True, True]
    await touch
    assert await r.exists(keys.heartbeat("w1"))
    await r.aclose()


def test_a_blocking_call_waiting_gives_up_when_the_process_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(functions, "_INTERRUPTED", threading.Event())
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    r.function_flush()
    failed: list[BaseException] = []

    def call() -> None:
        try:
            Functions(r).lane_clear(keys=[keys.lane("alice")], args=["w1"])
        except functions.LibraryMissing as exc:
            failed.append(exc)

    waiting = threading.Thread(target=call)
    waiting.start()
    waiting.join(0.05)
    assert waiting.is_alive()
    functions.interrupt_waits()  # as the commander's SIGTERM handler does
    waiting.join(5)
    assert not waiting.is_alive() and "fleet install" in str(failed[0])
