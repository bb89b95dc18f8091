"""The security page's least-privilege ACL users on a real Redis Cluster: the documented lines plus
the documented cluster addition are all a worker, a submit, a policy edit and the observer's
`fleet status` need; no node's ``ACL LOG`` records a refusal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from protocol import keys
from protocol.policy import TurnsPolicy
from stores.cluster import is_cluster
from stores.connection import connect_sync
from stores.policies import write_policy
from tests.cluster.conftest import (
    RedisClusterRig,
    Tls,
    _require_cluster_tools,
    cluster_acl_denials,
    start_cluster,
)
from tests.conftest import ADMIN_PASSWORD, ROLE_PASSWORDS, ROOT, TEST_WORKER_ENV, role_env
from tests.helpers import Processes, fleet_cli
from tests.integration.conftest import wait_until
from tests.integration.test_security import (
    SECURITY_MD,
    Certs,
    certs,  # noqa: F401  (the fixture)
    documented_rules,
    with_password,
)

pytestmark = pytest.mark.integration


def cluster_addition() -> list[str]:
    """The rules the security page says to add on a Redis Cluster (its ``**Redis Cluster**`` item)."""
    item = re.search(r"On a \*\*Redis Cluster\*\*, add these to both lines.*?: `([^`]+)`",
                     SECURITY_MD.read_text(), re.S)
    assert item, "the security page names no ACL addition for a Redis Cluster"
    return item.group(1).split()


@pytest.fixture
def acl_cluster(redis_cluster: RedisClusterRig) -> Iterator[RedisClusterRig]:
    for node in redis_cluster.nodes:
        admin = node.client()
        for user, password in (("fleet", "fleet-pw"), ("fleet-observer", "observer-pw")):
            admin.execute_command("ACL", "SETUSER", user,
                                  *with_password(documented_rules(user), password), *cluster_addition())
        admin.execute_command("ACL", "LOG", "RESET")
    yield redis_cluster
    for node in redis_cluster.nodes:
        if node.alive:
            node.client().execute_command("ACL", "DELUSER", "fleet", "fleet-observer")


def refusals(rig: RedisClusterRig) -> list[tuple[object, object]]:
    return [(e.get("reason"), e.get("object")) for node in rig.nodes
            for e in node.client().execute_command("ACL", "LOG")]


def test_the_documented_users_run_fleet_on_a_cluster(acl_cluster: RedisClusterRig, tmp_path: Path,
                                                     processes: Processes) -> None:
    port = acl_cluster.masters()[0].port
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "FLEET_HOME": str(tmp_path / "home"), **TEST_WORKER_ENV,
           "REDIS_URL": f"redis://fleet:fleet-pw@127.0.0.1:{port}/0"}
    env.pop("FLEET_REDIS_CLUSTER", None)
    with (tmp_path / "worker.log").open("wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "worker", "--tier", "chat",
                                   "--worker-id", "chat-acl"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        admin = redis.RedisCluster(host="127.0.0.1", port=port, password=ADMIN_PASSWORD)
        wait_until(lambda: admin.exists(keys.heartbeat("chat-acl")) or worker.poll() is not None, 20,
                   "the worker to register")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
        for args in (["policy", "set", "chat", "concurrency=4"], ["submit", "--user", "bob", "hi"]):
            run = fleet_cli(env, *args, timeout=60)
            assert run.returncode == 0, run.stderr
        observer = {**env, "REDIS_URL": f"redis://fleet-observer:observer-pw@127.0.0.1:{port}/0"}
        run = fleet_cli(observer, "status", timeout=60)
        assert run.returncode == 0, run.stderr
        assert "chat-acl" in run.stdout
        # the commander (its passes read the cluster's epoch: CLUSTER INFO) records the epoch; last:
        # it adopts the worker, and stops it on its way out
        commander = processes.commander(env, "acl")
        try:
            wait_until(lambda: admin.get(keys.RECOVERED) is not None or not commander.alive(), 30,
                       "the commander to record the cluster's epoch")
            assert commander.alive(), commander.tail(2000)
        finally:
            processes.stop_all()
    finally:
        worker.terminate()
        worker.wait(timeout=15)
    assert refusals(acl_cluster) == []


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory,
                certs: Certs) -> Iterator[RedisClusterRig]:  # noqa: F811  (the fixture)
    """3 masters, TLS only (clients, replication and the cluster bus), no replica, the roles'
    ACL: this module's."""
    _require_cluster_tools()
    rig = start_cluster(tmp_path_factory.mktemp("cluster-tls"), masters=3, replicas_per_master=0,
                        tls=Tls(certs.ca, certs.cert, certs.key),
                        passwords=ROLE_PASSWORDS, admin_password=ADMIN_PASSWORD)
    try:
        yield rig
    finally:
        rig.stop()


def test_fleet_runs_on_a_tls_cluster(tls_cluster: RedisClusterRig, tmp_path: Path) -> None:
    """A ``rediss://`` URL of one node (with the CA): detected as a cluster, every node reached
    over TLS (the slot map names TLS ports), a worker serves and the CLI submits, each as its
    role; no node's ACL refused one."""
    url = tls_cluster.plain_url
    assert url.startswith("rediss://")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "FLEET_HOME": str(tmp_path / "home"), **TEST_WORKER_ENV, "REDIS_URL": url, **role_env()}
    env.pop("FLEET_REDIS_CLUSTER", None)
    rc = connect_sync(tls_cluster.url)  # the admin's
    write_policy(rc, "chat", TurnsPolicy())  # a tier by its policy: the client role may not read the registry
    assert is_cluster(rc)
    users = [next(u for u in (f"t{i}" for i in range(1000))
                  if tls_cluster.master_of_slot(key_slot(keys.inbox(u).encode())).port == m.port)
             for m in tls_cluster.masters()]  # one user on each master: every node is used
    with (tmp_path / "worker.log").open("wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "worker", "--tier", "chat", "--worker-id",
                                   "chat-tls"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: rc.exists(keys.heartbeat("chat-tls")) or worker.poll() is not None, 20,
                   "the worker to register")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
        for user in users:
            run = fleet_cli(env, "submit", "--user", user, f"hi {user}", timeout=60)
            assert run.returncode == 0 and run.stdout.startswith(f"echo: hi {user}"), run.stderr
    finally:
        worker.terminate()
        worker.wait(timeout=15)
        rc.close()
    assert cluster_acl_denials(tls_cluster) == []
