"""A real worker's turn counts (worker/tally.py) on the paths the integration tests do not
reach: a commit fenced by a takeover, and one that finds the entry committed already."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest

from fleet.client import AsyncFleet
from protocol import keys
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from stores.turns import Committed, Fenced, NextTurn
from worker.app import Worker
from worker.settings import WorkerSettings


@pytest.mark.parametrize(("first_commit", "want"), [
    # the lane was taken over before the commit: fenced; the turn is served again, a retry
    ("fenced", {"fenced": 1, "ok": 1, "stale": 0, "retries": 1}),
    # the commit found the entry committed (and wrote nothing here): stale; served again
    ("stale", {"fenced": 0, "ok": 1, "stale": 1, "retries": 1}),
])
async def test_a_lost_commit_is_counted_and_the_turn_once_served(first_commit: str,
                                                                 want: dict[str, int]) -> None:
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", TurnsPolicy(concurrency=2))
    worker = Worker(WorkerSettings(worker_id="w1", block_ms=50), r=r)
    real_commit = worker.store.commit
    calls: list[str] = []

    async def commit(*args: Any, **kwargs: Any) -> Committed:
        calls.append(args[1])
        if len(calls) > 1:
            return await real_commit(*args, **kwargs)
        if first_commit == "fenced":
            await r.delete(keys.lane("alice"))  # another worker's takeover cleared the lane
            raise Fenced("alice")
        (entry, fields), = await r.xrange(keys.inbox("alice"), count=1)  # as the script says:
        return Committed("stale", False, NextTurn(entry.decode(), fields))  # the entry is next

    worker.store.commit = commit  # type: ignore[method-assign]
    run = asyncio.ensure_future(worker.run())
    fleet = AsyncFleet(client=r)
    try:
        turn = await fleet.submit("alice", "one")
        reply = await fleet.wait("alice", turn.turn_id, timeout=5)
        assert reply.ok and reply.attempts == 2
    finally:
        worker.drain("test over")
        await asyncio.wait({run}, timeout=10)
        await r.aclose()
    stats = worker.tally.stats()
    got = {"fenced": stats.fenced, "ok": stats.ok, "stale": stats.stale, "retries": stats.retries}
    assert got == want
    assert (stats.error, stats.dup, stats.dead_letters) == (0, 0, 0)
    # one queue wait (the first attempt), two handler calls, one reply
    assert (stats.queue_wait.count, stats.handler.count, stats.latency.count) == (1, 2, 1)
