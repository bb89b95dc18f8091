"""The delivery limit of a job's notifications: one at its last delivery whose serving fails for
its user's data is dead-lettered and acked; Redis away never costs a notification."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from protocol.policy import TurnsPolicy
from stores.redis_errors import RedisErrors
from worker.job import UserJob
from worker.settings import WorkerSettings


@dataclass
class Host:
    """The part of a job's host (``worker.job.JobHost``) a failing job touches."""

    error: Exception
    settings: WorkerSettings = field(default_factory=lambda: WorkerSettings(worker_id="w1"))
    policy: TurnsPolicy = field(default_factory=lambda: TurnsPolicy(max_deliveries=3))
    redis_errors: RedisErrors = field(default_factory=lambda: RedisErrors(logging.getLogger("test")))
    given_up: list[dict[str, int]] = field(default_factory=list)

    @property
    def store(self) -> Host:
        return self

    async def acquire(self, user: str) -> None:
        raise self.error

    async def give_up(self, user: str, deliveries: dict[str, int], error: str) -> None:
        assert user == "mallory" and str(self.error) in error
        self.given_up.append(deliveries)

    def job_done(self, job: UserJob) -> None:
        pass


WRONGTYPE = ResponseError("WRONGTYPE fleet:u:{mallory}:inbox holds a string, not a stream")


@pytest.mark.parametrize(("error", "deliveries", "given_up"), [
    (WRONGTYPE, {"n1": 2}, []),  # below the limit: pending, for a retry
    (WRONGTYPE, {"n1": 3, "n2": 1}, [{"n1": 3}]),  # only the one at its last delivery
    (RuntimeError("a bug"), {"n1": 4}, [{"n1": 4}]),
    (RedisConnectionError("Redis away"), {"n1": 9}, []),  # Redis away: it waits for Redis
    (ResponseError("LOADING Redis is loading the dataset in memory"), {"n1": 9}, []),
], ids=["below", "at-limit", "bug", "connection", "loading"])
async def test_a_notification_at_its_last_delivery_is_given_up_only_for_a_lasting_failure(
        error: Exception, deliveries: dict[str, int], given_up: list[dict[str, int]]) -> None:
    host = Host(error)
    job = UserJob(host, "mallory")  # type: ignore[arg-type]
    for i, (nid, n) in enumerate(deliveries.items()):
        job.attach(nid, reclaimed=i > 0 or n > 1, deliveries=n)
    await job.run()  # never raises
    assert host.given_up == given_up
