"""The ordered submit on a real Redis Cluster: every turn's inbox entry is there
before its notification can be read.

The cluster is the session's 3 masters + 3 replicas (tests/cluster/conftest.py). The clients
are redis-py's ``RedisCluster`` (blocking and asyncio), built directly. A watcher reads the
tier's ready stream as a worker would (``XREAD``) and, for each notification of user U,
checks at once that U's inbox already holds as many entries as U has had notifications. And
``MONITOR`` on every master timestamps each command where it ran (one machine, one clock,
microseconds): U's k-th inbox ``XADD`` must run before U's k-th notification. A notification
that overtook its turn (what redis-py's concurrent per-node pipeline did to a one-batch
submit: 879/900 answered) is caught there; a one-batch submit fails this test. The workers on
a cluster: test_fleet_on_cluster.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
import redis.asyncio as aioredis

from fleet.client import AsyncFleet, Fleet, SubmitNotNotified
from protocol import keys
from protocol.codec import as_str, decode
from protocol.groups import Group
from protocol.models import Turn
from protocol.policy import turns_policy
from stores.cluster import is_cluster
from stores.policies import write_policy
from tests.cluster.conftest import RedisClusterRig
from tests.conftest import ADMIN_PASSWORD, ROLE_PASSWORDS

pytestmark = pytest.mark.integration

USERS, TURNS = 300, 3
# the clients' credentials on the cluster's ACL: the Fleet clients as fleet-client, the
# watcher as a worker reads (fleet-worker), the test's own setup and MONITOR as the admin
ADMIN = {"password": ADMIN_PASSWORD}
CLIENT = {"username": "fleet-client", "password": ROLE_PASSWORDS["fleet-client"]}
WORKER = {"username": "fleet-worker", "password": ROLE_PASSWORDS["fleet-worker"]}


@dataclass(frozen=True)
class Cluster:
    """The masters' ports of the session's cluster (tests/cluster/conftest.py)."""

    ports: list[int]


@pytest.fixture
def cluster(redis_cluster: RedisClusterRig) -> Cluster:
    return Cluster([m.port for m in redis_cluster.masters()])


@pytest.fixture
def rc(cluster: Cluster) -> Iterator[redis.RedisCluster]:
    client = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0], **ADMIN)
    client.sadd(keys.TIERS, "chat")  # (the fixture emptied the cluster)
    yield client
    client.close()


def test_the_cluster_spreads_the_users_over_the_masters(rc: redis.RedisCluster) -> None:
    assert is_cluster(rc) and is_cluster(rc.pipeline())
    owners = {rc.get_node_from_key(keys.inbox(f"u{i}")).name for i in range(USERS)}
    assert len(owners) == 3


async def _watch(port: int, stop: asyncio.Event, seen: Counter[str], overtaken: list[str]) -> None:
    """Read the ready stream like a worker; a notification whose turn is not in the inbox yet
    is recorded in ``overtaken``."""
    r = aioredis.RedisCluster(host="127.0.0.1", port=port, **WORKER)
    last = "0-0"
    try:
        while True:
            got = await r.xread({keys.ready("chat"): last}, count=500, block=50)
            if not got and stop.is_set():
                return
            for _stream, entries in got or []:
                for entry_id, fields in entries:
                    last = as_str(entry_id)
                    user = as_str(fields[b"user"])
                    seen[user] += 1
                    if await r.xlen(keys.inbox(user)) < seen[user]:
                        overtaken.append(f"{user}#{seen[user]}")
    finally:
        await r.aclose()


class Monitor:
    """``MONITOR`` on every master: when each inbox ``XADD`` and each notification ran."""

    STOP = "fleet-test-monitor-stop"

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.inbox: dict[str, list[float]] = defaultdict(list)
        self.ready: dict[str, list[float]] = defaultdict(list)
        self.lock = threading.Lock()
        self.started = [threading.Event() for _ in ports]
        self.threads = [threading.Thread(target=self._run, args=(p, e), daemon=True)
                        for p, e in zip(ports, self.started, strict=True)]

    def _run(self, port: int, started: threading.Event) -> None:
        with redis.Redis(host="127.0.0.1", port=port, **ADMIN).monitor() as m:
            started.set()
            for cmd in m.listen():
                words = cmd["command"].split(" ")
                if words[0] == "ECHO" and words[-1] == self.STOP:
                    return
                if words[0].upper() != "XADD":
                    continue
                with self.lock:
                    if words[1].endswith(":inbox"):
                        self.inbox[words[1]].append(cmd["time"])
                    elif words[1] == keys.ready("chat"):
                        self.ready[keys.inbox(words[-1])].append(cmd["time"])

    def __enter__(self) -> Monitor:
        for t in self.threads:
            t.start()
        for e in self.started:
            assert e.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        for port in self.ports:
            redis.Redis(host="127.0.0.1", port=port, **ADMIN).echo(self.STOP)
        for t in self.threads:
            t.join(10)

    def overtaken(self) -> list[str]:
        """Notifications that ran before (or with no) inbox entry of the same rank."""
        bad = []
        for inbox, times in self.ready.items():
            entries = self.inbox.get(inbox, [])
            for k, at in enumerate(times):
                if k >= len(entries) or entries[k] >= at:
                    bad.append(f"{inbox}#{k}")
        return bad


def _assert_all_written(rc: redis.RedisCluster, turn_ids: dict[str, list[str]]) -> None:
    for user, ids in turn_ids.items():
        rows = rc.xrange(keys.inbox(user))
        assert len(rows) == len(ids), user
    assert rc.xlen(keys.ready("chat")) == sum(len(ids) for ids in turn_ids.values())
    assert rc.zcard(keys.active("chat")) == len(turn_ids)


def test_async_submits_of_300_users_x_3_turns_never_notify_before_the_inbox(
        cluster: Cluster, rc: redis.RedisCluster) -> None:
    async def run() -> tuple[Counter[str], list[str], dict[str, list[str]]]:
        stop = asyncio.Event()
        seen: Counter[str] = Counter()
        overtaken: list[str] = []
        watcher = asyncio.create_task(_watch(cluster.ports[1], stop, seen, overtaken))
        client = AsyncFleet(client=aioredis.RedisCluster(host="127.0.0.1", port=cluster.ports[0], **CLIENT))
        turn_ids: dict[str, list[str]] = {}

        async def user(u: str) -> None:
            turn_ids[u] = []
            for k in range(TURNS):
                turn = await client.submit(u, f"turn {k}")
                turn_ids[u].append(turn.turn_id)

        try:
            await asyncio.gather(*(user(f"u{i}") for i in range(USERS)))
            deadline = time.monotonic() + 20
            while sum(seen.values()) < USERS * TURNS and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await watcher
            await client.aclose()
        return seen, overtaken, turn_ids

    with Monitor(cluster.ports) as monitor:
        seen, overtaken, turn_ids = asyncio.run(run())
    assert overtaken == [] and monitor.overtaken() == []
    assert sum(map(len, monitor.ready.values())) == USERS * TURNS
    assert sum(seen.values()) == USERS * TURNS and set(seen.values()) == {TURNS}
    _assert_all_written(rc, turn_ids)
    for u, ids in turn_ids.items():  # each inbox in submission order
        assert [decode(Turn, f[b"m"]).turn_id for _, f in rc.xrange(keys.inbox(u))] == ids


def test_submit_many_batches_on_both_clients_write_every_inbox_entry_then_every_notification(
        cluster: Cluster, rc: redis.RedisCluster) -> None:
    users = [f"b{i}" for i in range(100)]

    async def run() -> tuple[list[str], dict[str, list[str]]]:
        stop = asyncio.Event()
        seen: Counter[str] = Counter()
        overtaken: list[str] = []
        watcher = asyncio.create_task(_watch(cluster.ports[2], stop, seen, overtaken))
        turn_ids: dict[str, list[str]] = {u: [] for u in users}
        aclient = AsyncFleet(client=aioredis.RedisCluster(host="127.0.0.1", port=cluster.ports[1], **CLIENT))
        sync = Fleet(client=redis.RedisCluster(host="127.0.0.1", port=cluster.ports[2], **CLIENT))
        try:
            for _ in range(2):
                for turn in await aclient.submit_many([(u, "a") for u in users]):
                    turn_ids[turn.user].append(turn.turn_id)
                handles = await asyncio.to_thread(sync.submit_many, [(u, "s") for u in users])
                for h in handles:
                    turn_ids[h.user].append(h.turn_id)
            deadline = time.monotonic() + 20
            while sum(seen.values()) < 4 * len(users) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await watcher
            await aclient.aclose()
            sync.close()
        return overtaken, turn_ids

    with Monitor(cluster.ports) as monitor:
        overtaken, turn_ids = asyncio.run(run())
    assert overtaken == [] and monitor.overtaken() == []
    assert sum(map(len, monitor.ready.values())) == 4 * len(users)
    _assert_all_written(rc, turn_ids)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_refused_inbox_entry_is_raised_and_gets_no_notification_on_a_real_cluster(
        cluster: Cluster, rc: redis.RedisCluster, flavour: str) -> None:
    rc.set(keys.inbox("bob"), "not a stream")  # bob's XADD is refused (WRONGTYPE) where it runs
    batch = [("alice", "1"), ("bob", "2"), ("carol", "3")]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        if flavour == "sync":
            with Fleet(client=redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0], **CLIENT)) as f:
                f.submit_many(batch)
        else:
            async def run() -> None:
                a = AsyncFleet(client=aioredis.RedisCluster(host="127.0.0.1", port=cluster.ports[0],
                                                            **CLIENT))
                try:
                    await a.submit_many(batch)
                finally:
                    await a.aclose()
            asyncio.run(run())
    users = [as_str(f[b"user"]) for _, f in rc.xrange(keys.ready("chat"))]
    assert users == ["alice", "carol"]  # the others written and notified, bob's never
    assert rc.xlen(keys.inbox("alice")) == rc.xlen(keys.inbox("carol")) == 1


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_refused_notification_leaves_the_turn_queued_and_raises_submit_not_notified(
        cluster: Cluster, rc: redis.RedisCluster, flavour: str) -> None:
    rc.set(keys.ready("chat"), "not a stream")  # every notification is refused
    with pytest.raises(SubmitNotNotified) as caught:
        if flavour == "sync":
            with Fleet(client=redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0], **CLIENT)) as f:
                f.submit("alice", "hi", turn_id="t-1")
        else:
            async def run() -> None:
                a = AsyncFleet(client=aioredis.RedisCluster(host="127.0.0.1", port=cluster.ports[0],
                                                            **CLIENT))
                try:
                    await a.submit("alice", "hi", turn_id="t-1")
                finally:
                    await a.aclose()
            asyncio.run(run())
    assert [t.turn_id for t in caught.value.turns] == ["t-1"]
    assert isinstance(caught.value.__cause__, redis.ResponseError)
    rows = rc.xrange(keys.inbox("alice"))
    assert [decode(Turn, f[b"m"]).turn_id for _, f in rows] == ["t-1"]  # queued, for the next notification


def test_a_submit_to_a_tier_with_groups_notifies_the_pool_of_the_users_group(
        rc: redis.RedisCluster, cluster: Cluster) -> None:
    # every user's group is green: its pool, chat.green, is what green's workers read
    groups = (Group(name="blue", weight=0), Group(name="green", weight=100))
    write_policy(rc, "chat", turns_policy(groups=groups))
    client = Fleet(client=redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0], **CLIENT))
    client.submit_many([("dora", "one"), ("eli", "two")])
    assert rc.xlen(keys.ready("chat.green")) == 2 and rc.zcard(keys.active("chat.green")) == 2
    assert not rc.exists(keys.ready("chat")) and not rc.exists(keys.active("chat"))
    client.close()
