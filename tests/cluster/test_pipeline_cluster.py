"""The turn pipeline's integration tests (tests/integration/test_pipeline.py and
test_pipeline_shards.py), run again on the real 3+3 Redis Cluster: the same test functions,
with ``redis_server`` and ``r`` standing for the cluster: the pipeline holds on a Cluster as
on a single node.

Left out, with the reason: ``test_worker_rides_out_a_redis_restart`` restarts the one server
from its AOF (the cluster's counterpart, a master killed and its replica promoted, is
tests/cluster/test_connection.py's failover test and ``scripts/chaos --cluster``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import redis

from stores.connection import connect_sync
from tests.cluster.conftest import RedisClusterRig
from tests.integration import test_pipeline, test_pipeline_shards
from tests.integration.conftest import start_worker  # noqa: F401  (the fixture, on our r)

pytestmark = pytest.mark.integration

SINGLE_NODE_ONLY = {"test_worker_rides_out_a_redis_restart"}


@dataclass(frozen=True)
class ClusterAsServer:
    """What the pipeline tests use of ``redis_server``: the admin's URL, the one without
    credentials, a role's URL, and the port (one master of the cluster: redis-cli -c follows
    MOVED from there), and the admin's client."""

    rig: RedisClusterRig
    port: int

    @property
    def url(self) -> str:
        return self.rig.url

    @property
    def plain_url(self) -> str:
        return self.rig.plain_url

    def role_url(self, role: str) -> str:
        return self.rig.role_url(role)

    def client(self) -> redis.Redis:
        return connect_sync(self.url)


@pytest.fixture
def redis_server(redis_cluster: RedisClusterRig) -> ClusterAsServer:
    return ClusterAsServer(redis_cluster, redis_cluster.masters()[0].port)


@pytest.fixture
def r(rc: redis.Redis) -> redis.Redis:
    return rc  # the tests' client is Fleet's cluster client


for _module in (test_pipeline, test_pipeline_shards):
    for _name in dir(_module):
        if _name.startswith("test_") and _name not in SINGLE_NODE_ONLY:
            globals()[f"{_name}_on_a_cluster"] = getattr(_module, _name)
