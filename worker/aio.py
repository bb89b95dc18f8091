"""asyncio helpers of the worker: its loops' pace (``every``, ``pause``), a read that a drain may
abandon, a cancellation that may be dropped, a call bounded in time, and a task dump."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from stores.redis_errors import RedisErrors
from stores.retry import TRANSIENT, Backoff

log = logging.getLogger("fleet.worker")
T = TypeVar("T")
BACKOFF = Backoff(base=0.05, cap=2.0)  # the loops' waits: 50 ms doubling to 2 s, full jitter


async def pause(seconds: float, stop: asyncio.Event) -> None:
    """Sleep, waking early when ``stop`` is set."""
    with contextlib.suppress(TimeoutError):  # (not wait_for: it can drop a cancellation, gh-86296)
        async with asyncio.timeout(seconds):
            await stop.wait()


async def every(what: str, interval: float, fn: Callable[[], Awaitable[None]], stop: asyncio.Event,
                errors: RedisErrors) -> None:
    """Call ``fn`` every ``interval`` seconds until ``stop`` is set. A loop never dies: a failed
    pass is backed off (at least ``interval``), and the loop goes on; a Redis error is told to
    ``errors`` (logged once per kind), any other failure logged."""
    failures = 0
    while not stop.is_set():
        try:
            await fn()
            failures = 0
            errors.answered(what)
            await pause(interval, stop)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failures += 1
            if isinstance(exc, TRANSIENT):
                errors.failed(what, exc)
            else:
                log.warning("%s pass failed (%s: %s)", what, type(exc).__name__, exc)
            await pause(max(interval, BACKOFF.compute(failures)), stop)


class Abandoned(Exception):
    """The awaitable was still running past its grace after the stop event: it is left behind."""


async def unless_stuck(aw: Awaitable[T], stop: asyncio.Event, grace_s: float, cancel_s: float) -> T:
    """Await ``aw``; once ``stop`` is set, give it ``grace_s`` more to finish, then cancel it and
    wait at most ``cancel_s`` for the cancellation (which the library under it may drop:
    CPython gh-86296) before raising ``Abandoned``; its eventual outcome is marked seen. If the
    caller is cancelled, ``aw`` is cancelled with it."""
    task = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            await asyncio.wait({task}, timeout=grace_s)
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=cancel_s)
            task.add_done_callback(_retrieved)
            raise Abandoned
        return task.result()
    finally:
        stopped.cancel()
        if not task.done():  # the caller is cancelled: the read goes too, and what it ends with
            task.cancel()    # (an error, if the cancellation was dropped) is no news
            task.add_done_callback(_retrieved)


async def cancel_within(task: asyncio.Future[Any], wait_s: float) -> None:
    """Cancel ``task`` and wait at most ``wait_s`` for it to end. The library under it may drop
    the cancellation (CPython gh-86296) and go on, as redis-py's own retries of a command do for
    seconds with Redis away: then it is left behind. Its outcome, now or later, is marked seen."""
    task.cancel()
    await asyncio.wait({task}, timeout=wait_s)
    task.add_done_callback(_retrieved)


async def within(aw: Awaitable[T], seconds: float) -> T:
    """Await ``aw`` for at most ``seconds``; past that, cancel it and raise ``Abandoned`` at once,
    without waiting for the cancellation (which the library under it may drop: CPython
    gh-86296); its eventual outcome is marked seen. If the caller is cancelled, ``aw`` is too."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({task}, timeout=seconds)
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieved)
    if not task.done():
        raise Abandoned
    return task.result()


def dump_tasks() -> None:
    """Log the stack of every asyncio task (a stuck drain, a slow handler)."""
    for task in asyncio.all_tasks():
        buf = io.StringIO()
        task.print_stack(limit=8, file=buf)
        log.warning("task %s:\n%s", task.get_name(), buf.getvalue())


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark an abandoned task's outcome as seen, so asyncio does not log it at exit."""
    if not task.cancelled():
        task.exception()
