"""``replica_acks`` on a real 3+3 Redis Cluster (failover): two workers in this
process (so their stores' WAIT counters can be read), the asyncio client, one tier.

- ``replica_acks`` 1: every turn answered; every acquire's and every commit's WAIT got its
  replica (each master has one, linked);
- a replica SIGSTOPped (by pid; SIGCONT after): the WAITs after turns of users on its master
  time out with 0, the turns are answered all the same, the shortfalls counted and logged;
- the client's submits wait too (the same policy fields): after each master's share of the
  inbox entries and after the notifications, counted in ``Fleet.acks``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.crc import key_slot

from fleet.client import AsyncFleet, Fleet
from protocol import keys
from protocol.policy import turns_policy
from stores.connection import connect_sync
from stores.policies import write_policy
from tests.cluster.conftest import RedisClusterRig
from tests.conftest import ROOT
from worker.app import Worker
from worker.settings import WorkerSettings

pytestmark = pytest.mark.integration
TIMEOUT_MS = 200


@pytest.fixture
async def workers(redis_cluster: RedisClusterRig) -> AsyncIterator[list[Worker]]:
    rc = connect_sync(redis_cluster.url)
    write_policy(rc, "chat", turns_policy(handler="echo", concurrency=16, replica_acks=1,
                                          replica_ack_timeout_ms=TIMEOUT_MS))
    rc.close()
    ws = [Worker(WorkerSettings(redis_url=redis_cluster.role_url("fleet-worker"), worker_id=f"chat-wait{i}",
                                block_ms=200,
                                log_level="WARNING")) for i in range(2)]
    tasks = [asyncio.create_task(w.run()) for w in ws]
    deadline = time.monotonic() + 20
    while not all(w.state == "ready" for w in ws):
        assert time.monotonic() < deadline, "workers did not start"
        assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
        await asyncio.sleep(0.05)
    assert all(w.store.replica_wait is not None for w in ws)
    yield ws
    for w in ws:
        w.drain("test over")
    await asyncio.wait_for(asyncio.gather(*tasks), 30)


def totals(ws: list[Worker], what: str) -> dict[str, int]:
    out = {"acquire": 0, "commit": 0}
    for w in ws:
        for op, n in getattr(w.store.acks, what).items():
            out[op] += n
    return out


async def settle(ws: list[Worker], commits: int) -> None:
    deadline = time.monotonic() + 10
    while totals(ws, "waits")["commit"] < commits:
        assert time.monotonic() < deadline, f"{totals(ws, 'waits')} WAITs, not {commits} after commits"
        await asyncio.sleep(0.02)


async def test_every_turn_waits_for_its_replica(redis_cluster: RedisClusterRig,
                                                workers: list[Worker]) -> None:
    fleet = AsyncFleet(redis_cluster.role_url("fleet-client"))
    try:
        users = [f"u{i:03d}" for i in range(40)]
        for n in range(3):
            replies = await asyncio.gather(*(fleet.ask(u, f"turn {n}", timeout=30) for u in users))
            assert all(r.ok and r.text.startswith(f"echo: turn {n}") for r in replies)
        # every submit waited for a replica (the policy's, read with ready_shards), and got it
        assert fleet.acks.waits == fleet.acks.acked == {"submit": 120}
        assert fleet.acks.short == {"submit": 0}
    finally:
        await fleet.aclose()
    await settle(workers, 120)
    waits, short, acked = totals(workers, "waits"), totals(workers, "short"), totals(workers, "acked")
    assert waits["commit"] == 120  # one commit per turn, each with its WAIT
    assert waits["acquire"] >= 120 // 16  # a lane serves the turns queued when it is held
    assert short == {"acquire": 0, "commit": 0}
    assert acked == waits  # every WAIT 1 got 1


async def test_a_stopped_replica_makes_the_wait_short_not_the_turn(
        redis_cluster: RedisClusterRig, workers: list[Worker], caplog: pytest.LogCaptureFixture) -> None:
    users = [f"u{i:03d}" for i in range(60)]
    master = redis_cluster.master_of_slot(key_slot(keys.lane(users[0]).encode()))
    replica = redis_cluster.replicas_of(master)[0]
    mine = [u for u in users if redis_cluster.master_of_slot(key_slot(keys.lane(u).encode())) == master]
    others = [u for u in users if u not in mine]
    assert mine and others
    fleet = AsyncFleet(redis_cluster.role_url("fleet-client"))
    assert replica.pid is not None
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="fleet.replicas"):
            t0 = time.monotonic()
            replies = await asyncio.gather(*(fleet.ask(u, "while the replica sleeps", timeout=30)
                                             for u in mine))
            elapsed = time.monotonic() - t0
        assert all(r.ok for r in replies)
        # the reply is on the master (the submitter reads it there) as soon as the commit ran; the
        # worker's WAIT goes on until its timeout: wait for the workers to come out of them
        await settle(workers, len(mine))
        short = totals(workers, "short")
        assert short["commit"] == len(mine)  # each of their commits' WAIT timed out
        assert short["acquire"] >= 1
        assert elapsed >= TIMEOUT_MS / 1000  # the acquire's WAIT timed out before the handler ran
        assert any(rec.getMessage().startswith(("WAIT 1 after acquire got 0 within 200 ms",
                                                "WAIT 1 after commit got 0 within 200 ms"))
                   for rec in caplog.records)
        # the submits of those users waited for the stopped replica too (their inbox entries are
        # on its master): each came back short, and was queued and answered all the same
        assert fleet.acks.short == {"submit": len(mine)}
        assert any("WAIT 1 after submit got 0 within 200 ms" in rec.getMessage() for rec in caplog.records)
        # users on the other masters are not slowed: their replicas answer
        before = totals(workers, "short")
        replies = await asyncio.gather(*(fleet.ask(u, "elsewhere", timeout=30) for u in others))
        assert all(r.ok for r in replies)
        assert totals(workers, "short") == before
    finally:
        os.kill(replica.pid, signal.SIGCONT)
        await fleet.aclose()
    deadline = time.monotonic() + 30
    while not redis_cluster._replica_linked(replica):
        assert time.monotonic() < deadline, "the replica did not link up again"
        await asyncio.sleep(0.1)


async def test_a_blocking_batch_submit_waits_on_every_master_it_wrote(
        redis_cluster: RedisClusterRig, workers: list[Worker]) -> None:
    users = [f"b{i:03d}" for i in range(30)]
    masters = {redis_cluster.master_of_slot(key_slot(keys.inbox(u).encode())).port for u in users}
    assert len(masters) == 3  # the batch spans every master
    fleet = Fleet(redis_cluster.role_url("fleet-client"))
    try:
        handles = await asyncio.to_thread(fleet.submit_many, [(u, "batch") for u in users])
        assert fleet.acks.waits == fleet.acks.acked == {"submit": 1}  # one batch: its fewest got 1
        replies = await asyncio.gather(*(asyncio.to_thread(h.result, 30) for h in handles))
        assert [r.text for r in replies] == ["echo: batch"] * len(users)
    finally:
        fleet.close()


@pytest.mark.smoke
def test_bench_wait_quick(redis_cluster: RedisClusterRig, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_wait.py"), "--quick",
                          "--url", redis_cluster.url, "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    without, with_wait = result["replica_acks_0"], result["replica_acks_1"]
    assert without["turns"] == with_wait["turns"] == 40 * 3
    assert without["wait_commands"] == 0 and with_wait["wait_commands"] >= with_wait["turns"]
    assert set(result["ratio_1_to_0"]) == {"turns_per_s", "p50_ms", "p99_ms"}


def test_bench_wait_rejects_bad_arguments() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_wait.py"), "--rounds", "3"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and "must be even" in run.stderr and run.stderr.count("\n") == 1
