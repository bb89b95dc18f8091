"""The ack rule of a job whose user's lane is busy, and of a renewal.

A notification is acked only when its acker has seen, under the user's lane, nothing left after
the cursor, or when another pending notification for the user still carries that duty.

Found by scripts/explore (seed 9260 of ``--faults 6 --users 3 --turns 4 --workers 2``): a job
whose acquire found the lane busy acked every notification attached to it, including ones
another worker had reclaimed in the meantime and ones attached while the acquire was in
flight, so a turn could wait with no lane and no pending notification.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import fakeredis

from protocol import keys
from stores.functions import Functions
from stores.redis_errors import RedisErrors
from stores.turns import Busy, Lease
from worker.app import Worker
from worker.job import UserJob
from worker.renewal import Heartbeat, Renewal
from worker.settings import WorkerSettings


@dataclass
class Host:
    """The part of a job's host (``worker.job.JobHost``) a job touches on the busy path."""

    settings: WorkerSettings = field(default_factory=lambda: WorkerSettings(worker_id="w1"))
    redis_errors: RedisErrors = field(default_factory=lambda: RedisErrors(logging.getLogger("test")))
    job: UserJob | None = None
    acked: list[list[str]] = field(default_factory=list)
    asked: int = 0
    done: int = 0

    @property
    def store(self) -> Host:
        return self

    async def acquire(self, user: str) -> Busy:
        self.asked += 1
        await asyncio.sleep(0)
        if self.asked == 1 and self.job is not None:  # a new notification is dispatched meanwhile
            self.job.attach("n2", reclaimed=False)
        return Busy("w2|7", 5000)

    async def ack(self, nids: list[str]) -> None:
        self.acked.append(list(nids))

    async def ack_covered(self, holder: str, user: str, nids: list[str]) -> None:
        assert holder == "w2|7" and user == "alice"
        self.acked.append(list(nids))

    def job_done(self, job: UserJob) -> None:
        self.done += 1


async def test_a_notification_attached_during_a_busy_acquire_is_not_acked_with_it() -> None:
    host = Host()
    job = UserJob(host, "alice")  # type: ignore[arg-type]
    host.job = job
    job.attach("n1", reclaimed=False)
    await job.run()
    assert host.acked == [["n1"], ["n2"]]  # n2 only after asking again
    assert host.asked == 2


async def test_a_reclaimed_notification_on_a_busy_lane_stays_pending() -> None:
    host = Host()
    job = UserJob(host, "alice")  # type: ignore[arg-type]
    job.attach("n1", reclaimed=True)  # may be a dead holder's own: it keeps the duty
    host.asked = 1  # no new notification this time
    await job.run()
    assert host.acked == [[]]


async def test_a_worker_acks_only_notifications_still_pending_under_itself() -> None:
    r = fakeredis.FakeAsyncRedis()
    ready = keys.ready("chat")
    await r.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    mine = (await r.xadd(ready, {"user": "alice"})).decode()
    stolen = (await r.xadd(ready, {"user": "bob"})).decode()
    await r.xreadgroup(keys.GROUP, "w1", {ready: ">"})
    await r.xclaim(ready, keys.GROUP, "w2", 0, [stolen])  # w2 reclaimed it: its duty now
    scripts = Functions(r)
    acked = await scripts.notification_ack(keys=[ready], args=[keys.GROUP, "w1", mine, stolen, "0-1"])
    assert acked == 1
    pending = await r.xpending_range(ready, keys.GROUP, "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [(stolen, "w2")]
    await r.aclose()


@dataclass
class Held:
    """A job holding a lane, as its renewal sees one (``worker.renewal.Renewable``)."""

    lease: Lease | None
    nids: list[str]
    renewed: list[float] = field(default_factory=list)
    failed: int = 0

    def renewed_at(self, lease: Lease, sent: float) -> None:
        self.renewed.append(sent)

    def renew_failed(self) -> None:
        self.failed += 1


async def _renewal(lane_holder: str) -> tuple[fakeredis.FakeAsyncRedis, Renewal, Held, str, str]:
    """Worker w1's renewal of a job for alice (its lease ``w1|1``), alice's lane held by
    ``lane_holder``, and two notifications w1 was delivered: ``kept`` still pending under w1,
    ``reclaimed`` since taken over by w2 (XAUTOCLAIM)."""
    r = fakeredis.FakeAsyncRedis()
    ready = keys.ready("chat")
    await r.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    kept = (await r.xadd(ready, {"user": "alice"})).decode()
    reclaimed = (await r.xadd(ready, {"user": "alice"})).decode()
    await r.xreadgroup(keys.GROUP, "w1", {ready: ">"})
    await r.xclaim(ready, keys.GROUP, "w2", 0, [reclaimed])
    await r.set(keys.lane("alice"), lane_holder, px=5000)
    settings = WorkerSettings(worker_id="w1", tier="chat")
    held = Held(Lease("alice", "w1|1", cursor=""), [kept, reclaimed])
    worker = Worker(settings, r=r)
    renewal = Renewal(r, settings, worker.store, [held], Heartbeat(), asyncio.Event(), worker.redis_errors)
    return r, renewal, held, kept, reclaimed


async def _owners(r: fakeredis.FakeAsyncRedis) -> dict[str, str]:
    pending = await r.xpending_range(keys.ready("chat"), keys.GROUP, "-", "+", 10)
    return {p["message_id"].decode(): p["consumer"].decode() for p in pending}


async def test_a_renewal_never_takes_back_a_notification_another_worker_reclaimed() -> None:
    """Found by scripts/explore --seed 20221: a worker paused past its lease came back, its
    renewal XCLAIMed (min-idle 0) the notifications that the lane's new holder had reclaimed,
    and its busy acquire then acked them as its own: a turn waited with nobody to serve it."""
    r, renewal, held, kept, reclaimed = await _renewal("w1|1")  # our lane, renewed fine
    await renewal.renew_once()
    assert len(held.renewed) == 1 and held.failed == 0
    assert await _owners(r) == {kept: "w1", reclaimed: "w2"}
    await r.aclose()


async def test_a_renewal_that_finds_the_lane_lost_touches_none_of_its_notifications() -> None:
    r, renewal, held, kept, reclaimed = await _renewal("w2|9")  # w2 holds alice's lane now
    idle_before = {p["message_id"].decode(): p["time_since_delivered"] for p in
                   await r.xpending_range(keys.ready("chat"), keys.GROUP, "-", "+", 10)}
    await asyncio.sleep(0.05)  # the notifications age: what is checked is that the renewal keeps them aging
    await renewal.renew_once()
    assert held.failed == 1 and not held.renewed
    assert await _owners(r) == {kept: "w1", reclaimed: "w2"}
    idle = {p["message_id"].decode(): p["time_since_delivered"] for p in
            await r.xpending_range(keys.ready("chat"), keys.GROUP, "-", "+", 10)}
    assert idle[kept] >= idle_before[kept] + 40  # not reset: it ages and is reclaimed in time
    await r.aclose()


async def test_a_busy_acquire_keeps_its_notifications_when_the_holder_carries_none() -> None:
    """Found by scripts/explore --seed 1013: a takeover acked a live worker's notifications and
    deleted its consumer; the worker took the lane again, so the takeover's fresh notification
    met a busy lane and was acked by the worker that read it. The holder's job then failed, and
    nothing pending brought the user back. A busy-path ack now needs the holder's carrier."""
    r = fakeredis.FakeAsyncRedis()
    ready = keys.ready("chat")
    await r.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    fresh = (await r.xadd(ready, {"user": "alice"})).decode()  # the takeover's hand-on
    await r.xreadgroup(keys.GROUP, "w1", {ready: ">"})
    scripts = Functions(r)
    args = [keys.GROUP, "w1", "w0", "alice", fresh]
    assert await scripts.notification_ack_covered(keys=[ready], args=args) == -1  # w0 carries none
    pending = await r.xpending_range(ready, keys.GROUP, "-", "+", 9)
    assert [p["message_id"].decode() for p in pending] == [fresh]
    other = (await r.xadd(ready, {"user": "bob"})).decode()
    await r.xreadgroup(keys.GROUP, "w0", {ready: ">"})  # w0's pending entry is for bob: not alice's
    assert await scripts.notification_ack_covered(keys=[ready], args=args) == -1
    carrier = (await r.xadd(ready, {"user": "alice"})).decode()
    await r.xreadgroup(keys.GROUP, "w0", {ready: ">"})  # now w0 has one for alice: it carries
    assert await scripts.notification_ack_covered(keys=[ready], args=args) == 1
    pending = {p["message_id"].decode() for p in await r.xpending_range(ready, keys.GROUP, "-", "+", 9)}
    assert pending == {other, carrier}
    await r.aclose()
