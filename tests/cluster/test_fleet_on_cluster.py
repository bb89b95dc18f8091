"""Fleet end to end on a real Redis Cluster (3 masters + 3 replicas): workers, the asyncio
client, the CLI (`fleet submit`, `fleet status`) and the commander, all given one node's
plain URL."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from fleet.client import AsyncFleet, Restart
from protocol import keys
from protocol.codec import decode
from protocol.models import Reply, SessionEntry
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from stores.registry import read_registry
from tests.cluster.conftest import RedisClusterRig
from tests.conftest import ROOT, TEST_WORKER_ENV, role_env
from tests.helpers import Processes, fleet_cli, no_process_left
from tests.integration.conftest import FAST_WORKER_ENV, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster_env(redis_cluster: RedisClusterRig, tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    # no credentials in the URL: each process and command connects as its role (role_env)
    env.update({"REDIS_URL": redis_cluster.plain_url, **role_env(),
                "FLEET_HOME": str(tmp_path / "fleet-home"),
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
                "PYTHONUNBUFFERED": "1", **TEST_WORKER_ENV, **FAST_WORKER_ENV})
    env.pop("FLEET_REDIS_CLUSTER", None)  # detected from the URL, not forced
    return env


@pytest.fixture
def start_workers(cluster_env: dict[str, str], rc: redis.Redis,
                  tmp_path: Path) -> Iterator[Callable[[int], list[subprocess.Popen[bytes]]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(n: int) -> list[subprocess.Popen[bytes]]:
        new = []
        for _ in range(n):
            wid = f"chat-c{len(procs)}"
            with (tmp_path / f"{wid}.log").open("wb") as out:
                proc = subprocess.Popen([sys.executable, "-m", "worker", "--tier", "chat",
                                         "--worker-id", wid],
                                        env=cluster_env, stdout=out, stderr=subprocess.STDOUT)
            procs.append(proc)
            new.append(proc)
            wait_until(lambda w=wid, p=proc: rc.exists(keys.heartbeat(w)) or p.poll() is not None, 20,
                       f"worker {wid} to register")
            assert proc.poll() is None, (tmp_path / f"{wid}.log").read_text()[-2000:]
        return new

    yield start
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def session_of(r: redis.Redis, user: str) -> list[str]:
    return [decode(SessionEntry, raw).text for raw in r.lrange(keys.session(user), 0, -1)]


def answered_in_order(url: str, rc: redis.Redis, names: list[str], turns: int) -> None:
    """Every user of ``names`` sends ``turns`` turns one after another, all users at once; each
    reply answers its turn and each session holds the turns in order."""

    async def run() -> list[list[str]]:
        fleet = AsyncFleet(url)

        async def one(user: str) -> list[str]:
            return [(await fleet.ask(user, f"turn {k}", timeout=30)).text for k in range(turns)]

        try:
            return await asyncio.gather(*(one(u) for u in names))
        finally:
            await fleet.aclose()

    replies = asyncio.run(run())
    for user, texts in zip(names, replies, strict=True):
        assert [t.split(" | ")[0] for t in texts] == [f"echo: turn {k}" for k in range(turns)], user
        assert session_of(rc, user) == [f"turn {k}" for k in range(turns)], user


def test_turns_of_users_on_every_master_are_all_answered_in_order(
        redis_cluster: RedisClusterRig, rc: redis.Redis, start_workers: Callable[[int], object]) -> None:
    write_policy(rc, "chat", TurnsPolicy(concurrency=16))
    start_workers(2)
    users, turns = 150, 3
    names = [f"u{i}" for i in range(users)]
    masters = {redis_cluster.master_of_slot(key_slot(keys.inbox(u).encode())).port for u in names}
    assert len(masters) == 3  # the users' keys live on every master

    answered_in_order(redis_cluster.role_url("fleet-client"), rc, names, turns)


def test_streamed_turns_on_a_cluster(redis_cluster: RedisClusterRig, rc: redis.Redis,
                                     start_workers: Callable[[int], object]) -> None:
    """Streamed replies on every master: the chunks, a retried attempt's restart, the reply."""
    write_policy(rc, "chat", TurnsPolicy(handler="echo_stream", handler_options={"delay_ms": 30}))
    start_workers(1)
    names = [f"s{i}" for i in range(6)]
    assert len({redis_cluster.master_of_slot(key_slot(keys.inbox(u).encode())).port for u in names}) == 3

    async def run() -> list[list[object]]:
        fleet = AsyncFleet(redis_cluster.role_url("fleet-client"))

        async def one(user: str) -> list[object]:
            meta = {"fail_attempts": 1} if user == "s0" else None
            return [item async for item in fleet.stream(user, f"hello {user} there", timeout=30, meta=meta)]

        try:
            return await asyncio.gather(*(one(u) for u in names))
        finally:
            await fleet.aclose()

    for user, items in zip(names, asyncio.run(run()), strict=True):
        reply = items[-1]
        assert isinstance(reply, Reply) and reply.ok and reply.text == f"hello {user} there", user
        after = items[max((i for i, x in enumerate(items) if isinstance(x, Restart)), default=-1) + 1:-1]
        assert "".join(str(x) for x in after) == reply.text, user
        assert any(isinstance(x, Restart) for x in items) == (user == "s0"), user
        last = rc.xrevrange(keys.stream(user, reply.turn_id), count=1)
        assert last[0][1] == {b"k": b"end", b"status": b"ok"}, user


def test_the_cli_submits_and_shows_status_on_a_cluster(
        rc: redis.Redis, cluster_env: dict[str, str], start_workers: Callable[[int], object]) -> None:
    write_policy(rc, "chat", TurnsPolicy())  # a tier by its policy: the client role may not read the registry
    start_workers(1)
    out = fleet_cli(cluster_env, "submit", "--user", "cli", "hello", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("echo: hello")
    out = fleet_cli(cluster_env, "status", "--json", timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["tiers"]["chat"]["backlog"] == 0
    assert [w["worker"] for w in status["workers"] if w["alive"]] == ["chat-c0"]
    out = fleet_cli(cluster_env, "policy", "set", "chat", "max_workers=5", timeout=60)
    assert out.returncode == 0, out.stderr
    out = fleet_cli(cluster_env, "policy", "get", "chat", timeout=60)
    assert out.returncode == 0 and "max_workers = 5" in out.stdout, out.stdout + out.stderr


def test_the_commander_scales_a_tier_on_a_cluster(redis_cluster: RedisClusterRig, rc: redis.Redis,
                                                  cluster_env: dict[str, str], processes: Processes) -> None:
    write_policy(rc, "chat", TurnsPolicy(min_workers=2, max_workers=4, concurrency=4))
    commander = processes.commander(cluster_env)
    pids: set[int] = set()
    try:
        def live() -> list[str]:
            workers = read_registry(rc).workers
            pids.update(info.pid for info, _alive in workers.values())
            return [wid for wid, (_info, alive) in workers.items() if alive]

        wait_until(lambda: len(live()) == 2 or not commander.alive(), 60, "the commander's 2 workers")
        assert commander.alive(), commander.tail()

        async def ask() -> str:
            fleet = AsyncFleet(redis_cluster.role_url("fleet-client"))
            try:
                return (await fleet.ask("alice", "hi", timeout=30)).text
            finally:
                await fleet.aclose()

        assert asyncio.run(ask()).startswith("echo: hi")
        assert rc.get(keys.LEADER) is not None
        events = rc.xrange(keys.EVENTS)
        assert any(b"scale-up" in fields[b"m"] for _id, fields in events), events
    finally:
        processes.stop_all()  # it stops its workers on its way out: none may be left behind
    no_process_left(pids)


def test_a_tier_on_three_ready_shards_spreads_over_three_masters_in_order(
        redis_cluster: RedisClusterRig, rc: redis.Redis, start_workers: Callable[[int], object]) -> None:
    """``ready_shards=3``: the tier's ready streams sit on 3 different masters, and every turn
    of every user is answered once, in order (workers read each shard on its own there)."""
    write_policy(rc, "chat", TurnsPolicy(concurrency=16, ready_shards=3))
    shards = [keys.ready("chat", k) for k in range(3)]
    assert len({redis_cluster.master_of_slot(key_slot(s.encode())).port for s in shards}) == 3
    start_workers(2)
    users, turns = 90, 3
    names = [f"s{i}" for i in range(users)]

    answered_in_order(redis_cluster.role_url("fleet-client"), rc, names, turns)
    # each shard carried its users' notifications: all read by the workers' group there
    for k, stream in enumerate(shards):
        group = next(g for g in rc.xinfo_groups(stream) if g["name"] == keys.GROUP.encode())
        expect = sum(1 for u in names if keys.ready_shard(u, 3) == k) * turns
        assert int(group["entries-read"]) == expect > 0, k
