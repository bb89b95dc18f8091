"""Async handlers: run in the caller's task (no task of their own a turn), bounded by the
handler timeout, and stopped by a cancel of the caller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from protocol.models import HandlerResult, Turn
from stores.turns import ContextPack
from worker import handlers


def ctx() -> handlers.TurnContext:
    return handlers.TurnContext(Turn(turn_id="t1", user="alice", text="hi", ts=0.0), ContextPack())


async def test_an_async_handler_runs_in_the_callers_task() -> None:
    seen: list[asyncio.Task[object] | None] = []

    async def handler(_ctx: handlers.TurnContext) -> str:
        seen.append(asyncio.current_task())
        return "ok"

    async def gen(_ctx: handlers.TurnContext) -> AsyncIterator[str]:
        seen.append(asyncio.current_task())
        yield "ok"

    assert (await handlers.call(handler, ctx(), 5.0)) == HandlerResult(text="ok")
    assert (await handlers.call(gen, ctx(), 5.0)) == HandlerResult(text="ok")
    assert seen == [asyncio.current_task()] * 2


def sleeper(stopped: list[str], started: asyncio.Event | None = None,
            ) -> Callable[[handlers.TurnContext], Awaitable[str]]:
    """A handler that sleeps 10 s and notes its cancel in ``stopped``."""

    async def handler(_ctx: handlers.TurnContext) -> str:
        if started is not None:
            started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            stopped.append("cancelled")
            raise
        return "late"

    return handler


@pytest.mark.parametrize("kind", ["coroutine", "generator"])
async def test_an_async_handler_past_its_timeout_is_cancelled_and_times_out(kind: str) -> None:
    stopped: list[str] = []
    handler = sleeper(stopped)

    async def gen(_ctx: handlers.TurnContext) -> AsyncIterator[str]:
        yield "a"
        yield await handler(_ctx)

    with pytest.raises(TimeoutError):
        await handlers.call(handler if kind == "coroutine" else gen, ctx(), 0.05)
    assert stopped == ["cancelled"]


async def test_a_cancel_of_the_caller_reaches_the_handler_and_is_not_a_timeout() -> None:
    started, stopped = asyncio.Event(), list[str]()
    call = asyncio.ensure_future(handlers.call(sleeper(stopped, started), ctx(), 5.0))
    await started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert stopped == ["cancelled"]
