"""rq tiers with Fleet on a Redis Cluster and RQ on a node of its own.

RQ keeps its keys without hash tags, so it needs one Redis node: here Fleet's data is on a
real cluster (3 masters + 3 replicas) and RQ on an extra single redis-server. A chat handler
defers a job per turn (its outbox is in the user's slot, on the cluster); the relay
(``--rq-url``) moves each into RQ; the commander (``--rq-url``) sees the queue on RQ's node and
scales the rq tier from zero; its RQ workers run the jobs, whose effect (a counter with no
idempotency of its own) is written back on the cluster; each job ran exactly once; the tier
goes back to zero. Every process is ours, started and stopped by pid."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.deferral import job_id
from protocol.policy import RqPolicy, TurnsPolicy, rq_policy
from stores import rqjobs
from stores.policies import write_policy
from stores.registry import read_registry
from tests.cluster.conftest import RedisClusterRig
from tests.conftest import ROOT, TEST_WORKER_ENV, RedisServer, role_env
from tests.helpers import Processes, fleet_cli, ledger
from tests.integration.conftest import FAST_WORKER_ENV, wait_until
from tests.integration.test_security import documented_rules, with_password

pytestmark = pytest.mark.integration
QUEUE = "writeback"


RQ_PASSWORD = "rq-secret"


@pytest.fixture
def rq_node(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """RQ's own Redis: one plain redis-server (the module's), emptied, with the security page's user
    ``fleet-rq`` for the relay, the commander and the RQ workers (``rq_url``); the test itself
    reads it as the default user."""
    client = redis_server.client()
    client.flushall()
    client.execute_command("ACL", "SETUSER", "fleet-rq",
                           *with_password(documented_rules("fleet-rq"), RQ_PASSWORD))
    yield client
    client.close()


def rq_url(server: RedisServer) -> str:
    return f"redis://fleet-rq:{RQ_PASSWORD}@127.0.0.1:{server.port}/0"


def _env(cluster_url: str, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FLEET_RQ_URL", "FLEET_REDIS_CLUSTER",
                                                             "COLUMNS", "LINES")}
    # each process and command connects to the cluster as its role (role_env)
    env.update({"REDIS_URL": cluster_url, **role_env(), "FLEET_HOME": str(tmp_path / "fleet-home"),
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1",
                "FLEET_PYTHON": sys.executable, **TEST_WORKER_ENV, **FAST_WORKER_ENV})
    return env


def test_an_rq_tier_on_a_cluster_runs_every_deferred_job_once_on_rqs_own_node(
        redis_cluster: RedisClusterRig, rc: redis.Redis, rq_node: redis.Redis, redis_server: RedisServer,
        processes: Processes, tmp_path: Path) -> None:
    env = _env(redis_cluster.plain_url, tmp_path)  # no FLEET_RQ_URL: the flags say where RQ is
    write_policy(rc, "chat", TurnsPolicy(handler="echo_defer", concurrency=16, min_workers=1, max_workers=1,
                                         handler_options={"job": "count", "job_sleep_s": 0.1}))
    write_policy(rc, QUEUE, rq_policy(min_workers=0, max_workers=3, target_backlog_per_worker=4,
                                      scale_down_stabilization_s=1,
                                      drain_timeout_s=15))
    commander = processes.commander(env, "c1", "--rq-url", rq_url(redis_server))
    relay_argv = ["-m", "fleet.cli", "relay", "--id", "relay-c", "--rq-url", rq_url(redis_server),
                  "--claim-idle-ms", "500", "--sweep-interval", "2"]
    relay = processes.start("relay", relay_argv, env)
    wait_until(lambda: ledger(rc, "chat", "scale-up") or not commander.alive(), 30, "the chat worker")
    assert commander.alive(), commander.tail()
    assert rqjobs.workers(rq_node, QUEUE) == []  # min_workers 0: none before a job
    assert not ledger(rc, QUEUE, "scale-up")

    users = [f"k{i}" for i in range(8)]  # spread over the cluster's slots
    turns = [(users[i % len(users)], f"t{i}") for i in range(24)]
    fleet = Fleet(redis_cluster.role_url("fleet-client"))
    for h in fleet.submit_many([(u, "hi") for u, _ in turns], turn_ids=[t for _, t in turns]):
        assert h.result(60).ok

    total = lambda: sum(int(rc.hget(keys.usage(u), "jobs_run") or 0) for u in users)  # noqa: E731
    wait_until(lambda: total() >= len(turns) and rq_node.llen(f"rq:queue:{QUEUE}") == 0, 90,
               "every job to run")
    ups = ledger(rc, QUEUE, "scale-up")
    assert ups and ups[0].from_count == 0, commander.tail()  # scaled from zero, on RQ's node
    wait_until(lambda: rqjobs.workers(rq_node, QUEUE) == [], 90, "the rq tier to go back to zero")

    expected = {job_id(u, t, 0) for u, t in turns}
    finished = {x.decode() for x in rq_node.zrange(f"rq:finished:{QUEUE}", 0, -1)}
    assert finished == expected  # every deferral is one job in RQ, finished
    assert rq_node.zcard(f"rq:failed:{QUEUE}") == 0 and rq_node.zcard(f"rq:wip:{QUEUE}") == 0
    assert total() == len(turns)  # the job's own effect, on the cluster: exactly one run each
    assert all(rc.xlen(keys.outbox(u)) == 0 for u in users)
    assert not rc.keys("rq:*"), "RQ wrote to Fleet's cluster"  # RQ's keys are on its own node only
    assert ledger(rc, QUEUE, "reclaim-idle", "consolidate")
    assert not ledger(rc, QUEUE, "worker-exited", "refused")
    assert relay.alive(), relay.tail()
    text = commander.log.read_text()
    assert "Traceback" not in text and "pass failed" not in text, text[-3000:]
    # fleet status reads the rq tier on RQ's node ($FLEET_RQ_URL), and says so when it has none
    status = lambda extra: json.loads(  # noqa: E731
        fleet_cli({**env, **extra}, "status", "--json", timeout=60).stdout)["tiers"][QUEUE]
    row = status({"FLEET_RQ_URL": rq_url(redis_server)})
    assert row["queues"][0]["finished"] == len(turns) and row["failed_jobs"] == 0, row
    assert "names no RQ Redis" in status({})["rq_error"]
    refusals = [e for e in rq_node.acl_log() if e.get("username") == "fleet-rq"]
    assert not refusals, refusals  # the security page's ACL for RQ's node covers what they sent


def test_an_rq_tier_on_a_cluster_without_rqs_redis_is_refused_once(
        redis_cluster: RedisClusterRig, rc: redis.Redis, processes: Processes,
        tmp_path: Path) -> None:
    env = _env(redis_cluster.plain_url, tmp_path)
    write_policy(rc, "chat", TurnsPolicy(min_workers=1, max_workers=1))
    write_policy(rc, QUEUE, RqPolicy(min_workers=1, max_workers=2))
    commander = processes.commander(env, "c2")
    refused = lambda: ledger(rc, QUEUE, "refused")  # noqa: E731
    wait_until(lambda: refused() or not commander.alive(), 30, "the rq tier to be refused")
    assert commander.alive(), commander.tail()
    assert "--rq-url or $FLEET_RQ_URL" in refused()[0].reason
    # more passes: still refused, said once, no worker started, no traceback
    wait_until(lambda: read_registry(rc).live("chat"), 30, "the chat worker to register (passes go on)")
    assert len(refused()) == 1 and not ledger(rc, QUEUE, "scale-up")
    text = commander.log.read_text()
    assert "Traceback" not in text and text.count("is of kind rq, not run") == 1, text[-3000:]
