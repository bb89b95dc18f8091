"""``fleet top`` and the monitor's ``/api/rq`` list an rq tier's RQ workers (busy or idle, the
job in hand, age) and its queue signals, from the view ``fleet status`` shows: a real
RQ worker in a job and queued jobs behind it, on a real redis-server."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer

from commander.metrics import Metrics
from commander.monitor.api import Monitor
from commander.monitor.server import build_app
from fleet.status import snapshot
from protocol.deferral import Deferral
from protocol.policy import RqPolicy
from stores import rqjobs
from stores.policies import write_policy
from tests.helpers import fleet_cli, wait_until
from tests.integration.commander_rig import Rig
from tests.integration.test_defer_rq import Proc, rq_worker, start_proc  # noqa: F401  (a fixture)

pytestmark = pytest.mark.integration
QUEUE = "writeback"
NAME = "writeback-0000aaaa"


@pytest.fixture
def busy_tier(r: redis.Redis, start_proc: Callable[..., Proc]) -> str:  # noqa: F811
    """An rq tier whose one RQ worker is in a 30 s job, two more jobs queued behind it."""
    write_policy(r, QUEUE, RqPolicy(min_workers=0, max_workers=1))
    for i in range(3):
        rqjobs.enqueue(r, Deferral(name="count", kwargs={"sleep_s": 30}, queue=QUEUE, user="u1",
                                   turn_id=f"t{i}", index=0, ts=time.time()))
    rq_worker(start_proc, r, NAME)
    busy = lambda: [w.job for w in rqjobs.workers(r, QUEUE) if w.state == "busy" and w.job]  # noqa: E731
    (job,) = wait_until(busy, 20, "the RQ worker to take a job")  # type: ignore[misc]
    return str(job)


def test_status_and_top_list_the_rq_workers_and_the_queue(r: redis.Redis, fleet_env: dict[str, str],
                                                          busy_tier: str) -> None:
    row = snapshot(r)["tiers"][QUEUE]
    (w,) = row["rq_workers"]
    assert (w["worker"], w["state"], w["job"], w["queues"]) == (NAME, "busy", busy_tier, [QUEUE])
    assert 0 <= w["age_s"] < 60 and (row["backlog"], row["pending"], row["failed_jobs"]) == (2, 1, 0)

    out = fleet_cli(fleet_env, "top", "--once", "--tier", QUEUE, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    tier = next(line for line in lines if line.startswith(f"{QUEUE} ")).split()
    assert tier[:4] == [QUEUE, "0", "1", "1"] and tier[7] == "2"  # RUN: its RQ worker; BACKLOG: queued
    head = next(line for line in lines if line.startswith(f"RQ TIER {QUEUE}"))
    assert "queued 2  started 1  failed 0  oldest " in head and f"(queues {QUEUE})" in head
    worker = next(line for line in lines if line.strip().startswith(NAME)).split()
    assert worker[1] == "busy" and worker[3] == busy_tier


async def test_the_monitor_lists_the_rq_tier(r: redis.Redis, busy_tier: str) -> None:
    rig = Rig(r, concurrency=1)
    assert rig.campaign()
    rig.run_for(1.0)  # a pass judges the rq tier
    monitor = Monitor(board=rig.commander.board, leading=lambda: True, commander_id="c1", r=r,
                      clock=time.time)
    client: TestClient[Any, Any] = TestClient(TestServer(build_app(Metrics(), monitor)))
    await client.start_server()
    try:
        resp = await client.get("/api/rq")
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    finally:
        await client.close()
    assert body["error"] is None and list(body["tiers"]) == [QUEUE]
    tier = body["tiers"][QUEUE]
    assert (tier["backlog"], tier["pending"], tier["failed_jobs"], tier["workers_alive"]) == (2, 1, 0, 1)
    assert tier["oldest_job_age_s"] >= 0 and tier["rq_workers"][0]["job"] == busy_tier
    assert tier["rq_workers"][0]["state"] == "busy"
