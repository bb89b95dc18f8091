"""The monitor at 10,000 workers over 50 tiers: a real ``Commander`` on a real redis-server
judges a simulated registry (a runtime that starts nothing: the workers run "elsewhere"), and
what the page reads at each refresh (``/api/overview`` and one page of ``/api/workers``) stays
the same size as at 1,000 workers. The worker list pages through every worker exactly once, in
a stable order, filtered by tier."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer

from commander.commander import Commander
from commander.metrics import Metrics
from commander.monitor.access import Access
from commander.monitor.api import Monitor
from commander.monitor.server import build_app, serve
from commander.settings import CommanderSettings
from tests.browser_driver import Browser
from tests.integration.test_status_scale import TIERS, populate
from tests.unit.commander_helpers import RecordingRuntime

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
LIVE = 9_000  # of the 10,000 registered workers, those with a heartbeat (``populate``)


def _judged(r: redis.Redis, workers: int) -> Monitor:
    """The monitor of a leading commander that judged ``workers`` registered workers (one pass)."""
    r.flushall()
    populate(r, workers)
    settings = CommanderSettings(commander_id="c1", metrics_port=None, always_tiers=(), lease_ttl_ms=600_000)
    cmd = Commander(r, RecordingRuntime(), settings)
    assert cmd.campaign()
    cmd.pass_once(time.time())
    seen = cmd.board.seen
    assert seen is not None and len(seen.tiers) == len(TIERS)
    return Monitor(board=cmd.board, leading=lambda: cmd.leading, commander_id="c1", r=r)


async def _served(r: redis.Redis, workers: int) -> TestClient[Any, Any]:
    """``_judged``'s monitor on aiohttp's test server."""
    client: TestClient[Any, Any] = TestClient(TestServer(build_app(Metrics(), _judged(r, workers))))
    await client.start_server()
    return client


async def _get(client: TestClient[Any, Any], path: str, status: int = 200) -> tuple[Any, int]:
    resp = await client.get(path)
    body = await resp.read()
    assert resp.status == status, body[:500]
    return await resp.json(), len(body)


async def _refresh_bytes(client: TestClient[Any, Any]) -> int:
    """What the open page reads every refresh but the tier charts (one per tier, not per worker)."""
    return sum([(await _get(client, path))[1] for path in ("/api/overview", "/api/workers")])


@pytest.fixture
async def big(r: redis.Redis) -> AsyncIterator[tuple[TestClient[Any, Any], int]]:
    """The monitor of 10,000 workers, and the bytes of a refresh at 1,000."""
    client = await _served(r, 1_000)
    small = await _refresh_bytes(client)
    await client.close()
    client = await _served(r, 10_000)
    yield client, small
    await client.close()


async def test_a_refresh_does_not_grow_with_the_workers(big: tuple[TestClient[Any, Any], int]) -> None:
    client, small = big
    large = await _refresh_bytes(client)
    print(f"monitor refresh (overview + workers): {small:,} bytes at 1,000 workers, {large:,} at 10,000")
    assert large - small < 3_000, (small, large)  # only digits grow (counts per tier)
    overview, _ = await _get(client, "/api/overview")
    assert overview["workers_total"] == LIVE  # the pass's workers: the dead ones it forgot
    t03 = next(t for t in overview["tiers"] if t["tier"] == "t03")
    assert t03["workers"] == LIVE // len(TIERS) and t03["ready"] + t03["starting"] + t03["draining"] == 180


async def test_pages_hold_every_worker_once_in_order_and_a_tier_filter(
        big: tuple[TestClient[Any, Any], int]) -> None:
    client, _ = big
    first, _ = await _get(client, "/api/workers")
    assert len(first["workers"]) == 100 and (first["offset"], first["limit"]) == (0, 100)
    assert first["total"] == LIVE and first["next_offset"] == 100
    seen, offset = [], 0
    while offset is not None:
        page, _ = await _get(client, f"/api/workers?offset={offset}&limit=5000")  # capped at 1,000
        assert len(page["workers"]) <= 1_000 and page["limit"] == 1_000
        seen += [(w["tier"], w["worker"]) for w in page["workers"]]
        offset = page["next_offset"]
    assert len(seen) == len(set(seen)) == LIVE and seen == sorted(seen)
    t07, _ = await _get(client, "/api/workers?tier=t07&offset=150&limit=100")
    assert t07["total"] == 180 and t07["next_offset"] is None
    assert [w["tier"] for w in t07["workers"]] == ["t07"] * 30
    for bad in ("offset=-1", "offset=x", "limit=0", "tier=no%20such"):
        await _get(client, f"/api/workers?{bad}", 400)


ROWS = "document.querySelectorAll('#workers tbody tr[data-worker]')"
COUNT = "document.querySelector('#workers-count').textContent"


@pytest.mark.browser
def test_the_page_shows_one_page_of_workers_and_pages_and_filters(r: redis.Redis, browser: Browser) -> None:
    server, (host, port) = serve(None, _judged(r, 1_000), "127.0.0.1", 0, Access())
    try:
        browser("open", url=f"http://{host}:{port}/")
        browser("wait", js=f"{ROWS}.length === 100 && {COUNT} === '(1–100 of 900)'", timeout=30000)
        assert browser("eval", js="document.querySelector('#workers-prev').disabled")["value"] is True
        browser("click", selector="#workers-next")
        browser("wait", js=f"{COUNT} === '(101–200 of 900)' && {ROWS}[0].dataset.worker === 't05-w00605'")
        browser("eval", js="(() => { const s = document.querySelector('#workers-tier'); s.value = 't03';"
                           " s.dispatchEvent(new Event('change')); })()")
        browser("wait", js=f"{COUNT} === '(18)' && "
                           f"[...{ROWS}].every(tr => tr.dataset.worker.startsWith('t03-'))")
        assert browser("eval", js="document.querySelector('#workers-next').disabled")["value"] is True
        assert browser("errors")["errors"] == []  # no script error, no CSP violation
    finally:
        server.stop()
