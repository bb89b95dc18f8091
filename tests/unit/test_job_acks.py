"""The ack rule of a job whose user's lane is busy (DESIGN §3; issue 8, hole 1).

Found by scripts/explore (seed 9260 of ``--faults 6 --users 3 --turns 4 --workers 2``): a job
whose acquire found the lane busy acked every notification attached to it, including ones
another worker had reclaimed in the meantime and ones attached while the acquire was in
flight, so a turn could wait with no lane and no pending notification.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import fakeredis

from protocol import keys
from stores.scripts import Scripts
from stores.turns import Busy
from worker.job import UserJob


@dataclass
class Host:
    """The part of a Worker a job touches on the busy path."""

    job: UserJob | None = None
    acked: list[list[str]] = field(default_factory=list)
    asked: int = 0
    done: int = 0

    @property
    def store(self) -> Host:
        return self

    async def acquire(self, user: str, batch: int) -> Busy:
        self.asked += 1
        await asyncio.sleep(0)
        if self.asked == 1 and self.job is not None:  # a new notification is dispatched meanwhile
            self.job.attach("n2", reclaimed=False)
        return Busy("w2|7", 5000)

    async def ack(self, nids: list[str]) -> None:
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
    scripts = Scripts(r)
    acked = await scripts.notification_ack(keys=[ready], args=[keys.GROUP, "w1", mine, stolen, "0-1"])
    assert acked == 1
    pending = await r.xpending_range(ready, keys.GROUP, "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [(stolen, "w2")]
    await r.aclose()
