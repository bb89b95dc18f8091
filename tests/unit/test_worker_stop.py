"""SIGTERM stops a worker that is still trying to start.

Found by scripts/explore (seed 9153 of ``--faults 6 --users 3 --turns 4 --workers 2``): a
worker started during a Redis outage retried its start through the SIGTERM it got and only
stopped once Redis was back (seen in production retrying for ten minutes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import fakeredis
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from worker import app
from worker.app import Worker
from worker.settings import WorkerSettings


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``condition`` holds (polled)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def call_that_drops_its_cancel(calls: list[asyncio.Task[object]]) -> Callable[[], Awaitable[None]]:
    """A redis-py call with Redis away that drops the cancellation of its time limit (CPython
    gh-86296), and whose client's retries then go on for seconds; each run noted in ``calls``."""
    async def call() -> None:
        task = asyncio.current_task()
        assert task is not None
        calls.append(task)
        with contextlib.suppress(asyncio.CancelledError):  # dropped
            await asyncio.sleep(10)  # in a command, Redis away: the client retries
        await asyncio.sleep(10)  # ... and its retries go on
        raise RedisConnectionError("Redis is down")
    return call


@contextlib.asynccontextmanager
async def cleared(tasks: list[asyncio.Task[object]], run: asyncio.Future[int]) -> AsyncIterator[None]:
    """Cancel the calls left behind and the worker's run at the end."""
    try:
        yield
    finally:
        for task in [*tasks, run]:
            task.cancel()
        await asyncio.wait([*tasks, run], timeout=5)


async def test_a_worker_that_cannot_reach_redis_stops_on_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    r = fakeredis.FakeAsyncRedis(connected=False)  # every connection is refused
    worker = Worker(WorkerSettings(worker_id="w1"), r=r)
    attempts = 0
    join = worker.join

    async def counted() -> None:
        nonlocal attempts
        attempts += 1
        await join()

    monkeypatch.setattr(worker, "join", counted)
    run = asyncio.ensure_future(worker.run())
    await until(lambda: attempts >= 2)  # it is retrying its start
    assert not run.done() and worker.state == "starting"
    worker.drain("SIGTERM")
    assert await asyncio.wait_for(run, 30) == 0  # (not retried until Redis is back)
    assert worker.state == "starting"  # it never served


async def test_sigterm_stops_a_start_whose_redis_call_swallowed_the_cancellation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by scripts/explore --seed 32878: SIGTERM came while the worker was stopped (SIGSTOP)
    and starting in an outage. The cancellation of the start landed in redis-py's
    ``asyncio.wait_for`` in the step its inner send ended, and Python 3.11's ``wait_for`` returns
    the inner result then, dropping the cancellation (CPython gh-86296). The start went on
    retrying until Redis was back, 9 s later. A drain must end the retries itself."""
    worker = Worker(WorkerSettings(worker_id="w1"), r=fakeredis.FakeAsyncRedis(connected=False))
    attempts = 0

    async def start_that_loses_the_cancel() -> None:
        nonlocal attempts
        attempts += 1
        try:
            await asyncio.sleep(0 if attempts == 1 else 10)  # (the drain finds it in a call)
        except asyncio.CancelledError:
            if attempts > 2:
                raise
            # what wait_for on 3.11 does when its inner call ends in the step it is cancelled
        raise RedisConnectionError("Redis is down")

    monkeypatch.setattr(worker, "join", start_that_loses_the_cancel)
    run = asyncio.ensure_future(worker.run())
    await until(lambda: attempts >= 2)  # it is retrying its start
    assert not run.done() and attempts >= 2
    worker.drain("SIGTERM")
    await asyncio.wait({run}, timeout=5)  # (not wait_for: cancelling it would be swallowed too)
    assert run.done(), "the start went on retrying through the drain"
    assert run.result() == 0 and worker.state == "starting"


async def test_sigterm_stops_a_start_whose_redis_call_dropped_the_cancellation_and_retries_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 32878 again, drawn with other jitter: the call that dropped the cancellation is
    redis-py's, and its own retries then go on (8 of them, their waits growing to 2 s) before it
    fails. A drain that waited for that call to end stopped 8.6 s after SIGTERM; it waits a
    moment for the cancellation and leaves the call behind."""
    worker = Worker(WorkerSettings(worker_id="w1"), r=fakeredis.FakeAsyncRedis(connected=False))
    calls: list[asyncio.Task[object]] = []
    monkeypatch.setattr(worker, "join", call_that_drops_its_cancel(calls))
    run = asyncio.ensure_future(worker.run())
    async with cleared(calls, run):
        await until(lambda: bool(calls))  # the start's call is under way
        assert not run.done() and len(calls) == 1
        worker.drain("SIGTERM")
        await asyncio.wait({run}, timeout=5)  # (not wait_for: cancelling it would be swallowed too)
        assert run.done(), "the drain waited for the start's call to end"
        assert run.result() == 0 and worker.state == "starting"


async def test_sigterm_stops_a_start_whose_deregister_dropped_the_cancellation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by scripts/explore --seed 527078: SIGTERM came before the worker had joined, and
    Redis went away while it left the registry (it may have registered). The deregister's
    command dropped the cancellation of its time limit (CPython gh-86296) and redis-py's own
    retries went on; ``wait_for`` waited for them, and the worker stopped 8 s after SIGTERM
    instead of within ``DEREGISTER_UNSTARTED_S``. The limit leaves the call behind."""
    worker = Worker(WorkerSettings(worker_id="w1"), r=fakeredis.FakeAsyncRedis(connected=False))
    calls: list[asyncio.Task[object]] = []

    async def refused() -> None:
        raise RedisConnectionError("Redis is down")

    monkeypatch.setattr(worker, "join", refused)
    monkeypatch.setattr(worker, "_deregister", call_that_drops_its_cancel(calls))
    run = asyncio.ensure_future(worker.run())
    async with cleared(calls, run):
        worker.drain("SIGTERM")
        await asyncio.wait({run}, timeout=5)  # (not wait_for: cancelling it would be swallowed too)
        assert run.done(), "the drain waited for the deregister's call to end"
        assert run.result() == 0 and worker.state == "starting" and len(calls) == 1


async def test_a_serving_worker_stops_though_its_deregister_dropped_the_cancellation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same drop on a serving worker's way out: its deregister is limited to
    ``DEREGISTER_S``, and a call that outlives the limit is left behind, not waited for."""
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", TurnsPolicy(handler="noop"))
    worker = Worker(WorkerSettings(worker_id="w1", block_ms=50), r=r)
    calls: list[asyncio.Task[object]] = []
    monkeypatch.setattr(app, "DEREGISTER_S", 0.5)
    monkeypatch.setattr(worker, "_deregister", call_that_drops_its_cancel(calls))
    run = asyncio.ensure_future(worker.run())
    async with cleared(calls, run):
        await until(lambda: worker.state == "ready")
        worker.drain("SIGTERM")
        await asyncio.wait({run}, timeout=5)  # (not wait_for: cancelling it would be swallowed too)
        assert run.done(), "the drain waited for the deregister's call to end"
        assert run.result() == 0 and len(calls) == 1
    await r.aclose()
