"""SIGTERM stops a worker that is still trying to start (issue 8, hole 6).

Found by scripts/explore (seed 9153 of ``--faults 6 --users 3 --turns 4 --workers 2``): a
worker started during a Redis outage retried its start through the SIGTERM it got and only
stopped once Redis was back (seen in production retrying for ten minutes)."""

from __future__ import annotations

import asyncio

import fakeredis

from worker.app import Worker
from worker.settings import WorkerSettings


async def test_a_worker_that_cannot_reach_redis_stops_on_sigterm() -> None:
    r = fakeredis.FakeAsyncRedis(connected=False)  # every connection is refused
    worker = Worker(WorkerSettings(worker_id="w1"), r=r)
    run = asyncio.ensure_future(worker.run())
    await asyncio.sleep(0.3)  # it is retrying its start
    assert not run.done() and worker.state == "starting"
    worker.drain("SIGTERM")
    assert await asyncio.wait_for(run, 30) == 0  # before the fix: retried until the 30 s ran out
    assert worker.state == "starting"  # it never served
