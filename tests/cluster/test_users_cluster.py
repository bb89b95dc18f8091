"""The user view, dead-letter retry and purge (tests/integration/test_users_cli.py and
test_dead_letter_retry.py), run again on the real 3+3 Redis Cluster: the same test functions,
with ``redis_server`` and ``r`` standing for the cluster, the CLI pointed at it by URL."""

from __future__ import annotations

import pytest

from tests.cluster.test_pipeline_cluster import r, redis_server  # noqa: F401  (the fixtures)
from tests.integration import test_dead_letter_retry, test_users_cli
from tests.integration.conftest import start_worker  # noqa: F401  (the fixture, on our r)

pytestmark = pytest.mark.integration

for _module in (test_dead_letter_retry, test_users_cli):
    for _name in dir(_module):
        if _name.startswith("test_"):
            globals()[f"{_name}_on_a_cluster"] = getattr(_module, _name)
