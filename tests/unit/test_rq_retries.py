"""Retries per rq tier (issue 16): an rq tier's policy may set ``retry_max`` (and
``retry_interval_s``) for the jobs of its queues, overriding their registration's; validated
with the policy; the relay writes them into the job RQ retries by."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest

from fleet.relay import Relay, RelaySettings, retry_overrides, with_retries
from protocol import keys
from protocol.codec import encode
from protocol.deferral import Deferral
from protocol.policy import Policy, PolicyError, parse_policy
from stores import outbox, rqjobs
from stores.policies import write_policy
from stores.turns import Lease, UserStore, Writes
from worker import rq_worker

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
    assert (p.retry_max, p.retry_interval_s) == retries


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
])
def test_rq_retry_fields_rejected(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(PolicyError, match=error):
        parse_policy(fields)


@pytest.mark.parametrize(("policies", "want"), [
    ({}, {}),
    ({"chat": Policy(), "writeback": Policy(kind="rq")}, {}),  # no retry_max: the registration's
    ({"writeback": Policy(kind="rq", retry_max=4)}, {"writeback": (4, None)}),
    ({"jobs": Policy(kind="rq", queues=("a", "b"), retry_max=1, retry_interval_s=(2,))},
     {"a": (1, (2,)), "b": (1, (2,))}),
    ({"x": Policy(kind="rq", queues=("a",), retry_max=1),
      "y": Policy(kind="rq", queues=("a", "c"), retry_max=2)},
     {"a": (1, None), "c": (2, None)}),  # a queue in two tiers: the first tier's, by name
])
def test_each_queue_takes_its_rq_tiers_retries(policies: dict[str, Policy], want: dict[str, Any]) -> None:
    assert retry_overrides(policies) == want


def _d(**kw: Any) -> Deferral:
    return Deferral(name="fail_first", queue=Q, user="alice", turn_id="t1", index=0, ts=1.0, **kw)


@pytest.mark.parametrize(("overrides", "retries"), [
    ({}, (1, [7])),  # no tier sets them: the registration's
    ({"other": (5, None)}, (1, [7])),
    ({Q: (5, None)}, (5, [7])),  # the tier's count, the registration's intervals
    ({Q: (0, ())}, (0, [])),
    ({Q: (3, (1, 2))}, (3, [1, 2])),
])
def test_a_deferral_gets_its_queues_retries(overrides: dict[str, Any],
                                            retries: tuple[int, list[int]]) -> None:
    d = with_retries(_d(retry_max=1, retry_interval_s=[7]), overrides)
    assert (d.retry_max, d.retry_interval_s) == retries and d.job_id == _d().job_id


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
    write_policy(r, Q, Policy(kind="rq", retry_max=3))
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
