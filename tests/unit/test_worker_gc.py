"""A worker ready to serve has moved its startup heap (modules, pydantic's schemas, the
handler's imports) out of the garbage collector's sight: a full collection scanned all of it,
some 30 ms in which the loop served nothing, the tail of a turn's latency."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from types import SimpleNamespace

import fakeredis
import pytest

from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from worker import __main__ as entry
from worker.app import Worker, freeze_startup_heap
from worker.settings import WorkerSettings


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()  # (an earlier test's worker froze this process's heap)
    yield
    gc.unfreeze()


async def test_a_worker_ready_to_serve_has_frozen_its_startup_heap(unfrozen: None) -> None:
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", TurnsPolicy(handler="noop"))
    w = Worker(WorkerSettings(worker_id="w1", block_ms=50), r=r, on_ready=freeze_startup_heap)
    assert gc.get_freeze_count() == 0
    run = asyncio.ensure_future(w.run())
    try:
        async with asyncio.timeout(10):
            while w.state != "ready":
                await asyncio.sleep(0.01)
        assert gc.get_freeze_count() > 10_000
    finally:
        w.drain("test over")
        await asyncio.wait({run}, timeout=10)
        await r.aclose()


def test_the_worker_process_freezes_its_heap_once_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m worker`` gives its worker the freeze (workers that share a process do not)."""
    given: list[object] = []

    class Recorded:
        def __init__(self, settings: WorkerSettings, on_ready: object = None) -> None:
            given.append(on_ready)
            self.store = SimpleNamespace(batcher=SimpleNamespace(stats=SimpleNamespace(summary=str)))

        async def run(self) -> int:
            return 0

    monkeypatch.setattr(entry, "Worker", Recorded)
    monkeypatch.setattr(entry, "set_process_title", lambda *_: None)
    assert entry.run(entry.parse_args(["--tier", "chat", "--redis-url", "redis://127.0.0.1:1/0"])) == 0
    assert given == [freeze_startup_heap]
