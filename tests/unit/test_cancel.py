"""Stop: the cancel's record (``turn_cancel.lua``) and the commit that honours it, on fakeredis'
Lua; the race of a cancel with the commit, in an in-process worker; the control command."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
from pydantic import ValidationError

from fleet.client import AsyncFleet
from protocol import keys
from protocol.codec import decode, encode, unpack
from protocol.models import Control, HandlerResult, Reply, SessionEntry
from protocol.policy import TurnsPolicy
from stores.cancel import cancel_turn
from stores.policies import write_policy
from stores.redis_errors import RedisErrors
from stores.turns import Committed, Lease, Writes
from worker import handlers
from worker.app import Worker
from worker.job import UserJob
from worker.settings import WorkerSettings

CALLS: list[str] = []


@handlers.register("t_cancel")
async def _handler(ctx: handlers.TurnContext) -> HandlerResult:
    CALLS.append(ctx.turn.text)
    ctx.emit("said ")
    await asyncio.sleep(float(ctx.option("sleep_ms", 0)) / 1000)
    return HandlerResult(text=f"done: {ctx.turn.text}", memories=[("remember me", 0.5)])


def test_a_cancel_command_names_a_valid_turn() -> None:
    ok = Control(kind="cancel", ts=1.0, user="alice", turn_id="t1", entry="1-0")
    assert decode(Control, encode(ok)) == ok
    for bad in ({"user": "no spaces"}, {"turn_id": ""}, {"entry": "1-0; DEL x"}):
        with pytest.raises(ValidationError):
            Control(**{"kind": "cancel", "ts": 1.0, "user": "alice", "turn_id": "t1", "entry": "1-0", **bad})
    # a drain reads as it always did: no empty cancel fields on the wire
    assert set(unpack(encode(Control(kind="drain", ts=1.0)))) == {"kind", "ts", "reason"}


async def test_the_cancel_function_records_once_and_says_what_it_found() -> None:
    r = fakeredis.FakeAsyncRedis()
    fleet = AsyncFleet(client=r)
    assert (await cancel_turn(r, "alice", "nope")).outcome == "unknown"
    await fleet.submit("alice", "one", turn_id="t1", create_tier=True)
    await fleet.submit("alice", "two", turn_id="t2")
    (e1, _), (e2, _) = await r.xrange(keys.inbox("alice"))
    got = await cancel_turn(r, "alice", "t2")
    assert (got.outcome, got.worker) == ("cancelled", None)  # not first after the cursor: nobody told
    assert await r.hkeys(keys.state("alice")) == [b"cancel:" + e2]
    first = await cancel_turn(r, "alice", "t1")  # first, but no lane held: nobody to tell
    assert (first.outcome, first.worker) == ("cancelled", None)
    # the lane's holder is told on its control stream
    await r.hdel(keys.state("alice"), "cancel:" + e1.decode())
    await r.set(keys.lane("alice"), "w-7|42")
    told = await cancel_turn(r, "alice", "t1")
    assert told.worker == "w-7"
    assert not await r.exists(keys.control("w-7"))  # (a client never writes a worker's control stream)
    (_id, fields), = await r.xrange(keys.cancels("w-7"))
    word = decode(Control, fields[b"m"])
    assert (word.kind, word.user, word.turn_id, word.entry) == ("cancel", "alice", "t1", e1.decode())
    await r.set(keys.lane("alice"), "../../etc|x")  # not a worker id: nobody told
    assert (await cancel_turn(r, "alice", "t1")).worker is None


async def test_a_cancelled_turn_is_committed_only_as_cancelled() -> None:
    """The commit checks the record: an ``ok`` answer is refused (nothing written), the
    cancelled one goes in and deletes the record."""
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", TurnsPolicy(handler="t_cancel"))
    w = Worker(WorkerSettings(worker_id="w1", block_ms=50), r=r)
    fleet = AsyncFleet(client=r)
    turn = await fleet.submit("alice", "one")
    got = await w.store.acquire("alice")
    assert isinstance(got, Lease) and got.next is not None
    assert (await cancel_turn(r, "alice", turn.turn_id)).outcome == "cancelled"
    entry = got.next.entry
    ok = Writes(turn_id=turn.turn_id, reply=b"ok-reply", session_entry=b"s")
    refused = await w.store.commit(got, entry, turn.turn_id, ok, int(time.time() * 1000))
    assert refused == Committed("cancelled", False, None)
    assert await r.llen(keys.reply("alice", turn.turn_id)) == 0 and await r.llen(keys.session("alice")) == 0
    stop = Writes(turn_id=turn.turn_id, reply=b"cancelled-reply", status="cancelled")
    done = await w.store.commit(got, entry, turn.turn_id, stop, int(time.time() * 1000))
    assert done.result == "ok" and done.released
    assert await r.lrange(keys.reply("alice", turn.turn_id), 0, -1) == [b"cancelled-reply"]
    assert await r.hkeys(keys.state("alice")) == [b"cursor"]  # the record went with the commit
    assert (await cancel_turn(r, "alice", turn.turn_id)).outcome == "answered"
    await r.aclose()


@pytest.fixture
async def worker() -> AsyncIterator[tuple[Worker, AsyncFleet, fakeredis.FakeAsyncRedis]]:
    CALLS.clear()
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", TurnsPolicy(handler="t_cancel", concurrency=2))
    w = Worker(WorkerSettings(worker_id="w1", block_ms=50), r=r)
    run = asyncio.ensure_future(w.run())
    try:
        yield w, AsyncFleet(client=r), r
    finally:
        w.drain("test over")
        await asyncio.wait({run}, timeout=10)
        await r.aclose()


async def test_a_cancel_that_races_the_commit_wins_it(
        worker: tuple[Worker, AsyncFleet, fakeredis.FakeAsyncRedis]) -> None:
    """The handler has returned; the cancel lands before its commit: the commit is refused and
    the turn answered ``cancelled`` with what was emitted (cut, in the session): one reply."""
    w, fleet, r = worker
    real_commit = w.store.commit

    async def commit(*args: Any, **kwargs: Any) -> Committed:
        writes = args[3]
        if writes.status == "ok":
            assert (await fleet.cancel("alice", writes.turn_id)).outcome == "cancelled"
        return await real_commit(*args, **kwargs)

    w.store.commit = commit  # type: ignore[method-assign]
    turn = await fleet.submit("alice", "hello")
    reply = await fleet.wait("alice", turn.turn_id, 5)
    assert (reply.ok, reply.status, reply.text) == (False, "cancelled", "said ")
    assert CALLS == ["hello"]
    entry, = [decode(SessionEntry, raw) for raw in await r.lrange(keys.session("alice"), 0, -1)]
    assert (entry.turn_id, entry.reply, entry.cut) == (turn.turn_id, "said ", True)
    assert await r.zcard(keys.memory("alice")) == 0  # the cancelled handler's writes are dropped
    assert await r.llen(keys.reply("alice", turn.turn_id)) == 0  # no second reply
    w.store.commit = real_commit  # type: ignore[method-assign]
    assert (await fleet.ask("alice", "next", timeout=5)).ok  # the user goes on
    assert w.tally.stats().cancelled == 1


async def test_an_answered_turn_builds_no_cancelled_reply(
        worker: tuple[Worker, AsyncFleet, fakeredis.FakeAsyncRedis], monkeypatch: pytest.MonkeyPatch) -> None:
    """What a turn would be answered had its user cancelled it before the commit is made only
    when the commit says so (test_a_cancel_that_races_the_commit_wins_it): not for every turn."""
    _w, fleet, _r = worker
    built: list[str] = []
    real = UserJob._cancel_writes

    def counted(self: UserJob, *args: Any, **kwargs: Any) -> Writes:
        built.append(args[1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(UserJob, "_cancel_writes", counted)
    assert (await fleet.ask("alice", "hello", timeout=5)).ok
    assert built == []


async def test_a_cancel_after_the_commit_changes_nothing(
        worker: tuple[Worker, AsyncFleet, fakeredis.FakeAsyncRedis]) -> None:
    _w, fleet, r = worker
    turn = await fleet.submit("alice", "hello")
    await asyncio.wait_for(_answered(r, turn.turn_id), 5)
    got = await fleet.cancel("alice", turn.turn_id)
    assert (got.outcome, got.status) == ("answered", "ok")
    assert str(got) == f"turn {turn.turn_id} already answered (ok)"
    reply = await fleet.wait("alice", turn.turn_id, 5)
    assert reply.ok and reply.text == "done: hello"


async def _answered(r: fakeredis.FakeAsyncRedis, turn_id: str) -> None:
    while await r.zscore(keys.done("alice"), turn_id) is None:
        await asyncio.sleep(0.01)


def test_reply_status_cancelled_round_trips() -> None:
    reply = Reply(turn_id="t1", user="alice", ok=False, status="cancelled", text="part")
    assert decode(Reply, encode(reply)).status == "cancelled"


def test_a_worker_obeys_a_plain_or_encoded_cancel_and_ignores_a_bad_one() -> None:
    from worker.control import ControlStream

    heard: list[tuple[str, str, str]] = []
    drained: list[str] = []
    stream = ControlStream(fakeredis.FakeAsyncRedis(), "w1", drain=drained.append, stop=asyncio.Event(),
                           errors=RedisErrors(logging.getLogger("test")), cancel=lambda *a: heard.append(a))
    stream.obey_cancel({b"kind": b"cancel", b"user": b"alice", b"turn_id": b"t1", b"entry": b"1-0"})
    stream.obey_cancel({b"m": encode(Control(kind="cancel", ts=1.0, user="bob", turn_id="t2", entry="2-0"))})
    stream.obey_cancel({b"kind": b"cancel", b"user": b"alice", b"turn_id": b"t1", b"entry": b"1-0 x"})  # bad
    stream.obey_cancel({b"kind": b"cancel", b"user": b"alice", b"turn_id": b"t1"})  # no entry
    stream.obey_cancel({b"kind": b"explode"})
    # each stream is obeyed for its own kind only: a client, which writes cancels, drains no worker
    stream.obey_cancel({b"kind": b"drain", b"reason": b"a client's"})
    stream.obey_cancel({b"m": encode(Control(kind="drain", ts=1.0))})
    stream.obey({b"m": encode(Control(kind="cancel", ts=1.0, user="bob", turn_id="t3", entry="3-0"))})
    assert heard == [("alice", "t1", "1-0"), ("bob", "t2", "2-0")]
    assert drained == []


@handlers.register("t_cancel_raises")
async def _raises_when_cancelled(ctx: handlers.TurnContext) -> HandlerResult:
    CALLS.append(ctx.turn.text)
    ctx.emit("partial")
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        raise RuntimeError("cleanup failed") from None  # a handler whose cleanup raises
    return HandlerResult(text="never")


async def test_a_cancelled_handler_that_raises_is_answered_cancelled_not_retried() -> None:
    CALLS.clear()
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", TurnsPolicy(handler="t_cancel_raises", max_attempts=5))
    w = Worker(WorkerSettings(worker_id="w1", block_ms=50), r=r)
    run = asyncio.ensure_future(w.run())
    fleet = AsyncFleet(client=r)
    try:
        turn = await fleet.submit("alice", "hi")
        while not CALLS:
            await asyncio.sleep(0.01)
        got = await fleet.cancel("alice", turn.turn_id)
        assert (got.outcome, got.worker) == ("cancelled", "w1")
        reply = await fleet.wait("alice", turn.turn_id, 5)
        assert (reply.status, reply.text) == ("cancelled", "partial")
        assert CALLS == ["hi"] and w.tally.stats().retries == 0
    finally:
        w.drain("test over")
        await asyncio.wait({run}, timeout=10)
        await r.aclose()
