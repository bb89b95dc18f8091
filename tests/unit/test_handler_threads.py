"""Sync handlers: their own pool, timed from their start, never overlapping their own retry."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import fakeredis
import pytest

from protocol.models import HandlerResult, Turn
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from stores.turns import ContextPack
from worker import handlers
from worker.app import Worker
from worker.settings import WorkerSettings


def ctx(turn_id: str = "t1") -> handlers.TurnContext:
    return handlers.TurnContext(Turn(turn_id=turn_id, user="alice", text="hi", ts=0.0), ContextPack())


async def test_the_timeout_counts_from_the_handler_start_not_from_the_queue() -> None:
    """Time spent waiting for a thread must not count against handler_timeout_s."""
    gate = threading.Event()

    def slow(_ctx: handlers.TurnContext) -> str:
        gate.wait(5)
        return "slow"

    def quick(_ctx: handlers.TurnContext) -> str:
        return "quick"

    with ThreadPoolExecutor(max_workers=1) as pool:
        first = asyncio.ensure_future(handlers.call(slow, ctx("a"), 10.0, pool))
        second = asyncio.ensure_future(handlers.call(quick, ctx("b"), 0.2, pool))
        await asyncio.sleep(0.6)  # the second waits for the only thread, far past its 0.2 s
        gate.set()
        assert (await first).text == "slow"
        assert (await second).text == "quick"


async def test_a_timed_out_thread_has_ended_before_the_call_returns() -> None:
    """A timed-out thread must not run on while its retry starts."""
    ended: list[float] = []

    def stuck(_ctx: handlers.TurnContext) -> HandlerResult:
        time.sleep(0.3)
        ended.append(time.monotonic())
        return HandlerResult(text="late")

    with ThreadPoolExecutor(max_workers=2) as pool:
        with pytest.raises(TimeoutError):
            await handlers.call(stuck, ctx(), 0.05, pool)
        assert ended, "the call returned while its thread still ran: a retry would overlap it"


async def test_an_abandoned_handler_that_never_got_a_thread_never_runs() -> None:
    gate, holding = threading.Event(), threading.Event()
    ran: list[str] = []

    def hold(_ctx: handlers.TurnContext) -> str:
        holding.set()
        gate.wait(5)
        return "held"

    def record(c: handlers.TurnContext) -> str:
        ran.append(c.turn.turn_id)
        return "ran"

    with ThreadPoolExecutor(max_workers=1) as pool:
        first = asyncio.ensure_future(handlers.call(hold, ctx("a"), 10.0, pool))
        queued = asyncio.ensure_future(handlers.call(record, ctx("b"), 10.0, pool))
        await asyncio.to_thread(holding.wait, 5)  # the only thread is taken: the second call waits for it
        queued.cancel()  # its lane was lost while it waited for a thread
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.set()
        await first
    assert ran == []


async def test_the_worker_has_as_many_handler_threads_as_its_concurrency() -> None:
    r = fakeredis.FakeAsyncRedis()
    w = Worker(WorkerSettings(worker_id="w1"), r=r)
    await write_policy(r, "chat", TurnsPolicy(concurrency=64))
    await w.tier_policy.refresh()
    pool = w.host.executor
    assert pool is w.host.executor  # kept while the concurrency stays
    together = threading.Barrier(64, timeout=10)  # passes only if all 64 run at once
    for f in [pool.submit(together.wait) for _ in range(64)]:
        f.result()  # BrokenBarrierError if the pool had fewer threads (min(32, cpus + 4) by default)
    await write_policy(r, "chat", TurnsPolicy(concurrency=2))
    await w.tier_policy.refresh()
    assert w.host.executor is not pool
    w.host.executor.shutdown()
    await r.aclose()
