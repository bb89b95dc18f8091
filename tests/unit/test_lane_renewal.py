"""A worker renews its lanes on time whatever its last renewal met (explorer seed 28924).

Found by scripts/explore (a long run; its shrunk schedule is tests/unit/schedules/zombie-28924.json):
a worker's renewal pass began in a 17 s Redis outage and sat in the client's own reconnect
retries (their jittered waits grow to 2 s); Redis came back, the worker's reclaim took three
lanes at once, and one of them was expired 0.1 s later. The pass still waiting in its retry
returned a second after Redis was back, the loop then slept its interval, and the first
renewal of the new lanes, the one that says a lane is lost, went out 1.46 s after they were
taken: the handler ran on 1.36 s past its lane's end (the zombie bound is two renew
intervals). A lane taken after a pass began waited for that pass, however long it took.
"""

from __future__ import annotations

import asyncio
import time

import fakeredis
import pytest

from protocol import keys
from protocol.models import HandlerResult
from stores import worker_ops
from stores.turns import Lease
from worker import handlers
from worker.app import Worker
from worker.settings import WorkerSettings

INTERVAL_S = 0.05


async def test_a_renewal_pass_stuck_in_the_clients_retries_does_not_hold_up_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    r = fakeredis.FakeAsyncRedis()
    worker = Worker(WorkerSettings(worker_id="w1", tier="chat", renew_interval_s=INTERVAL_S), r=r)
    beats = 0

    async def touch_and_beat(*args: object, **kwargs: object) -> None:
        nonlocal beats
        beats += 1
        if beats == 1:  # begun while Redis was away: the client retries, its waits growing
            await asyncio.sleep(30)

    renewed: list[tuple[float, list[str]]] = []
    real_renew = worker.store.renew

    async def renew(leases: list[Lease]) -> list[bool]:
        renewed.append((time.monotonic(), [lease.owner for lease in leases]))
        return await real_renew(leases)

    taken: list[tuple[float, str]] = []  # (when the handler started under a lane, that lane)
    finish = asyncio.Event()

    async def holds_the_lane(ctx: handlers.TurnContext) -> HandlerResult:
        taken.append((time.monotonic(), ctx.lease))
        await finish.wait()
        return HandlerResult(text="done")

    monkeypatch.setattr(worker_ops, "touch_and_beat", touch_and_beat)
    monkeypatch.setattr(worker.store, "renew", renew)
    worker.tier_policy.handler = holds_the_lane
    await r.xadd(keys.inbox("alice"), {"text": "hi", "turn_id": "t1", "tier": "chat"})
    run = asyncio.ensure_future(worker.run())
    try:
        async with asyncio.timeout(10):
            while beats == 0:  # the first pass is stuck
                await asyncio.sleep(0.01)
            worker.dispatch("1-0", {b"user": b"alice"}, reclaimed=False)  # Redis is back: a lane is taken
            while not taken:
                await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # twenty renew intervals
        at, lease = taken[0]
        first = next((when for when, owners in renewed if lease in owners), None)
        assert first is not None, "the lane was never renewed: the loop waited for its stuck pass"
        assert first - at < 0.5  # on time (ten intervals of slack for a loaded machine)
    finally:
        finish.set()
        worker.drain("test")
        await asyncio.wait({run}, timeout=10)
        await r.aclose()
    assert run.done() and run.result() == 0


async def test_a_lane_not_renewed_within_its_ttl_stops_its_turn_whatever_the_renew_loop_does() -> None:
    """Explorer seed 20217: the worker's own guard, "a lane not renewed within its TTL is lost",
    must not wait for a renewal pass: one that does not come (stuck, or sleeping a failure
    backoff) would let the handler run on past the lease's end, beside whoever took the user
    over. Each lane has its own deadline, one TTL after the renewal was sent."""
    r = fakeredis.FakeAsyncRedis()
    ttl_s = 0.5
    worker = Worker(WorkerSettings(worker_id="w1", tier="chat", lane_ttl_ms=int(ttl_s * 1000),
                                   renew_interval_s=0.2), r=r)
    runs: list[list[float]] = []

    async def hangs(ctx: handlers.TurnContext) -> HandlerResult:
        runs.append([time.monotonic()])
        try:
            await asyncio.sleep(30)
        finally:
            runs[-1].append(time.monotonic())
        return HandlerResult(text="late")

    worker.tier_policy.handler = hangs
    await r.xadd(keys.inbox("alice"), {"text": "hi", "turn_id": "t1", "tier": "chat"})
    worker.dispatch("1-0", {b"user": b"alice"}, reclaimed=False)  # no renew loop runs at all
    try:
        async with asyncio.timeout(5):
            while not runs or len(runs[0]) < 2:
                await asyncio.sleep(0.01)
        entered, stopped = runs[0]
        assert stopped - entered < ttl_s + 0.5  # (slack for a loaded machine; unstopped: 30 s)
    except TimeoutError:
        assert runs, "the handler never ran"
        pytest.fail("the handler ran on past its lane's TTL: nothing but a renewal pass stops it")
    finally:
        tasks = list(worker.jobs.tasks)  # the job, serving the turn again
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await r.aclose()


async def test_a_renewal_during_a_commit_that_released_the_lane_does_not_stop_the_job(
        caplog: pytest.LogCaptureFixture) -> None:
    """The commit releases the lane in the same script, and with ``replica_acks`` its
    reply waits for the WAIT after it (up to the policy's timeout). A renewal pass in that window
    found the lane gone and cancelled the job as "lost mid-turn": the turn was answered, but its
    commit's WAIT was never counted, the job took the lane again for nothing and the log said a
    lane expired (CI, tests/cluster/test_replica_wait_cluster.py, a replica stopped). A commit in
    flight is the lane's last word: a renewal that fails meanwhile is judged after it."""
    r = fakeredis.FakeAsyncRedis()
    worker = Worker(WorkerSettings(worker_id="w1", tier="chat", renew_interval_s=INTERVAL_S), r=r)
    real_commit = worker.store.commit
    commits: list[bool] = []

    async def commit_then_wait(*args: object, **kwargs: object) -> object:
        done = await real_commit(*args, **kwargs)  # type: ignore[arg-type]
        await asyncio.sleep(INTERVAL_S * 6)  # the WAIT after it, timing out (several renew passes)
        commits.append(done.released)
        return done

    worker.store.commit = commit_then_wait  # type: ignore[method-assign]
    await r.xadd(keys.inbox("alice"), {"text": "hi", "turn_id": "t1", "tier": "chat"})
    run = asyncio.ensure_future(worker.run())
    try:
        async with asyncio.timeout(10):
            while worker.state != "ready":
                await asyncio.sleep(0.01)
            worker.dispatch("1-0", {b"user": b"alice"}, reclaimed=False)
            while not commits or worker.jobs:
                await asyncio.sleep(0.01)
    finally:
        worker.drain("test")
        await asyncio.wait({run}, timeout=10)
        await r.aclose()
    assert commits == [True]  # one commit, which released the lane, and whose WAIT ended
    assert worker.tally.fenced == 0
    assert not [rec for rec in caplog.records if "lane of alice" in rec.getMessage()]


async def test_a_lane_deadline_during_a_commit_in_flight_leaves_the_answer_to_the_commit() -> None:
    """Explorer seed 305169: a commit waited in the batch while Redis was away, and the lane's
    local deadline (one TTL after the acquire was *sent*) passed meanwhile. It cancelled the job,
    but not the batch's round trip, which landed later. The job took its own lane again (same
    token: the lane was still there) and ran the turn's handler a second time, the model call
    made twice and overlapping the next owner's run until its renewal failed. A commit in flight
    is the lane's last word: a deadline passed meanwhile is judged after it. The lane kept (a
    turn waits), the job takes the lane again and serves on from Redis's cursor."""
    r = fakeredis.FakeAsyncRedis()
    ttl_s = 0.5
    worker = Worker(WorkerSettings(worker_id="w1", tier="chat", lane_ttl_ms=int(ttl_s * 1000),
                                   renew_interval_s=0.2), r=r)
    real_acquire, real_commit = worker.store.acquire, worker.store.commit
    acquires = 0

    async def acquire_sent_early(user: str) -> object:
        """The first acquire reaches Redis 0.3 s after it was sent: the local deadline is
        0.3 s ahead of the lane's expiry in Redis."""
        nonlocal acquires
        acquires += 1
        if acquires == 1:
            await asyncio.sleep(0.3)
        return await real_acquire(user)

    async def commit_in_the_batch(*args: object, **kwargs: object) -> object:
        """The commit lands 0.3 s after it was asked for, past the local deadline, and a
        cancelled caller does not stop it (the batch's round trip goes on)."""
        async def late() -> object:
            await asyncio.sleep(0.3)
            return await real_commit(*args, **kwargs)  # type: ignore[arg-type]
        return await asyncio.shield(asyncio.ensure_future(late()))

    runs: list[str] = []

    async def quick(ctx: handlers.TurnContext) -> HandlerResult:
        runs.append(ctx.turn.turn_id)
        return HandlerResult(text=f"re: {ctx.turn.text}")

    worker.store.acquire = acquire_sent_early  # type: ignore[method-assign,assignment]
    worker.store.commit = commit_in_the_batch  # type: ignore[method-assign,assignment]
    worker.tier_policy.handler = quick
    await r.xgroup_create(keys.ready("chat"), keys.GROUP, mkstream=True)  # (the acks' stream)
    for i in (1, 2):
        await r.xadd(keys.inbox("alice"), {"text": f"turn {i}", "turn_id": f"t{i}", "tier": "chat"})
    worker.dispatch("1-0", {b"user": b"alice"}, reclaimed=False)  # no renew loop runs at all
    try:
        async with asyncio.timeout(10):
            while worker.jobs.tasks or await r.exists(keys.lane("alice")):
                await asyncio.sleep(0.01)
    finally:
        for task in list(worker.jobs.tasks):
            task.cancel()
        await asyncio.sleep(0.5)  # (a stray commit still in the batch lands)
        replies = {t: await r.llen(keys.reply("alice", t)) for t in ("t1", "t2")}
        await r.aclose()
    assert runs == ["t1", "t2"], "a turn's handler ran again while its first run's commit was in flight"
    assert replies == {"t1": 1, "t2": 1}
