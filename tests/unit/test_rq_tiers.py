"""An rq tier's inputs to ``decide``, as tables: RQ's registry and queues in, the same pure
``decide`` out; and the refusal of an rq tier with no RQ Redis."""

from __future__ import annotations

import time
from typing import Any

import fakeredis
import pytest

from commander.decide import TierState, decide
from commander.leadership import Leadership
from commander.ledger_writer import LedgerWriter
from commander.rq.inputs import RqRates, RqTierRead, RqWorkerSeen, decide_policy, rq_snapshot, rq_views
from commander.rq.reader import NO_RQ_ON_CLUSTER, RqReader
from commander.rq.tiers import RqTiers
from commander.runtime import Lifecycle, WorkerHandle
from commander.settings import CommanderSettings
from protocol.policy import PolicyError, RqPolicy, parse_policy, rq_policy
from tests.unit.commander_helpers import ledger

NOW = 1_700_000_000.0
TIER = "writeback"


def policy(**over: Any) -> RqPolicy:
    base: dict[str, Any] = dict(min_workers=0, max_workers=4, target_backlog_per_worker=4,
                                scale_down_stabilization_s=0.0, max_step_up=4)
    return rq_policy(**{**base, **over})


def handle(i: int, state: Lifecycle = Lifecycle.RUNNING, tier: str = TIER) -> WorkerHandle:
    return WorkerHandle(f"rq-{i}", tier, 100 + i, state, NOW - 100 + i)


def judge(handles: list[WorkerHandle], seen: list[RqWorkerSeen], queued: int, p: RqPolicy | None = None,
          state: TierState | None = None) -> Any:
    p = p or policy(max_workers=8)
    views = rq_views(TIER, handles, seen)
    snap = rq_snapshot(TIER, views, RqTierRead(queued=queued, workers=tuple(seen)), 0.0)
    return decide(snap, decide_policy(p), state or TierState(), NOW)[0]


def test_views_follow_rqs_registry() -> None:
    handles = [handle(0), handle(1), handle(2), handle(3, Lifecycle.DRAINING),
               handle(4, Lifecycle.EXITED), handle(5, tier="other")]
    seen = [RqWorkerSeen("rq-0", "busy", "j"), RqWorkerSeen("rq-1", "idle"), RqWorkerSeen("rq-3", "busy")]
    views = {v.id: v for v in rq_views(TIER, handles, seen)}
    assert set(views) == {"rq-0", "rq-1", "rq-2", "rq-3"}  # exited and other tiers' left out
    assert (views["rq-0"].state, views["rq-0"].busy, views["rq-0"].idle) == ("ready", 1, False)
    assert (views["rq-1"].state, views["rq-1"].idle) == ("ready", True)
    assert views["rq-2"].state == "starting"  # spawned, not in RQ's registry yet
    assert views["rq-3"].state == "draining"  # warm shutdown under way
    assert views["rq-0"].is_reception and not views["rq-1"].is_reception


@pytest.mark.parametrize(("queued", "running", "busy", "spawn", "retire"), [
    (0, 0, 0, 0, 0),  # nothing queued, no worker: stays at zero
    (1, 0, 0, 1, 0),  # a job arriving at an empty tier starts a worker
    (10, 0, 0, 4, 0),  # a burst: up to max_step_up at once
    (10, 2, 2, 4, 0),  # busy workers and a queue: max_step_up more
    # the queue drained: idle ones go, down to what the capacity ledger keeps around a running
    # job (its compaction margin: 3 workers for one busy one), never the busy one
    (0, 4, 1, 0, 1),
    (0, 3, 1, 0, 0),
    (0, 2, 0, 0, 1),  # all idle: back to zero, the reception last (the next pass)
    (0, 1, 0, 0, 1),
])
def test_queue_depth_drives_the_count(queued: int, running: int, busy: int, spawn: int, retire: int) -> None:
    handles = [handle(i) for i in range(running)]
    seen = [RqWorkerSeen(f"rq-{i}", "busy" if i < busy else "idle") for i in range(running)]
    plan = judge(handles, seen, queued)
    assert (plan.spawn, len(plan.retire)) == (spawn, retire), plan.reason
    busy_ids = {f"rq-{i}" for i in range(busy)}
    assert not {r.worker for r in plan.retire} & busy_ids  # never from under a job
    assert all(r.action == "reclaim-idle" for r in plan.retire)


@pytest.mark.parametrize("since_step", [1.0, 30.0], ids=["within-a-burst", "later"])
def test_one_job_on_its_one_worker_asks_for_no_more(since_step: float) -> None:
    """The job that started the tier runs on its worker, nothing is queued: the busy worker
    admits no more (one job per worker), which is no trouble while no job waits. Seen: one
    re-queued job scaled a tier 0 -> 1 -> 3, the busy worker asking for one more and the
    burst rule doubling it."""
    state = TierState(steps=((NOW - since_step, 1),))
    plan = judge([handle(0)], [RqWorkerSeen("rq-0", "busy", "j")], queued=0, state=state)
    assert (plan.spawn, len(plan.retire)) == (0, 0), plan.reason


def test_the_floor_keeps_warm_workers() -> None:
    plan = judge([handle(0), handle(1)], [RqWorkerSeen("rq-0", "idle"), RqWorkerSeen("rq-1", "idle")], 0,
                 policy(min_workers=1))
    assert len(plan.retire) == 1


def test_rates_from_registry_counts() -> None:
    rates = RqRates()
    assert rates.add(0.0, 10) == 0.0  # one point: no rate
    assert rates.add(2.0, 30) == 10.0
    assert rates.add(4.0, 5) == 0.0  # the registries were cleaned: no rate, not a negative one
    late = RqRates()
    for t in range(0, 200, 10):
        late.add(float(t), t)  # one job a second, over a window of the last minute
    assert late.add(200.0, 200) == pytest.approx(1.0)
    assert late.points[0][0] >= 200.0 - 70


def test_rq_policy_fields_are_validated() -> None:
    p = parse_policy({"kind": "rq", "queues": ["writeback", "eval"], "min_workers": 0})
    assert isinstance(p, RqPolicy) and p.rq_queues(TIER) == ("writeback", "eval")
    assert RqPolicy().rq_queues(TIER) == (TIER,)
    assert decide_policy(p).concurrency == 1 and "concurrency" not in RqPolicy.model_fields
    for bad in ({"kind": "celery"}, {"kind": "rq", "queues": ["Bad Queue"]},
                {"kind": "rq", "queues": ["a", "a"]}):
        with pytest.raises(PolicyError):
            parse_policy(bad)


def test_an_rq_tier_without_an_rq_redis_is_refused_once_in_the_ledger() -> None:
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    leadership = Leadership(r, "c1")
    assert leadership.campaign()
    tiers = RqTiers(RqReader(None), LedgerWriter(leadership, time.time))  # a Cluster, no rq_url
    for _ in range(3):  # every pass refuses it; the ledger says so once
        assert tiers.refused(TIER) == NO_RQ_ON_CLUSTER
    assert [(e.tier, e.action) for e in ledger(r)] == [(TIER, "refused")]
    assert "--rq-url or $FLEET_RQ_URL" in ledger(r)[0].reason
    with pytest.raises(RuntimeError, match="needs one node"):
        tiers.reader.r  # noqa: B018 - nothing reads RQ through a missing client
    assert RqTiers(RqReader(r), LedgerWriter(leadership, time.time)).refused(TIER) is None


def test_the_commanders_rq_url_comes_from_fleet_rq_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEET_COMMANDER_RQ_URL", raising=False)
    monkeypatch.setenv("FLEET_RQ_URL", "redis://rq:1/0")
    assert CommanderSettings().rq_url == "redis://rq:1/0"
    assert CommanderSettings(rq_url="redis://other:2/0").rq_url == "redis://other:2/0"  # the flag wins
    monkeypatch.delenv("FLEET_RQ_URL")
    assert CommanderSettings().rq_url is None
