"""bench_peers gives Fleet's client the connection ``AsyncFleet(url)`` builds for its users
(Fleet's packer, its retries), as every peer's client library is measured as it comes."""

from __future__ import annotations

import asyncio
import sys

from stores.connection import _connection_class
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

from bench_peers import FleetDriver  # noqa: E402  (after the path)


def test_fleet_s_client_in_the_harness_is_the_one_fleet_builds() -> None:
    url = "redis://127.0.0.1:1/0"  # (never connected)
    driver = FleetDriver(url)
    try:
        assert driver.fleet.r.connection_pool.connection_class is _connection_class(url, is_async=True)
    finally:
        asyncio.run(driver.close())
