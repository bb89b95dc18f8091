"""Erasing a user, retention and the dead letters' byte bound (tests/integration/test_user_delete.py,
test_retention.py, test_dead_letter_bytes.py), run again on the real 3+3 Redis Cluster: the same
test functions, with ``redis_server`` and ``r`` standing for the cluster."""

from __future__ import annotations

import pytest

from tests.cluster.test_pipeline_cluster import r, redis_server  # noqa: F401  (the fixtures)
from tests.integration import test_dead_letter_bytes, test_retention, test_user_delete
from tests.integration.conftest import start_worker  # noqa: F401  (the fixture, on our r)

pytestmark = pytest.mark.integration

for _module in (test_user_delete, test_retention, test_dead_letter_bytes):
    for _name in dir(_module):
        if _name.startswith("test_"):
            globals()[f"{_name}_on_a_cluster"] = getattr(_module, _name)
