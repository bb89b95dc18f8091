"""Streaming handlers: async generators of text, and ``ctx.emit`` from async and sync handlers."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from protocol.models import Turn
from stores.turns import ContextPack
from worker import handlers


def ctx(text: str = "hi", **options: object) -> tuple[handlers.TurnContext, list[tuple[str, int]]]:
    """A context whose emitter records (text, thread id) of each emitted piece."""
    seen: list[tuple[str, int]] = []
    c = handlers.TurnContext(Turn(turn_id="t1", user="alice", text=text, ts=0.0), ContextPack(),
                             dict(options))
    return replace(c, emitter=lambda t: seen.append((t, threading.get_ident()))), seen


async def test_an_async_generator_handler_emits_each_chunk_and_replies_with_their_concatenation() -> None:
    async def gen(_ctx: handlers.TurnContext) -> AsyncIterator[str]:
        yield "Hel"
        yield ""
        yield "lo"

    c, seen = ctx()
    result = await handlers.call(gen, c, 5.0)
    assert result.text == "Hello"
    assert [t for t, _ in seen] == ["Hel", "lo"]
    assert c.emitted == ["Hel", "lo"]


async def test_a_chunk_is_emitted_as_soon_as_it_is_yielded() -> None:
    gate = asyncio.Event()

    async def gen(_ctx: handlers.TurnContext) -> AsyncIterator[str]:
        yield "first"
        await gate.wait()
        yield "second"

    c, seen = ctx()
    task = asyncio.ensure_future(handlers.call(gen, c, 5.0))
    for _ in range(50):
        if seen:
            break
        await asyncio.sleep(0.01)
    assert [t for t, _ in seen] == ["first"] and not task.done()
    gate.set()
    assert (await task).text == "firstsecond"


async def test_an_async_generator_that_yields_no_text_fails_the_turn() -> None:
    async def gen(_ctx: handlers.TurnContext) -> AsyncIterator[object]:
        yield 42

    c, _ = ctx()
    with pytest.raises(handlers.HandlerError, match="int"):
        await handlers.call(gen, c, 5.0)  # type: ignore[arg-type]


async def test_an_async_generator_handler_times_out() -> None:
    async def gen(_ctx: handlers.TurnContext) -> AsyncIterator[str]:
        yield "a"
        await asyncio.sleep(10)
        yield "b"

    c, _ = ctx()
    with pytest.raises(TimeoutError):
        await handlers.call(gen, c, 0.2)


async def test_a_sync_handler_emits_from_its_thread() -> None:
    def sync(c: handlers.TurnContext) -> str:
        c.emit("one ")
        c.emit("two")
        return "one two"

    c, seen = ctx()
    with ThreadPoolExecutor(max_workers=1) as pool:
        result = await handlers.call(sync, c, 5.0, pool)
    assert result.text == "one two"
    assert [t for t, _ in seen] == ["one ", "two"]
    assert all(thread != threading.get_ident() for _, thread in seen)  # called on the handler's thread


async def test_echo_stream_emits_the_text_word_by_word_with_its_delay() -> None:
    c, seen = ctx("the quick fox", delay_ms=50)
    started = time.monotonic()
    result = await handlers.call(handlers.get("echo_stream"), c, 5.0)
    assert result.text == "the quick fox"
    assert "".join(t for t, _ in seen) == "the quick fox"
    assert [t for t, _ in seen] == ["the", " quick", " fox"]
    assert time.monotonic() - started >= 0.1  # a delay between each two words


async def test_echo_stream_waits_20_ms_between_words_by_default() -> None:
    c, seen = ctx("a b c d e f")
    started = time.monotonic()
    await handlers.call(handlers.get("echo_stream"), c, 5.0)
    assert time.monotonic() - started >= 0.1 and len(seen) == 6
