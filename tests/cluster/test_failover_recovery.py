"""A failover that loses a turn's notification but keeps its inbox entry: the commander sees the
cluster epoch grow and re-notifies the user (``stores.renotify``), and the turn is answered.

Found by ``scripts/chaos --cluster --lagging-replica 1.9 --replica-acks 1 --seed 7``: turn
``c004-110``'s entry survived the kill of the tier's master, its notification did not, and its
user waited for good. Here the same loss is made on purpose: the tier master's replica is
paused (SIGSTOP) and its link cut while the turn is submitted, so the notification reaches
only the master, which is then killed; its replica is promoted without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
from redis.crc import key_slot

from fleet.client import Fleet
from protocol import keys
from protocol.policy import TurnsPolicy
from stores.connection import connect_sync
from stores.policies import write_policy
from stores.renotify import cluster_epoch, read_recovered
from stores.retry import TRANSIENT
from tests.cluster.conftest import ClusterNode, RedisClusterRig
from tests.cluster.test_fleet_on_cluster import cluster_env, start_workers  # noqa: F401, F811  (fixtures)
from tests.integration.commander_rig import Rig
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


def user_off(rig: RedisClusterRig, master_port: int) -> str:
    """A user whose keys live on another master than ``master_port``'s."""
    return next(u for u in (f"f{i}" for i in range(1000))
                if rig.master_of_slot(key_slot(keys.inbox(u).encode())).port != master_port)


def step_until_recovered(rig: Rig, r: redis.Redis, before: int, seconds: float = 30.0) -> None:
    """Commander passes until one recovers from the failover (the first ones may still meet
    the dead master: the client learns the new slot map, the pass or its recovery fails and
    the next one tries again; a new leadership reads the recorded epoch first)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            rig.campaign()  # the lease (a real-time TTL) may have run out during the failover
            rig.step()
            recovered = read_recovered(r)
            if recovered is not None and recovered > before:
                return
        except TRANSIENT:
            pass
        assert time.monotonic() < deadline, "no pass recovered from the failover"
        time.sleep(0.2)


def replicated(rig: RedisClusterRig, master: ClusterNode, timeout: float = 10.0) -> None:
    """Wait until every replica of ``master`` has what the master has written so far."""
    with master.client() as c:
        offset = int(c.info("replication")["master_repl_offset"])
    for replica in rig.replicas_of(master):
        wait_until(lambda n=replica: int(n.client().info("replication")["slave_repl_offset"]) >= offset,
                   timeout, f"replica {replica.port} to catch up")


def notified(r: redis.Redis, user: str) -> bool:
    return any(f.get(b"user") == user.encode() for _id, f in r.xrange(keys.ready("chat")))


def test_a_notification_lost_in_a_failover_is_posted_again_and_the_turn_answered(
        redis_cluster: RedisClusterRig, rc: redis.Redis, cluster_env: dict[str, str],  # noqa: F811
        start_workers: Callable[[int], object]) -> None:  # noqa: F811  (the fixtures)
    write_policy(rc, "chat", TurnsPolicy(min_workers=0, concurrency=4))
    commander_r = connect_sync(redis_cluster.role_url("fleet-commander"))  # the commander, as its role
    rig = Rig(commander_r, concurrency=4)
    assert rig.campaign()
    rig.step()
    before = read_recovered(rc)
    assert before is not None and before == cluster_epoch(rc)  # the first pass records the epoch

    tier_master = redis_cluster.master_of_slot(key_slot(keys.ready("chat").encode()))
    user = user_off(redis_cluster, tier_master.port)
    # the user was active before (its active mark replicated): a user's very first submit loses
    # its active mark with its notification, the window stores.renotify documents
    rc.zadd(keys.active("chat"), {user: time.time() - 60})
    replicated(redis_cluster, tier_master)
    # (before the pause: finding a master asks every node)
    fleet = Fleet(redis_cluster.role_url("fleet-client"))
    submitted = []

    def submit_and_check() -> None:
        # the replica is stopped; its link is cut too, so what it has not read yet is never
        # sent (a stopped replica still gets what sits in its socket buffer once resumed)
        with tier_master.client() as c:
            c.execute_command("CLIENT", "KILL", "TYPE", "replica")
        submitted.append(fleet.submit(user, "hello"))
        assert notified(rc, user)  # on the master only

    redis_cluster.kill_master(tier_master, lag_s=0.2, while_lagging=submit_and_check)
    handle = submitted[0]
    redis_cluster.wait_promoted(tier_master)
    deadline = time.monotonic() + 30
    while True:  # the client may still route to the dead master for a moment
        try:
            assert not notified(rc, user), "the notification survived: nothing was lost"
            assert rc.xrange(keys.inbox(user)), "the turn itself must have survived"
            break
        except TRANSIENT:
            assert time.monotonic() < deadline
            time.sleep(0.2)

    step_until_recovered(rig, rc, before)
    events = rig.actions("renotified")
    assert events and user in events[-1].why["renotified"]["users"], [e.reason for e in rig.ledger()]
    assert notified(rc, user)
    cluster_env["REDIS_URL"] = redis_cluster.plain_url  # a live node: the one it named may be the dead one
    start_workers(1)
    assert handle.result(timeout=30).text.startswith("echo: hello")
    fleet.close()
    before_quiet = len(rig.ledger())
    rig.step()
    assert [e.action for e in rig.ledger()[before_quiet:]].count("renotified") == 0  # once per failover
    commander_r.close()
