"""A real Redis Cluster for tests: 3 masters + 3 replicas of ``redis-server`` on free loopback
ports, built once per session (it takes a few seconds), emptied before each test. The rig
itself is scripts/cluster_rig.py; its names are importable from here as before.

Every process is ours, started and stopped by pid; never the machine's 6379. A test may kill a
master (SIGKILL) and wait for its replica's promotion; the node is started again afterwards
(it rejoins as a replica), so the next test finds 3 masters + 3 replicas again.

Every node runs the roles' ACL file with the single servers' passwords (tests/conftest.py):
``url`` is the admin's (the tests' own clients), ``role_url(role)`` a Fleet process's. A
refusal of a Fleet role by the ACL of any node (``ACL LOG``) fails the test, unless it is
marked ``acl_denials``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

import pytest
import redis

from stores.cluster import is_cluster
from stores.connection import connect_sync
from tests.conftest import ADMIN_PASSWORD, ROLE_PASSWORDS, ROOT, _require_redis_server, acl_denial

# the rig lives with the scripts (scripts/chaos --cluster starts one too); the scripts are
# imported as top-level modules, as the chaos tests import chaos_check
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

from cluster_rig import (  # noqa: E402  (after the path)
    NODE_TIMEOUT_MS,
    ClusterNode,
    RedisClusterRig,
    Tls,
    _bindable,
    cluster_port,
    start_cluster,
)

__all__ = ["NODE_TIMEOUT_MS", "ClusterNode", "RedisClusterRig", "Tls", "_bindable", "_require_cluster_tools",
           "cluster_port", "redis_cluster", "redis_cluster_rig", "start_cluster"]


def _require_cluster_tools() -> None:
    _require_redis_server()
    if shutil.which("redis-cli"):
        return
    msg = "redis-cli is not installed (it comes with redis-server / redis-tools)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def redis_cluster_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterRig]:
    """3 masters + 3 replicas for the session; every process stopped (by pid) at the end."""
    _require_cluster_tools()
    rig = start_cluster(tmp_path_factory.mktemp("cluster"), passwords=ROLE_PASSWORDS,
                        admin_password=ADMIN_PASSWORD)
    print(f"\nRedis Cluster of 6 nodes up in {rig.started_in_s:.2f} s")
    try:
        yield rig
    finally:
        rig.stop()


@pytest.fixture
def redis_cluster(redis_cluster_rig: RedisClusterRig, monkeypatch: pytest.MonkeyPatch,
                  request: pytest.FixtureRequest) -> Iterator[RedisClusterRig]:
    """The session's cluster, whole again (a node killed by the last test restarted) and empty;
    ``FLEET_REDIS_CLUSTER`` unset, so detection is what is tested. After the test, a refusal
    of a Fleet role by any live node's ACL fails it, unless it is marked ``acl_denials``."""
    monkeypatch.delenv("FLEET_REDIS_CLUSTER", raising=False)
    if redis_cluster_rig.killed:
        redis_cluster_rig.heal()
    redis_cluster_rig.flush()
    for node in redis_cluster_rig.nodes:
        with node.client() as c:
            c.acl_log_reset()
    yield redis_cluster_rig
    if request.node.get_closest_marker("acl_denials") is None:
        denials = cluster_acl_denials(redis_cluster_rig)
        assert not denials, f"the ACL refused a Fleet role: {denials}"


def cluster_acl_denials(rig: RedisClusterRig) -> list[str]:
    """The refusals of a Fleet role in the ``ACL LOG`` of every live node (a paused one resumed
    by its test), each ``<port>: <user> <reason> <object>``."""
    out = []
    for node in rig.nodes:
        if not node.alive:
            continue
        with node.client(timeout=10) as c:
            out += [f"{node.port}: {acl_denial(e)}" for e in c.acl_log()
                    if e.get("username") in ROLE_PASSWORDS]
    return out


@pytest.fixture
def rc(redis_cluster: RedisClusterRig) -> Iterator[redis.Redis]:
    """The admin's client of the cluster by Fleet's connection (``stores.connection.connect_sync``,
    detected from the URL): the test's own reads and setup."""
    client = connect_sync(redis_cluster.url)
    assert is_cluster(client)
    yield client
    client.close()
