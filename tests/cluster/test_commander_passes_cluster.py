"""The commander's scenario tests (tests/integration/test_commander_passes.py: pass by pass on
a virtual clock, simulated workers), run again with their Redis a real 3+3 Redis Cluster: the
same test functions, with ``r`` a cluster client: the scenarios hold on a Cluster as on a
single node."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from stores.connection import connect_sync
from tests.cluster.conftest import RedisClusterRig
from tests.integration import test_commander_passes
from tests.integration.commander_rig import Rig

pytestmark = pytest.mark.integration


@pytest.fixture
def r(rc: redis.Redis) -> redis.Redis:
    return rc  # the tests' client is Fleet's cluster client


@pytest.fixture
def rig(redis_cluster: RedisClusterRig) -> Iterator[Rig]:
    """The scenarios' commander (and its simulated workers), as the commander's role."""
    client = connect_sync(redis_cluster.role_url("fleet-commander"))
    yield Rig(client, concurrency=2)
    client.close()


for _name in dir(test_commander_passes):
    if _name.startswith("test_"):
        globals()[f"{_name}_on_a_cluster"] = getattr(test_commander_passes, _name)
