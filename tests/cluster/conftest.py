"""A real Redis Cluster for tests: 3 masters + 3 replicas of ``redis-server`` on free loopback
ports, built once per session (it takes a few seconds), emptied before each test. The rig
itself is scripts/cluster_rig.py; its names are importable from here as before.

Every process is ours, started and stopped by pid; never the machine's 6379. A test may kill a
master (SIGKILL) and wait for its replica's promotion; the node is started again afterwards
(it rejoins as a replica), so the next test finds 3 masters + 3 replicas again.
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
from tests.conftest import ROOT, _require_redis_server

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
    rig = start_cluster(tmp_path_factory.mktemp("cluster"))
    print(f"\nRedis Cluster of 6 nodes up in {rig.started_in_s:.2f} s")
    try:
        yield rig
    finally:
        rig.stop()


@pytest.fixture
def redis_cluster(redis_cluster_rig: RedisClusterRig,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[RedisClusterRig]:
    """The session's cluster, whole again (a node killed by the last test restarted) and empty;
    ``FLEET_REDIS_CLUSTER`` unset, so detection is what is tested."""
    monkeypatch.delenv("FLEET_REDIS_CLUSTER", raising=False)
    if redis_cluster_rig.killed:
        redis_cluster_rig.heal()
    redis_cluster_rig.flush()
    yield redis_cluster_rig


@pytest.fixture
def rc(redis_cluster: RedisClusterRig) -> Iterator[redis.Redis]:
    """Fleet's client of the cluster (``stores.connection.connect_sync``, detected from the URL)."""
    client = connect_sync(redis_cluster.url)
    assert is_cluster(client)
    yield client
    client.close()
