"""The worker's stream writers: flushed by one timer for all turns, resent whole after a flush
whose outcome is unknown, and handing the rest to the commit."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from stores.turns import Flush, Lease, StreamTail
from worker.streams import StreamFlusher, StreamWriter


class FakeStore:
    """``UserStore.append_streams``: records each flush (with the call it came in)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str, bool, int]] = []
        self.fail: list[Exception] = []
        self.answer = "ok"
        self.gate: asyncio.Event | None = None

    async def append_streams(self, flushes: list[Flush]) -> list[str | Exception]:
        call = len(self.calls)
        self.calls += [(f.turn_id, f.attempt, f.text, f.restart, call) for f in flushes]
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            return [self.fail.pop(0)] * len(flushes)
        return [self.answer] * len(flushes)


def writer(store: FakeStore, turn: str = "t1", attempt: int = 1, flush_s: float = 0.01,
           flusher: StreamFlusher | None = None) -> StreamWriter:
    f = flusher or StreamFlusher(store, flush_s)  # type: ignore[arg-type]
    return f.writer(Lease("alice", "w|1", ""), turn, attempt, 1000, restart=attempt > 1)


async def settle(store: FakeStore, calls: int) -> None:
    for _ in range(200):
        if len(store.calls) >= calls:
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.02)


async def test_the_turns_buffers_are_flushed_together_each_interval() -> None:
    store = FakeStore()
    flusher = StreamFlusher(store, 0.02)  # type: ignore[arg-type]
    a, b = writer(store, "a", flusher=flusher), writer(store, "b", flusher=flusher)
    a.emit("one ")
    a.emit("two")
    b.emit("x")
    await settle(store, 2)
    assert sorted(c[:4] for c in store.calls) == [("a", 1, "one two", False), ("b", 1, "x", False)]
    assert len(flusher._due) == 0


async def test_a_later_attempt_starts_with_a_restart_once() -> None:
    store = FakeStore()
    w = writer(store, attempt=2)
    w.emit("a")
    await settle(store, 1)
    w.emit("b")
    await settle(store, 2)
    assert [c[2:4] for c in store.calls] == [("a", True), ("b", False)]


async def test_a_failed_flush_is_resent_whole_after_a_restart() -> None:
    store = FakeStore()
    w = writer(store)
    w.emit("a")
    await settle(store, 1)
    store.fail.append(RedisConnectionError("lost"))
    w.emit("b")
    await settle(store, 3)
    assert [c[2:4] for c in store.calls] == [("a", False), ("b", False), ("ab", True)]


async def test_the_tail_waits_for_the_flush_in_flight_and_takes_the_rest() -> None:
    store = FakeStore()
    store.gate = asyncio.Event()
    w = writer(store, flush_s=0.0)
    w.emit("a")
    await settle(store, 1)  # in flight, held
    w.emit("b")
    tail = asyncio.ensure_future(w.tail())
    await asyncio.sleep(0.02)
    assert not tail.done()
    store.gate.set()
    assert await tail == StreamTail(1, "b", False)
    w.emit("late")  # after the attempt: dropped
    await asyncio.sleep(0.03)
    assert [c[2] for c in store.calls] == ["a"]


@pytest.mark.parametrize("answer", ["fenced", "done", "wrongtype"])
async def test_a_refused_flush_stops_the_stream(answer: str) -> None:
    store = FakeStore()
    store.answer = answer
    w = writer(store, attempt=2)
    w.emit("a")
    await settle(store, 1)
    w.emit("b")
    await asyncio.sleep(0.05)
    assert len(store.calls) == 1 and w.stopped == answer
    assert await w.tail() == StreamTail(2, "", True)


async def test_emits_from_a_thread_arrive_in_order() -> None:
    store = FakeStore()
    w = writer(store, flush_s=0.05)

    def emit_all() -> None:
        for i in range(50):
            w.emit(f"{i},")

    thread = threading.Thread(target=emit_all)
    thread.start()
    await asyncio.to_thread(thread.join)
    tail: Any = await w.tail()
    sent = "".join(c[2] for c in store.calls) + tail.text
    assert sent == "".join(f"{i}," for i in range(50))


async def test_text_over_the_limit_is_not_streamed() -> None:
    store = FakeStore()
    w = writer(store)
    w.emit("x" * 999)
    w.emit("yy")
    assert w.stopped == "too long" and w.pending == []
    await asyncio.sleep(0.03)
    assert store.calls == []


async def test_long_streams_flush_less_often_and_together() -> None:
    """A stream's first flush comes at the first tick (its first words show at once); each next
    one waits about twice as long as the last, up to ``max_s``, on the same grid for every
    stream: the long streams of a worker flush in the same ticks (one round trip, one wake-up
    of their readers)."""
    store = FakeStore()
    times: dict[str, list[float]] = {"a": [], "b": []}
    append = store.append_streams

    async def timed(flushes: list[Flush]) -> list[str | Exception]:
        for f in flushes:
            times[f.turn_id].append(asyncio.get_running_loop().time())
        return await append(flushes)

    store.append_streams = timed  # type: ignore[method-assign]
    flusher = StreamFlusher(store, 0.02, max_s=0.08)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    start = loop.time()
    a = flusher.writer(Lease("alice", "w|1", ""), "a", 1, 10_000, restart=False)
    b: StreamWriter | None = None
    while loop.time() - start < 0.8:
        if b is None and loop.time() - start > 0.03:
            b = flusher.writer(Lease("bob", "w|1", ""), "b", 1, 10_000, restart=False)
        for w in (a, b):
            if w is not None:
                w.emit("w ")
        await asyncio.sleep(0.005)
    assert times["a"][0] - start < 0.04
    gaps = [y - x for x, y in zip(times["a"], times["a"][1:], strict=False)]
    assert all(0.015 <= g <= 0.15 for g in gaps) and all(g >= 0.035 for g in gaps[3:]), gaps
    assert 7 <= len(times["a"]) <= 13, gaps  # (one a tick: 40)
    late_a = [t for t in times["a"] if t - start > 0.4]
    late_b = [t for t in times["b"] if t - start > 0.4]
    assert late_a and all(min(abs(t - u) for u in late_a) < 0.01 for t in late_b), (late_a, late_b)
