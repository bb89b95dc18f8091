"""Reclaim resumes where its last pass stopped.

Reclaimed notifications of busy lanes rightly stay pending, so after a few worker faults the
head of the pending list is full of them. A reclaim that started every pass from ``0-0`` would
take those same ones again each time (XAUTOCLAIM returns the first idle entries, ``COUNT`` =
free slots) and never reach an idle notification further on: under steady load, turns would
wait for minutes. The explorer's finite workloads never hold lanes busy that long, so this
test builds the pending list directly, and runs a worker over it."""

from __future__ import annotations

import asyncio

import fakeredis

from protocol import keys
from protocol.policy import Policy
from stores.policies import write_policy
from worker.app import Worker
from worker.settings import WorkerSettings

IDLE_MS = 100


async def test_reclaim_reaches_an_idle_notification_behind_a_head_of_busy_ones() -> None:
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", Policy(concurrency=4))
    ready = keys.ready("chat")
    await r.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    busy = [await r.xadd(ready, {"user": f"busy{i}"}) for i in range(12)]  # (their lanes are held)
    starved = await r.xadd(ready, {"user": "starved"})
    await r.xreadgroup(keys.GROUP, "dead-worker", {ready: ">"})  # delivered to a worker that died

    worker = Worker(WorkerSettings(worker_id="w1", reclaim_idle_ms=IDLE_MS, renew_interval_s=0.04,
                                   reclaim_interval_s=IDLE_MS / 1000 + 0.02, block_ms=50), r=r)
    dispatched: list[str] = []
    # a reclaimed notification whose lane is busy stays pending under us, unacked: dispatch
    # only records it (a Busy acquire leaves it exactly so)
    worker.dispatch = lambda nid, fields, reclaimed: dispatched.append(nid)  # type: ignore[method-assign]
    run = asyncio.ensure_future(worker.run())
    try:
        async with asyncio.timeout(8 * (IDLE_MS / 1000 + 0.02) + 5):  # 4 slots a pass: by pass 4
            while starved.decode() not in dispatched:
                await asyncio.sleep(0.01)
    except TimeoutError:
        pass
    finally:
        worker.drain("test over")
        await asyncio.wait({run}, timeout=10)
        await r.aclose()
    assert starved.decode() in dispatched, f"never reached; claimed {len(dispatched)} times, " \
        f"{len(set(dispatched) & {b.decode() for b in busy})} distinct busy ones"
