"""worker.aio.unless_stuck: what a drain does to a read in flight (explorer seed 32878)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from worker.aio import Abandoned, unless_stuck


async def _value_after(seconds: float, value: str = "rows") -> str:
    await asyncio.sleep(seconds)
    return value


async def _ignores_cancellation(release: asyncio.Event) -> str:
    """Like a redis-py send whose cancellation ``wait_for`` dropped: it runs on until released."""
    while True:
        try:
            await release.wait()
            return "late"
        except asyncio.CancelledError:
            continue


async def test_without_a_stop_the_result_comes_back() -> None:
    assert await unless_stuck(_value_after(0.01), asyncio.Event(), grace_s=0.0, cancel_s=0.0) == "rows"


async def test_after_a_stop_a_read_that_ends_within_its_grace_is_kept() -> None:
    stop = asyncio.Event()
    stop.set()
    assert await unless_stuck(_value_after(0.02), stop, grace_s=1.0, cancel_s=0.0) == "rows"


async def test_a_read_past_its_grace_is_cancelled_and_one_that_ignores_it_is_abandoned() -> None:
    stop, release = asyncio.Event(), asyncio.Event()
    stop.set()
    with pytest.raises(Abandoned):  # returning at all shows it did not wait: release is unset
        await unless_stuck(_ignores_cancellation(release), stop, grace_s=0.02, cancel_s=0.02)
    release.set()  # the abandoned task ends; its outcome was marked seen
    await asyncio.sleep(0)


async def test_a_cancelled_caller_takes_the_read_with_it() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def read() -> str:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    caller = asyncio.ensure_future(unless_stuck(read(), asyncio.Event(), grace_s=0.0, cancel_s=0.0))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(cancelled.wait(), 1.0)


async def test_a_read_left_by_a_cancelled_caller_that_then_fails_is_not_reported() -> None:
    """Seen in explorations: the read dropped its cancellation, then failed (Redis down), and
    asyncio logged "Task exception was never retrieved" at exit."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    release, reading = asyncio.Event(), asyncio.Event()

    async def read() -> str:
        try:
            reading.set()
            await asyncio.sleep(10)
        except asyncio.CancelledError:  # dropped, as wait_for on 3.11 may
            await release.wait()
            raise ConnectionError("Redis is down") from None
        return "never"

    caller = asyncio.ensure_future(unless_stuck(read(), asyncio.Event(), grace_s=0.0, cancel_s=0.0))
    await reading.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    release.set()
    for _ in range(5):
        await asyncio.sleep(0)
    gc.collect()  # an unretrieved exception is reported when its task is collected
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported
