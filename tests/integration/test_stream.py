"""Streamed replies on a real redis-server with real worker processes: the text arrives while
the handler runs, the reply stays exactly-once where ``wait`` reads it, the stream ends with
``end`` and expires, a retried attempt starts with ``restart``, and a worker that lost the lane
cannot add to the stream (``stream_append.lua`` is fenced)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis
import redis.asyncio as aioredis

from fleet.client import AsyncFleet, Fleet, Restart, TurnTimeout
from protocol import keys
from protocol.codec import as_str
from protocol.models import Reply
from protocol.policy import TurnsPolicy
from stores import functions
from stores.connection import connect_async, connect_sync
from stores.policies import write_policy
from stores.turns import Flush, Lease, StoreConfig, StreamTail, UserDataError, UserStore, Writes
from tests.helpers import fleet_argv, fleet_cli, wait_until

if TYPE_CHECKING:
    from tests.conftest import RedisServer
    from tests.integration.conftest import WorkerProc

pytestmark = pytest.mark.integration


def policy(r: redis.Redis, handler: str = "echo_stream", **options: Any) -> None:
    write_policy(r, "chat", TurnsPolicy(handler=handler, handler_options=options))


@pytest.fixture
async def fleet(redis_server: RedisServer) -> AsyncIterator[AsyncFleet]:
    client = AsyncFleet(client=connect_async(redis_server.role_url("fleet-client")))
    yield client
    await client.aclose()


def entries(r: redis.Redis, user: str, turn_id: str) -> list[dict[str, str]]:
    """The stream's entries, without the flushes' ids (``f``: see the re-sent flush's test)."""
    return [{k.decode(): v.decode() for k, v in fields.items() if k != b"f"}
            for _id, fields in r.xrange(keys.stream(user, turn_id))]


async def collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in stream]


def shown(items: list[Any]) -> str:
    """The text a reader shows at the end: the chunks after the last Restart."""
    text = ""
    for item in items:
        if isinstance(item, Restart):
            text = ""
        elif isinstance(item, str):
            text += item
    return text


# --- the stream's shape and the reply -----------------------------------------------------
async def test_chunks_arrive_while_the_handler_runs_then_the_reply_once(
        r: redis.Redis, fleet: AsyncFleet, start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, delay_ms=300)
    start_worker()
    stream = fleet.stream("alice", "one two three four", timeout=20)
    items: list[Any] = []
    async for item in stream:
        if not items:  # the first chunk: the handler has 0.9 s of words to go
            assert item == "one"
            assert not r.exists(keys.reply("alice", stream.turn_id))
            assert not any(e["k"] == "end" for e in entries(r, "alice", stream.turn_id))
        items.append(item)
    reply = items[-1]
    assert isinstance(reply, Reply) and reply.ok and reply.status == "ok"
    assert reply.text == "one two three four" == shown(items) == "".join(items[:-1])
    assert stream.reply == reply and reply.turn_id == stream.turn_id
    assert not r.exists(keys.reply("alice", stream.turn_id))  # taken once, as a wait takes it
    raw = entries(r, "alice", stream.turn_id)
    assert raw[-1] == {"k": "end", "status": "ok"}
    assert all(e == {"k": "chunk", "a": "1", "t": e["t"]} for e in raw[:-1])
    assert "".join(e["t"] for e in raw[:-1]) == reply.text


async def flush(store: UserStore, lease: Lease, attempt: int, text: str,
                restart: bool = False) -> str | Exception:
    """One flush of turn t1's stream (``stream_append.lua``), as the worker's flusher sends it."""
    return (await store.append_streams([Flush(lease, "t1", attempt, text, restart)]))[0]


def xreads(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))


async def test_the_streams_a_client_reads_at_once_are_read_together(
        r: redis.Redis, fleet: AsyncFleet, start_worker: Callable[..., WorkerProc]) -> None:
    """Twelve streams of one AsyncFleet: the worker flushes them in the same ticks, and the
    client's hub reads them with one XREAD, not one per stream per flush."""
    write_policy(r, "chat", TurnsPolicy(handler="echo_stream", handler_options={"delay_ms": 25},
                                        concurrency=16))
    start_worker(env={"FLEET_WORKER_STREAM_FLUSH_MS": "50", "FLEET_WORKER_STREAM_FLUSH_MAX_MS": "50"})
    words = " ".join(f"w{i}" for i in range(40))  # ~1 s: ~20 flushes a stream
    await collect(fleet.stream("warm", "x", timeout=20))
    before = xreads(r)
    got = await asyncio.gather(*(collect(fleet.stream(f"u{i}", words, timeout=30)) for i in range(12)))
    reads = xreads(r) - before
    assert all(shown(items) == words == items[-1].text for items in got)
    flushes = sum(len(entries(r, f"u{i}", items[-1].turn_id)) - 1 for i, items in enumerate(got))
    assert flushes >= 12 * 10, flushes
    assert reads < flushes / 3, (reads, flushes)  # one a stream per flush without the hub


async def test_a_stream_key_of_the_wrong_type_does_not_hold_up_the_others(
        r: redis.Redis, fleet: AsyncFleet, start_worker: Callable[..., WorkerProc]) -> None:
    """A hostile key among the hub's fails its every read (WRONGTYPE): the other streams read
    on their own meanwhile and get their text and reply; the reader of the bad one gets the
    error, for its turn alone."""
    policy(r, delay_ms=50)
    start_worker()
    bad_key = keys.stream("mallory", "bad-1")
    r.set(bad_key, "not a stream")
    hub = fleet._hub
    assert hub is not None
    hub.join(bad_key, "0-0")  # held by the hub for the whole test (as a reader slow to leave)
    try:
        good = await collect(fleet.stream("alice", "one two three four five", timeout=20))
        assert shown(good) == "one two three four five" == good[-1].text
        assert hub.failures > 0  # it did meet the bad key
    finally:
        hub.leave(bad_key)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        await collect(fleet.stream("mallory", "a b c", turn_id="bad-1", timeout=10))


async def test_a_turn_whose_handler_never_emits_still_ends_with_its_reply_promptly(
        r: redis.Redis, fleet: AsyncFleet, start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, handler="echo")
    start_worker()
    started = time.monotonic()
    items = await collect(fleet.stream("bob", "hi", timeout=20).__aiter__())
    assert len(items) == 1 and isinstance(items[0], Reply) and items[0].text.startswith("echo: hi")
    assert time.monotonic() - started < 0.9  # woken by the end entry, not by the reply poll


async def test_a_streamed_handlers_reply_is_still_read_by_a_plain_wait(
        r: redis.Redis, fleet: AsyncFleet, start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, delay_ms=10)
    start_worker()
    turn = await fleet.submit("carol", "not streamed")
    reply = await fleet.wait("carol", turn.turn_id, 20)
    assert reply.text == "not streamed"
    assert not r.exists(keys.stream("carol", turn.turn_id))  # a plain turn writes no stream
    # the raw protocol's streamed turn (plain fields, stream=1): streamed, and its reply where wait reads it
    r.xadd(keys.inbox("carol"), {"text": "raw streamed", "turn_id": "raw-1", "stream": "1"})
    r.xadd(keys.ready("chat"), {"user": "carol"})
    got = r.blpop([keys.reply("carol", "raw-1")], 20)  # (a plain turn's reply is JSON)
    assert got is not None and json.loads(got[1])["text"] == "raw streamed"
    raw = entries(r, "carol", "raw-1")
    assert raw[-1] == {"k": "end", "status": "ok"}
    assert "".join(e.get("t", "") for e in raw) == "raw streamed"


async def test_a_turn_submitted_as_streamed_is_read_by_anyone(r: redis.Redis, fleet: AsyncFleet,
                                                             start_worker: Callable[..., WorkerProc]) -> None:
    """``submit(stream=True)``: the text goes to the turn's reply stream for any reader (here
    XRANGE), and ``wait`` still gets the reply."""
    policy(r, delay_ms=10)
    start_worker()
    turn = await fleet.submit("gil", "a b c", stream=True)
    reply = await fleet.wait("gil", turn.turn_id, timeout=20)
    assert reply.ok and reply.text == "a b c"
    raw = entries(r, "gil", turn.turn_id)
    assert "".join(e.get("t", "") for e in raw) == "a b c" and raw[-1] == {"k": "end", "status": "ok"}
    plain = await fleet.submit("gil", "d e")
    assert (await fleet.wait("gil", plain.turn_id, timeout=20)).text == "d e"
    assert not r.exists(keys.stream("gil", plain.turn_id))


def test_the_blocking_client_streams_the_same(r: redis.Redis, redis_server: RedisServer,
                                              start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, delay_ms=50)
    start_worker()
    with Fleet(client=connect_sync(redis_server.role_url("fleet-client"))) as client:
        stream = client.stream("dave", "a b c", timeout=20)
        items = list(stream)
    assert items[-1] == stream.reply and stream.reply is not None and stream.reply.text == "a b c"
    assert shown(items) == "a b c"
    with pytest.raises(TypeError):
        asyncio.run(collect(stream.__aiter__()))


async def test_the_stream_expires_with_the_reply(r: redis.Redis, fleet: AsyncFleet,
                                                 start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, delay_ms=10)
    start_worker(env={"FLEET_WORKER_REPLY_TTL_S": "2"})
    stream = fleet.stream("erin", "soon gone")
    await collect(stream.__aiter__())
    key = keys.stream("erin", stream.turn_id)
    assert 0 < r.pttl(key) <= 2000
    wait_until(lambda: not r.exists(key), 10, "the stream to expire")


async def test_a_stream_times_out_when_no_worker_serves_it(r: redis.Redis, fleet: AsyncFleet) -> None:
    policy(r)
    stream = fleet.stream("frank", "nobody", timeout=0.5)
    with pytest.raises(TurnTimeout):
        await collect(stream.__aiter__())


# --- attempts and fencing ---------------------------------------------------------------
async def test_a_retried_attempt_restarts_the_stream(r: redis.Redis, fleet: AsyncFleet,
                                                     start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, delay_ms=100, fail_attempts=1)
    start_worker()
    items = await collect(fleet.stream("gina", "try try again", timeout=20).__aiter__())
    reply = items[-1]
    assert isinstance(reply, Reply) and reply.ok and reply.attempts == 2
    restarts = [i for i, item in enumerate(items) if isinstance(item, Restart)]
    assert len(restarts) == 1 and items[restarts[0]] == Restart(2)
    first = "".join(items[:restarts[0]])  # attempt 1's text as far as it was flushed, then dropped
    assert first and "try try again".startswith(first)
    assert shown(items) == reply.text == "try try again"
    raw = entries(r, "gina", reply.turn_id)
    kinds = [(e["k"], e.get("a")) for e in raw]
    first2 = kinds.index(("restart", "2"))
    assert all(a == "1" for k, a in kinds[:first2]) and all(a == "2" for k, a in kinds[first2:-1])


async def test_a_worker_that_lost_the_lane_adds_nothing_to_the_stream(
        r: redis.Redis, fleet: AsyncFleet, start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, delay_ms=150)
    start_worker()
    stream = fleet.stream("hank", " ".join(f"w{i}" for i in range(30)), timeout=30)
    reading = asyncio.ensure_future(collect(stream.__aiter__()))
    key = keys.stream("hank", stream.turn_id)
    for _ in range(500):
        if r.xlen(key) >= 2:
            break
        await asyncio.sleep(0.02)
    r.set(keys.lane("hank"), "thief|999999999", px=3000)  # the lane taken away mid-turn
    stolen_at = r.xlen(key)
    await asyncio.sleep(1.0)  # the worker's handler would have streamed ~6 more words by now
    assert r.xlen(key) == stolen_at
    items = await reading  # the thief's lane expires: the turn is served again, from the start
    reply = items[-1]
    assert isinstance(reply, Reply) and reply.attempts >= 2
    assert shown(items) == reply.text
    raw = entries(r, "hank", reply.turn_id)
    assert raw[stolen_at]["k"] == "restart"  # the first entry after the theft is the retry's


async def test_the_flush_is_fenced_and_ends_with_the_commit(r: redis.Redis,
                                                             redis_server: RedisServer) -> None:
    """``stream_append.lua`` itself: written under the lane, refused without it and after the commit."""
    client = aioredis.Redis.from_url(redis_server.url)
    store = UserStore(client, "w1", StoreConfig(reply_ttl_ms=60_000))
    entry = r.xadd(keys.inbox("ivy"), {"text": "x", "turn_id": "t1"}).decode()
    lease = await store.acquire("ivy")
    assert isinstance(lease, Lease)
    assert await flush(store, lease, 1, "a") == "ok"
    assert await flush(store, lease, 2, "b", restart=True) == "ok"
    assert entries(r, "ivy", "t1") == [{"k": "chunk", "a": "1", "t": "a"}, {"k": "restart", "a": "2"},
                                       {"k": "chunk", "a": "2", "t": "b"}]
    assert 0 < r.pttl(keys.stream("ivy", "t1")) <= 60_000
    other = Lease("ivy", "w2|1", lease.cursor)
    assert await flush(store, other, 2, "stolen") == "fenced"
    w = Writes(turn_id="t1", reply=b"r", stream=StreamTail(2, "c"))
    assert (await store.commit(lease, entry, "t1", w, 1)).result == "ok"
    assert entries(r, "ivy", "t1")[-2:] == [{"k": "chunk", "a": "2", "t": "c"}, {"k": "end", "status": "ok"}]
    r.set(keys.lane("ivy"), lease.owner)  # (the commit released it: as if still held)
    assert await flush(store, lease, 2, "late") == "done"
    assert entries(r, "ivy", "t1")[-1] == {"k": "end", "status": "ok"}
    await client.aclose()


def test_a_flush_sent_again_whole_is_written_once(r: redis.Redis) -> None:
    """redis-py re-sends a pipeline after a dropped connection: a flush that ran before the drop
    runs again. Named by its id, it finds its chunk the stream's last entry and writes nothing."""
    r.set(keys.lane("kim"), "w1|7")
    call = functions.Functions(r).stream_append
    args = ["w1|7", 1, "0", "hello", 60_000]
    for flush_id in ("f1", "f1", "f2"):  # f1 sent again whole, then the next flush
        got = call(keys=[keys.lane("kim"), keys.stream("kim", "t1")], args=[*args, flush_id])
        assert [as_str(g) for g in got] == ["ok"]
    assert [e["t"] for e in entries(r, "kim", "t1")] == ["hello", "hello"]  # f1 once, f2 once


async def test_a_stream_key_of_the_wrong_type_writes_nothing(r: redis.Redis,
                                                              redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    store = UserStore(client, "w1")
    entry = r.xadd(keys.inbox("jo"), {"text": "x", "turn_id": "t1"}).decode()
    lease = await store.acquire("jo")
    assert isinstance(lease, Lease)
    r.set(keys.stream("jo", "t1"), "not a stream")
    assert await flush(store, lease, 1, "a") == "wrongtype"
    before = r.hgetall(keys.state("jo"))
    with pytest.raises(UserDataError, match="stream"):
        await store.commit(lease, entry, "t1", Writes(turn_id="t1", reply=b"r", stream=StreamTail(1)),
                           1)
    assert r.hgetall(keys.state("jo")) == before and not r.exists(keys.reply("jo", "t1"))
    await client.aclose()


def test_a_flush_over_a_lane_of_the_wrong_type_is_fenced_and_writes_nothing(r: redis.Redis) -> None:
    r.rpush(keys.lane("lee"), "w1|7")
    call = functions.Functions(r).stream_append
    got = call(keys=[keys.lane("lee"), keys.stream("lee", "t1")], args=["w1|7", 1, "0", "a", 60_000, "f1"])
    assert [as_str(g) for g in got] == ["fenced"] and not r.exists(keys.stream("lee", "t1"))


# --- a sync handler's emits ---------------------------------------------------------------
SYNC_HANDLER = '''
import time

def answer(ctx):
    for word in ctx.turn.text.split():
        ctx.emit(word + ".")
        time.sleep(0.2)
    return "done"
'''


@pytest.fixture
def sync_env(fleet_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    info = site / "syncstream_pkg-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: syncstream_pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fleet.handlers]\nsyncstream = syncstream_mod:answer\n")
    (site / "syncstream_mod.py").write_text(SYNC_HANDLER)
    return {"PYTHONPATH": os.pathsep.join([str(site), fleet_env["PYTHONPATH"]])}


async def test_a_sync_handlers_emits_are_streamed(r: redis.Redis, fleet: AsyncFleet, sync_env: dict[str, str],
                                                  start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, handler="syncstream")
    start_worker(env=sync_env)
    stream = fleet.stream("kim", "x y z", timeout=20)
    items: list[Any] = []
    async for item in stream:
        if not items:
            assert item == "x." and not r.exists(keys.reply("kim", stream.turn_id))
        items.append(item)
    assert items[:-1] and "".join(items[:-1]) == "x.y.z."
    assert isinstance(items[-1], Reply) and items[-1].text == "done"


# --- the CLI ------------------------------------------------------------------------------
def test_fleet_submit_stream_prints_the_text_as_it_comes(r: redis.Redis, fleet_env: dict[str, str],
                                                         tmp_path: Path,
                                                         start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, delay_ms=400)
    start_worker()
    with subprocess.Popen(fleet_argv("submit", "--stream", "--user", "lee", "slow", "words", "here"),
                          env=fleet_env, cwd=tmp_path, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        first = proc.stdout.read(4)  # the first word, before the handler has the rest
        assert first == "slow" and proc.poll() is None
        assert not r.exists(keys.reply("lee", "x")) and r.exists(keys.lane("lee"))
        rest = proc.stdout.read()
        assert proc.wait(30) == 0
    assert first + rest == "slow words here\n"


def test_fleet_chat_streams_each_reply(r: redis.Redis, fleet_env: dict[str, str], tmp_path: Path,
                                       start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, delay_ms=5)
    start_worker()
    out = fleet_cli(fleet_env, "chat", "--user", "max", cwd=tmp_path, stdin="hello there\nand again\n\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello there\nand again\n"


# --- the monitor's user page (stores.users.inspect_user) ------------------------------------
async def test_the_user_view_shows_the_turn_in_progress_and_its_text_so_far(
        r: redis.Redis, fleet: AsyncFleet, start_worker: Callable[..., WorkerProc]) -> None:
    from stores.users import inspect_user

    policy(r, delay_ms=300)
    start_worker()
    stream = fleet.stream("nina", "one two three four", timeout=20)
    items: list[Any] = []
    async for item in stream:
        if not items:
            for _ in range(100):  # the first flush may hold only the first word
                view = inspect_user(r, "nina")
                if view.in_progress is not None and " " in view.in_progress.streamed:
                    break
                await asyncio.sleep(0.05)
            assert view.in_progress is not None
            assert (view.in_progress.turn_id, view.in_progress.text) == (stream.turn_id, "one two three four")
            assert view.in_progress.attempt == 1
            assert "one two three four".startswith(view.in_progress.streamed)
            assert view.to_json()["in_progress"]["turn_id"] == stream.turn_id  # (the monitor's JSON)
        items.append(item)
    for _ in range(100):
        if inspect_user(r, "nina").lane_holder is None:
            break
        await asyncio.sleep(0.05)
    assert inspect_user(r, "nina").in_progress is None


async def test_erasing_a_user_erases_its_reply_streams(r: redis.Redis, redis_server: RedisServer,
                                                       fleet: AsyncFleet,
                                                       start_worker: Callable[..., WorkerProc]) -> None:
    policy(r, delay_ms=5)
    start_worker()
    stream = fleet.stream("olga", "forget me")
    await collect(stream.__aiter__())
    assert r.exists(keys.stream("olga", stream.turn_id))
    with Fleet(client=connect_sync(redis_server.role_url("fleet-operator"))) as operator:
        operator.delete_user("olga")
    assert r.keys(f"{keys.user_prefix('olga')}*") == []
