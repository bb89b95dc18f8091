"""A commit that a Redis failover lost is served again, not spun on.

With asynchronous replication a master can acknowledge a turn's commit (cursor advance, inbox
entry deleted, reply) and die before its replica has it; the promoted replica still has the
entry after the cursor. The worker believed its own cursor: it read the inbox after it, found
nothing, and the release kept the lane because the server still saw a turn after *its* cursor
-- around again, forever, holding the lane (and a later turn of the user came back 'stale'
and got no reply). Here the lost write is a commit that answers "ok" and writes nothing,
exactly what the worker sees across such a failover.

The commit hands back the next turn, so the worker serves that turn; its commit is stale on
the promoted replica, which hands back the lost turn again (Redis's cursor, not the
worker's), and both are answered in order.
"""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis

from fleet.client import AsyncFleet
from protocol import keys
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from stores.turns import Committed, NextTurn
from worker.app import Worker
from worker.settings import WorkerSettings


async def test_a_commit_lost_in_a_failover_is_served_again_and_the_next_turn_too() -> None:
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", TurnsPolicy(concurrency=2))
    worker = Worker(WorkerSettings(worker_id="w1", block_ms=50), r=r)
    real_commit = worker.store.commit
    lost: list[str] = []

    async def commit(*args: Any, **kwargs: Any) -> Committed:
        if not lost:  # acknowledged by the old master (the next turn handed back), gone with it
            lost.append(args[1])
            (entry, fields), = await r.xrange(keys.inbox("alice"), min=f"({args[1]}", count=1)
            return Committed("ok", False, NextTurn(entry.decode(), fields))
        return await real_commit(*args, **kwargs)

    worker.store.commit = commit  # type: ignore[method-assign]
    run = asyncio.ensure_future(worker.run())
    fleet = AsyncFleet(client=r)
    try:
        first, second = await fleet.submit_many([("alice", "one"), ("alice", "two")])
        # before the fix: neither came (the first commit was lost, the second was 'stale')
        assert (await fleet.wait("alice", first.turn_id, timeout=5)).text.startswith("echo: one")
        assert (await fleet.wait("alice", second.turn_id, timeout=5)).text.startswith("echo: two")
        assert lost  # the lost commit did happen
    finally:
        worker.drain("test over")
        await asyncio.wait({run}, timeout=10)
        await r.aclose()
    assert run.done() and run.result() == 0
