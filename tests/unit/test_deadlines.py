"""Turn deadlines: the protocol field, the client's ways to set it, and a worker (in process, on
fakeredis' Lua) that answers a turn reached after its deadline ``expired`` without calling the
handler, shows the deadline to a handler that runs, and stops retrying at it."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
from pydantic import ValidationError

from fleet.client import AsyncFleet, Fleet
from protocol import keys
from protocol.codec import CodecError, decode, encode, unpack
from protocol.models import HandlerResult, Reply, Turn
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from worker import handlers
from worker.app import Worker
from worker.intake import decode_entry
from worker.settings import WorkerSettings

CALLS: list[tuple[str, float | None]] = []  # (turn text, ctx.deadline) of every call of "t_deadline"


@handlers.register("t_deadline")
async def _recording(ctx: handlers.TurnContext) -> HandlerResult:
    CALLS.append((ctx.turn.text, ctx.deadline))
    if ctx.option("fail", False):
        raise handlers.HandlerError("always fails")
    await asyncio.sleep(float(ctx.option("sleep_ms", 0)) / 1000)
    return HandlerResult(text=f"done: {ctx.turn.text}")


def _turn(**kw: Any) -> Turn:
    return Turn(turn_id="t1", user="alice", text="hi", ts=time.time(), **kw)


def test_a_deadline_is_a_positive_finite_unix_time() -> None:
    assert _turn(deadline=1e9).deadline == 1e9
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValidationError):
            _turn(deadline=bad)


def test_a_turn_without_a_deadline_encodes_as_before() -> None:
    """No ``deadline`` key on the wire when unset: a worker that predates it still decodes."""
    assert "deadline" not in unpack(encode(_turn()))
    assert decode(Turn, encode(_turn(deadline=2e9))).deadline == 2e9


def test_a_plain_entry_carries_a_deadline_field() -> None:
    turn = decode_entry("alice", "chat", "1-0", {b"text": b"hi", b"deadline": b"2000000000.5"}, 1 << 16)
    assert turn.deadline == 2000000000.5
    for bad in (b"soon", b"-3", b"inf"):
        with pytest.raises(CodecError, match="deadline"):
            decode_entry("alice", "chat", "1-0", {b"text": b"hi", b"deadline": bad}, 1 << 16)


def test_the_client_sets_a_deadline_or_a_timeout_not_both() -> None:
    fleet = Fleet(client=fakeredis.FakeRedis())
    with pytest.raises(ValueError, match="deadline or timeout_s"):
        fleet.submit("alice", "hi", deadline=time.time() + 5, timeout_s=5, create_tier=True)
    before = time.time()
    handle = fleet.submit("alice", "hi", timeout_s=5, create_tier=True)
    (_entry, fields), = fleet.r.xrange(keys.inbox("alice"))
    deadline = decode(Turn, fields[b"m"]).deadline
    assert deadline is not None and before + 5 <= deadline <= time.time() + 5
    assert handle.turn_id == fields[b"turn_id"].decode()


@pytest.fixture
async def worker() -> AsyncIterator[tuple[Worker, AsyncFleet]]:
    CALLS.clear()
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", TurnsPolicy(handler="t_deadline", concurrency=2, max_attempts=10))
    w = Worker(WorkerSettings(worker_id="w1", block_ms=50), r=r)
    run = asyncio.ensure_future(w.run())
    try:
        yield w, AsyncFleet(client=r)
    finally:
        w.drain("test over")
        await asyncio.wait({run}, timeout=10)
        await r.aclose()


async def test_a_turn_reached_after_its_deadline_expires_without_its_handler(
        worker: tuple[Worker, AsyncFleet]) -> None:
    w, fleet = worker
    slow = await fleet.submit("alice", "slow", meta={"sleep_ms": 600})
    late = await fleet.submit("alice", "late", timeout_s=0.2)
    first, second = await fleet.wait("alice", slow.turn_id, 5), await fleet.wait("alice", late.turn_id, 5)
    assert first.ok and first.status == "ok"
    assert (second.ok, second.status) == (False, "expired")
    assert second.error is not None and "deadline" in second.error
    assert [text for text, _ in CALLS] == ["slow"]  # the late turn's handler never ran
    # the user goes on: the next turn is served (and the worker has counted the expired one)
    assert (await fleet.ask("alice", "next", timeout=5)).ok
    stats = w.tally.stats()
    assert (stats.expired, stats.error, stats.dead_letters) == (1, 0, 0)  # not dead-lettered
    assert not await fleet.r.xlen(keys.dead("chat"))
    assert int(await fleet.r.hget(keys.usage("alice"), "expired")) == 1


async def test_a_running_handler_sees_its_deadline(worker: tuple[Worker, AsyncFleet]) -> None:
    _w, fleet = worker
    reply = await fleet.ask("alice", "hi", timeout=7)  # ask's wait timeout sets the deadline
    assert reply.ok
    (_text, deadline), = CALLS
    assert deadline is not None and 0 < deadline - time.time() <= 7
    CALLS.clear()
    assert (await fleet.ask("alice", "no deadline", timeout=5, deadline=None)).ok
    assert CALLS == [("no deadline", None)]


async def test_retries_stop_at_the_deadline(worker: tuple[Worker, AsyncFleet]) -> None:
    w, fleet = worker
    turn = await fleet.submit("alice", "doomed", meta={"fail": True}, timeout_s=0.5)
    reply = await fleet.wait("alice", turn.turn_id, 10)
    assert reply.status == "expired" and "always fails" in (reply.error or "")
    assert 1 <= len(CALLS) < 10  # fewer than max_attempts: the backoff ran into the deadline
    assert w.tally.stats().dead_letters == 0


def test_reply_status_round_trips() -> None:
    reply = Reply(turn_id="t1", user="alice", ok=False, status="expired", error="late")
    assert decode(Reply, encode(reply)).status == "expired"
