"""Reclaim resumes where its last pass stopped.

Reclaimed notifications of busy lanes rightly stay pending, so after a few worker faults the
head of the pending list is full of them. A reclaim that started every pass from ``0-0`` took
those same ones again each time (XAUTOCLAIM returns the first idle entries, ``COUNT`` = free
slots) and never reached an idle notification further on: measured under steady load, turns
waited 60-137 s. The explorer's finite workloads never hold lanes busy long enough to show it;
this test builds the pending list directly."""

from __future__ import annotations

import asyncio

import fakeredis

from protocol import keys
from worker.reclaim import Reclaim
from worker.settings import WorkerSettings

IDLE_MS = 100


async def test_reclaim_reaches_an_idle_notification_behind_a_head_of_busy_ones() -> None:
    r = fakeredis.FakeAsyncRedis()
    ready = keys.ready("chat")
    await r.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    busy = [await r.xadd(ready, {"user": f"busy{i}"}) for i in range(12)]  # (their lanes are held)
    starved = await r.xadd(ready, {"user": "starved"})
    await r.xreadgroup(keys.GROUP, "dead-worker", {ready: ">"})  # delivered to a worker that died

    dispatched: list[str] = []

    async def ack(nids: list[str]) -> None:
        raise AssertionError(f"nothing was trimmed, yet {nids} were acked")

    # a reclaimed notification whose lane is busy stays pending under us, unacked: dispatch
    # only records it (a Busy acquire leaves it exactly so)
    reclaim = Reclaim(r, WorkerSettings(worker_id="w1", reclaim_idle_ms=IDLE_MS, renew_interval_s=0.04),
                      free=lambda: 4, dispatch=lambda nid, *_: dispatched.append(nid), ack=ack)

    for _ in range(8):  # 4 slots a pass: 12 busy ones, then the starved one, by pass 4
        await asyncio.sleep(IDLE_MS / 1000 + 0.02)
        await reclaim.pass_once(shards=1)
        if starved.decode() in dispatched:
            break
    assert starved.decode() in dispatched, f"never reached; claimed {len(dispatched)} times, " \
        f"{len(set(dispatched) & {b.decode() for b in busy})} distinct busy ones"
    await r.aclose()
