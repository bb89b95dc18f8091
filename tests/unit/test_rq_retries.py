"""Retries per rq tier: an rq tier's policy may set ``retry_max`` (and
``retry_interval_s``) for the jobs of its queues, overriding their registration's; validated
with the policy; the relay writes them into the job RQ retries by."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest

from protocol import keys
from protocol.codec import encode
from protocol.deferral import Deferral
from protocol.policy import Policy, PolicyError, RqPolicy, TurnsPolicy, parse_policy, rq_policy
from stores import outbox, rqjobs
from stores.policies import write_policy
from stores.turns import Lease, UserStore, Writes
from worker.rq import rq_worker
from worker.rq.relay import Relay, RelaySettings, TierJobs, tier_overrides, with_tier

Q = "writeback"
RQ = {"kind": "rq"}


@pytest.mark.parametrize(("fields", "retries"), [
    ({**RQ}, (None, None)),
    ({**RQ, "retry_max": 0}, (0, None)),  # never retried, whatever the registration says
    ({**RQ, "retry_max": 3, "retry_interval_s": [1, 5, 30]}, (3, (1, 5, 30))),
    ({**RQ, "retry_max": 100, "retry_interval_s": [86_400]}, (100, (86_400,))),
    ({**RQ, "retry_max": 2, "retry_interval_s": []}, (2, ())),
])
def test_rq_retry_fields_accepted(fields: dict[str, Any], retries: tuple[Any, Any]) -> None:
    p = parse_policy(fields)
    assert isinstance(p, RqPolicy) and (p.jobs.retry_max, p.jobs.retry_interval_s) == retries


@pytest.mark.parametrize(("fields", "error"), [
    ({"retry_max": 3}, "apply only to an rq tier"),
    ({"retry_interval_s": [1]}, "apply only to an rq tier"),
    ({**RQ, "retry_interval_s": [1]}, "retry_interval_s needs retry_max"),
    ({**RQ, "retry_max": -1}, "retry_max"),
    ({**RQ, "retry_max": 101}, "retry_max"),
    ({**RQ, "retry_max": 1, "retry_interval_s": [-1]}, "retry_interval_s"),
    ({**RQ, "retry_max": 1, "retry_interval_s": [86_401]}, "not a retry interval"),
    ({**RQ, "retry_max": 1, "retry_interval_s": [1] * 101}, "retry_interval_s"),
    ({**RQ, "retry_max": "many"}, "retry_max"),
    ({"job_timeout_s": 10}, "job_timeout_s applies only to an rq tier"),
    ({**RQ, "job_timeout_s": 0}, "jobs.timeout_s"),
    ({**RQ, "job_timeout_s": 31}, "jobs.timeout_s 31 is over controls.drain_timeout_s 30"),
    ({**RQ, "job_timeout_s": 120, "drain_timeout_s": 60}, "a retired RQ worker must be able to finish"),
])
def test_rq_retry_fields_rejected(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(PolicyError, match=error):
        parse_policy(fields)


@pytest.mark.parametrize(("policies", "want"), [
    ({}, {}),
    ({"chat": TurnsPolicy(), "writeback": RqPolicy()}, {}),  # no retry_max: the registration's
    ({"writeback": rq_policy(retry_max=4)}, {"writeback": (4, None, None)}),
    ({"jobs": rq_policy(queues=("a", "b"), retry_max=1, retry_interval_s=(2,))},
     {"a": (1, (2,), None), "b": (1, (2,), None)}),
    ({"x": rq_policy(queues=("a",), retry_max=1),
      "y": rq_policy(queues=("a", "c"), retry_max=2)},
     {"a": (1, None, None), "c": (2, None, None)}),  # a queue in two tiers: the first tier's, by name
    ({"writeback": rq_policy(job_timeout_s=20)}, {"writeback": (None, None, 20)}),
    ({"writeback": rq_policy(retry_max=2, job_timeout_s=20, drain_timeout_s=20)},
     {"writeback": (2, None, 20)}),
])
def test_each_queue_takes_its_rq_tiers_job_settings(policies: dict[str, Policy],
                                                    want: dict[str, Any]) -> None:
    assert tier_overrides(policies) == want


def _d(**kw: Any) -> Deferral:
    return Deferral(**{"name": "fail_first", "queue": Q, "user": "alice", "turn_id": "t1", "index": 0,
                       "ts": 1.0, **kw})


@pytest.mark.parametrize(("overrides", "settings"), [
    ({}, (1, [7], None)),  # no tier sets them: the registration's
    ({"other": TierJobs(5, None, None)}, (1, [7], None)),
    ({Q: TierJobs(5, None, None)}, (5, [7], None)),  # the tier's count, the registration's intervals
    ({Q: TierJobs(0, (), None)}, (0, [], None)),
    ({Q: TierJobs(3, (1, 2), None)}, (3, [1, 2], None)),
    ({Q: TierJobs(None, None, 45)}, (1, [7], 45)),  # only a timeout: the registration's retries
    ({Q: TierJobs(2, None, 45)}, (2, [7], 45)),
])
def test_a_deferral_gets_its_queues_job_settings(overrides: dict[str, Any],
                                                 settings: tuple[int, list[int], int | None]) -> None:
    d = with_tier(_d(retry_max=1, retry_interval_s=[7]), overrides)
    assert (d.retry_max, d.retry_interval_s, d.job_timeout_s) == settings and d.job_id == _d().job_id


async def _commit(server: fakeredis.FakeServer, d: Deferral) -> None:
    """A turn of ``d.user`` committed with the deferral ``d``, the worker's way."""
    ar = fakeredis.FakeAsyncRedis(server=server)
    store = UserStore(ar, "w1")
    entry = (await ar.xadd(keys.inbox(d.user), {"text": "hi", "turn_id": d.turn_id, "tier": "chat"})).decode()
    await ar.zadd(keys.active("chat"), {d.user: 1.0})
    lease = await store.acquire(d.user)
    assert isinstance(lease, Lease)
    w = Writes(turn_id=d.turn_id, reply=b"r", deferrals=[(d.job_id, encode(d))])
    assert (await store.commit(lease, entry, d.turn_id, w, 1)).result == "ok"
    await ar.aclose()


def test_the_relay_enqueues_with_the_tiers_retries_and_rq_retries_by_them() -> None:
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server)
    write_policy(r, Q, rq_policy(retry_max=3))
    d = _d(kwargs={"times": 3})  # registered with no retries: without the tier's, it fails once
    asyncio.run(_commit(server, d))
    relay = Relay(RelaySettings(relay_id="r1", claim_idle_ms=0, block_ms=1, sweep_interval_s=3600), r=r)
    outbox.join_relay_group(r)  # (Relay.run does it)
    relay.step()
    job = rqjobs.queue(r, Q).fetch_job(d.job_id)
    assert job is not None and job.retries_left == 3
    rq_worker.build(r, [Q], "rq-test").work(burst=True)  # fails 3 times, retried at once each time
    assert r.hget(keys.usage("alice"), "fail_first_runs") == b"4"
    assert rqjobs.failed(r, Q) == [] and r.zcard(f"rq:finished:{Q}") == 1


def test_the_relay_gives_a_job_its_tiers_timeout_and_rq_stops_it_there() -> None:
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server)
    write_policy(r, Q, rq_policy(job_timeout_s=1))
    d = Deferral(name="count", kwargs={"sleep_s": 5}, queue=Q, user="alice", turn_id="t1", index=0, ts=1.0)
    asyncio.run(_commit(server, d))
    relay = Relay(RelaySettings(relay_id="r1", claim_idle_ms=0, block_ms=1, sweep_interval_s=3600), r=r)
    outbox.join_relay_group(r)
    relay.step()
    job = rqjobs.queue(r, Q).fetch_job(d.job_id)
    assert job is not None and job.timeout == 1
    rq_worker.build(r, [Q], "rq-test").work(burst=True)  # the job sleeps 5 s: stopped at 1 s
    [failed] = rqjobs.failed(r, Q)
    result = failed.latest_result()
    assert failed.id == d.job_id and result is not None and "JobTimeoutException" in (result.exc_string or "")
    assert r.hget(keys.usage("alice"), "jobs_run") is None  # its effect is written at its end: never


@pytest.mark.parametrize("delay_s", [0.0, 30.0])  # enqueued now, or scheduled
def test_an_enqueued_job_carries_the_deferrals_timeout(delay_s: float) -> None:
    r = fakeredis.FakeRedis()
    d = _d(delay_s=delay_s, job_timeout_s=7)
    assert rqjobs.enqueue(r, d)
    plain = _d(turn_id="t2", delay_s=delay_s)
    assert rqjobs.enqueue(r, plain)
    timed, untimed = (rqjobs.queue(r, Q).fetch_job(j) for j in (d.job_id, plain.job_id))
    assert timed is not None and timed.timeout == 7
    assert untimed is not None and untimed.timeout == 180  # RQ's default
