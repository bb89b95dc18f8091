"""The one retry helper (stores/retry.py): capped, jittered waits, and ``until_ok``'s stop rules."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from stores.retry import Backoff, until_ok

log = logging.getLogger("test.retry")


def test_waits_double_from_the_base_up_to_the_cap_with_full_jitter() -> None:
    backoff = Backoff(base=0.05, cap=2.0)
    rng = random.getstate()
    try:
        for failures, high in [(1, 0.1), (2, 0.2), (3, 0.4), (5, 1.6), (6, 2.0), (10_000, 2.0)]:
            waits = [backoff.compute(failures) for _ in range(500)]
            assert all(0 <= w <= high for w in waits), failures
            assert max(waits) > 0.8 * high and min(waits) < 0.2 * high  # spread over the window
    finally:
        random.setstate(rng)


def test_a_wait_is_one_draw_of_the_global_generator() -> None:
    """The simulator seeds ``random``: a wait must be a function of that seed alone."""
    backoff = Backoff(base=0.05, cap=2.0)
    random.seed(7)
    first = [backoff.compute(n) for n in range(1, 8)]
    random.seed(7)
    assert [backoff.compute(n) for n in range(1, 8)] == first
    random.seed(7)
    assert first[0] == random.random() * 0.1


def _failing(times: int, calls: list[int]):
    async def fn() -> None:
        calls.append(1)
        if len(calls) <= times:
            raise RedisConnectionError("Redis is down")
    return fn


async def test_until_ok_retries_until_the_call_succeeds() -> None:
    calls: list[int] = []
    await until_ok("t", _failing(3, calls), backoff=Backoff(0.001, 0.01), log=log)
    assert len(calls) == 4


async def test_until_ok_gives_up_after_its_attempts_and_logs_it(caplog) -> None:
    calls: list[int] = []
    with caplog.at_level(logging.WARNING):
        await until_ok("t", _failing(10, calls), backoff=Backoff(0.001, 0.01), log=log, attempts=3)
    assert len(calls) == 3
    assert "t failed 3 times, giving up: Redis is down" in caplog.text


async def test_until_ok_raises_what_it_does_not_retry() -> None:
    async def broken() -> None:
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError, match="a bug"):
        await until_ok("t", broken, backoff=Backoff(0.001, 0.01), log=log)


async def test_the_event_ends_the_wait_at_once_and_the_retries_at_the_next_failure() -> None:
    calls: list[int] = []
    stop = asyncio.Event()
    task = asyncio.ensure_future(until_ok("t", _failing(100, calls), backoff=Backoff(60.0, 60.0),
                                          log=log, unless=stop))
    while not calls:  # the first try, which fails: then a wait of up to a minute
        await asyncio.sleep(0.001)
    assert len(calls) == 1 and not task.done()
    stop.set()
    await asyncio.wait({task}, timeout=5)
    assert task.done() and task.result() is None
    assert len(calls) == 2  # one more try after the wake, which failed: not retried


async def test_once_the_event_is_set_the_first_failure_ends_the_retries() -> None:
    calls: list[int] = []
    stop = asyncio.Event()
    stop.set()
    await until_ok("t", _failing(100, calls), backoff=Backoff(60.0, 60.0), log=log, unless=stop)
    assert len(calls) == 1
    calls.clear()
    await until_ok("t", _failing(0, calls), backoff=Backoff(60.0, 60.0), log=log, unless=stop)
    assert len(calls) == 1  # (a success is a success)


async def test_a_cancellation_goes_through() -> None:
    started = asyncio.Event()

    async def slow() -> None:
        started.set()
        await asyncio.sleep(60)

    task = asyncio.ensure_future(until_ok("t", slow, backoff=Backoff(0.001, 0.01), log=log))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
