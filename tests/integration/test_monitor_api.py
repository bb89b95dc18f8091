"""The monitor's HTTP side on aiohttp's test client, against a real redis-server and a real
``Commander`` driven pass by pass (``commander_rig``): every endpoint's JSON, the auth (bearer
header, ``/?token=`` cookie; the read token reads, only the operator token writes), the Host and
Origin checks, the refusal to bind beyond loopback without a token, the standby's answer, error
sections and bad requests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer
from redis.backoff import NoBackoff
from redis.retry import Retry

from commander.metrics import Metrics
from commander.monitor.access import COOKIE, Access, cookie_value
from commander.monitor.api import Monitor
from commander.monitor.server import build_app
from protocol import keys
from protocol.codec import encode
from protocol.deferral import Deferral
from protocol.models import CommanderInfo
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.conftest import free_port
from tests.integration.commander_rig import Rig

pytestmark = pytest.mark.integration
TOKEN = "t0ken-for-tests"
OPERATOR = "0perator-t0ken-for-tests"


@pytest.fixture
def rig(r: redis.Redis) -> Rig:
    """A leading commander whose tier scaled to two workers (a scale-up in the ledger)."""
    write_policy(r, "chat", TurnsPolicy(min_workers=2, max_workers=4, concurrency=4))
    rig = Rig(r, concurrency=4)
    assert rig.campaign()
    rig.run_for(2.0)
    assert len(rig.live()) == 2
    return rig


def _monitor(rig: Rig, r: redis.Redis | None, leading: Callable[[], bool] | None = None) -> Monitor:
    return Monitor(board=rig.commander.board, leading=leading or (lambda: rig.commander.leading),
                   commander_id="c1", r=r, clock=rig.clock.time)


async def _client(app: Any) -> TestClient[Any, Any]:
    client: TestClient[Any, Any] = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest.fixture
async def api(rig: Rig, r: redis.Redis) -> AsyncIterator[TestClient[Any, Any]]:
    client = await _client(build_app(Metrics(), _monitor(rig, r)))
    yield client
    await client.close()


async def _get(client: TestClient[Any, Any], path: str, status: int = 200, **kw: Any) -> Any:
    resp = await client.get(path, **kw)
    assert resp.status == status, await resp.text()
    return await resp.json()


# --- reads ------------------------------------------------------------------------------
async def test_overview_shows_tiers_against_desired_and_target_and_who_leads(
        api: TestClient[Any, Any]) -> None:
    body = await _get(api, "/api/overview")
    assert body["leading"] is True and body["commander"] == "c1"
    (chat,) = [t for t in body["tiers"] if t["tier"] == "chat"]
    assert (chat["ready"], chat["desired"], chat["min_workers"], chat["max_workers"]) == (2, 2, 2, 4)
    assert chat["slots"] == 8 and chat["policy_error"] is None and chat["dead_letters"] == 0
    assert chat["policy"]["concurrency"] == 4 and body["commanders"]["leader"] == "c1"
    assert body["dead_letters_error"] is None


async def test_a_rejected_policy_edit_shows_with_its_reason(api: TestClient[Any, Any], rig: Rig,
                                                             r: redis.Redis) -> None:
    r.set(keys.policy("chat"), b'{"min_workers": 9, "max_workers": 1}')
    rig.step()
    (chat,) = (await _get(api, "/api/overview"))["tiers"]
    assert chat["policy_source"] != "key" and "min_workers" in chat["policy_error"]
    assert chat["min_workers"] == 2  # the last good policy runs


async def test_workers_have_occupancy_history_rates_and_where_they_run(api: TestClient[Any, Any],
                                                                        rig: Rig) -> None:
    rig.runtime.workers[rig.live()[0]].busy = 2
    rig.run_for(2.0)  # more than the evaluator's 6 averaged rows
    rows = (await _get(api, "/api/workers"))["workers"]
    assert sorted(w["worker"] for w in rows) == rig.live()
    busy = next(w for w in rows if w["busy"] == 2)
    assert busy["host"] == "sim" and busy["pid"] >= 10_000 and busy["state"] == "ready"
    assert len(busy["history"]) > 5 and busy["history"][-1] == 50 and busy["slots_use"] == 0.5
    assert (await _get(api, "/api/workers?tier=other"))["workers"] == []


async def test_history_charts_workers_and_demand_from_samples_and_the_ledger(
        api: TestClient[Any, Any], rig: Rig) -> None:
    rig.run_for(6.0)
    body = await _get(api, "/api/history?tier=chat")
    assert body["ledger_error"] is None and body["samples"]
    cols = body["columns"]
    last = dict(zip(cols, body["samples"][-1], strict=True))
    assert (last["ready"], last["desired"]) == (2, 2)
    assert body["since"] == pytest.approx(body["now"] - 3600)


async def test_ledger_lists_scale_events_newest_first_filtered_by_tier(api: TestClient[Any, Any]) -> None:
    body = await _get(api, "/api/ledger?tier=chat")
    actions = [e["action"] for e in body["events"]]
    assert "scale-up" in actions and body["corrupt"] == 0
    assert all(e["tier"] == "chat" for e in body["events"])
    everything = await _get(api, "/api/ledger")
    assert any(e["action"] == "leader" for e in everything["events"])


def _dead(r: redis.Redis, user: str, reason: str = "max attempts (3) reached") -> str:
    fields = {"user": user, "entry": "1-0", "turn_id": f"t-{user}", "reason": reason, "worker": "chat-s0",
              "ts": "1700000000.000", "payload": '{"text": "hi"}'}
    entry = r.xadd(keys.dead("chat"), fields)  # type: ignore[arg-type]
    return entry.decode() if isinstance(entry, bytes) else str(entry)


async def test_dead_letters_list_and_retry_and_purge_through_the_stores(
        api: TestClient[Any, Any], r: redis.Redis) -> None:
    first, second = _dead(r, "alice"), _dead(r, "bob")
    body = await _get(api, "/api/dead-letters?tier=chat")
    assert body["total"] == 2 and [d["id"] for d in body["dead_letters"]] == [second, first]
    row = body["dead_letters"][0]
    assert row["payload"] == {"text": "hi"} and row["user"] == "bob" and row["retriable"] is False

    # entries without the kept turn (an older layout) are reported, and kept
    resp = await api.post("/api/dead-letters/retry", json={"tier": "chat", "ids": [first, "9-9"]})
    got = await resp.json()
    retried = {x["id"]: x["outcome"] for x in got["retried"]}
    assert resp.status == 200 and retried == {first: "not_retriable", "9-9": "unknown"}
    assert got["summary"].startswith("retried 0 of 2; not retried: ")  # what the page shows
    resp = await api.post("/api/dead-letters/purge", json={"tier": "chat", "ids": [first]})
    assert resp.status == 200 and (await resp.json())["purged"] == 1
    resp = await api.post("/api/dead-letters/purge", json={"tier": "chat", "all": True})
    assert resp.status == 200 and (await resp.json())["purged"] == 1
    assert (await _get(api, "/api/dead-letters?tier=chat"))["total"] == 0


async def test_failed_jobs_are_listed_and_requeued_through_rq(api: TestClient[Any, Any], r: redis.Redis,
                                                               fleet_env: dict[str, str]) -> None:
    """A deferred job that failed (no retries left) shows with its error, and Requeue puts it
    back in its queue, as ``fleet jobs failed|requeue``."""
    from stores import rqjobs  # (the rq extra)

    d = Deferral(name="fail_first", kwargs={"times": 9}, queue="writeback", user="alice", turn_id="t1",
                 index=0, ts=time.time())
    assert rqjobs.enqueue(r, d)
    subprocess.run([sys.executable, "-m", "worker.rq.rq_worker", "--queues", "writeback", "--burst"],
                   env=fleet_env, capture_output=True, timeout=60, check=True)  # runs it once: failed
    body = await _get(api, "/api/rq/failed?queue=writeback")
    (job,) = body["jobs"]
    assert job["id"] == d.job_id and job["meta"]["fleet_user"] == "alice" and body["error"] is None
    assert job["error"].startswith("RuntimeError") and "fail_first" in job["description"]
    resp = await api.post("/api/rq/requeue", json={"queue": "writeback", "ids": [d.job_id]})
    assert resp.status == 200 and (await resp.json())["requeued"] == [d.job_id]
    assert r.lrange("rq:queue:writeback", 0, -1) == [d.job_id.encode()]  # queued again
    assert (await _get(api, "/api/rq/failed?queue=writeback"))["jobs"] == []
    # a row the page still showed: 409, naming it, and nothing requeued
    resp = await api.post("/api/rq/requeue", json={"queue": "writeback", "ids": [d.job_id]})
    assert resp.status == 409 and d.job_id in (await resp.json())["error"]
    resp = await api.post("/api/rq/requeue", json={"queue": "writeback", "all": True})
    assert resp.status == 200 and (await resp.json())["requeued"] == []
    assert (await _get(api, "/api/rq/failed", status=400))["error"] == "give a queue: ?queue=<name>"


@pytest.mark.parametrize(("path", "body", "match"), [
    ("/api/rq/requeue", {"queue": "writeback"}, "give the failed jobs' ids"),
    ("/api/rq/requeue", {"queue": "Bad!", "all": True}, "invalid queue"),
    ("/api/dead-letters/retry", {"tier": "chat"}, "give the dead letters' ids"),
    ("/api/dead-letters/purge", {"tier": "Bad!", "all": True}, "invalid tier"),
    ("/api/dead-letters/purge", {"tier": "chat", "ids": ["x"]}, "not a stream entry id"),
])
async def test_dead_letter_actions_refuse_bad_bodies(api: TestClient[Any, Any], path: str,
                                                     body: Any, match: str) -> None:
    resp = await api.post(path, json=body)
    assert resp.status == 400 and match in (await resp.json())["error"]
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    resp = await api.post(path, data="tier=chat&all=1", headers=form)
    assert resp.status == 400 and "application/json" in (await resp.json())["error"]  # no form posts


def _fake_users(monkeypatch: pytest.MonkeyPatch, **funcs: Any) -> None:
    module = types.ModuleType("stores.users")
    for name, fn in funcs.items():
        setattr(module, name, fn)
    monkeypatch.setitem(sys.modules, "stores.users", module)


async def test_population_searches_and_sorts_and_the_user_page(api: TestClient[Any, Any],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    class Usage:
        def __init__(self, user: str, turns: int) -> None:
            self.user, self.turns = user, turns

        def to_json(self) -> dict[str, Any]:
            return {"user": self.user, "tier": "chat", "turns": self.turns, "errors": 0}

    class View:
        def to_json(self) -> dict[str, Any]:
            return {"user": "alice", "lane_holder": "chat-s0", "inbox_after_cursor": 2, "dead_letters": []}

    _fake_users(monkeypatch, active_users=lambda _r, tier, limit=500: [Usage("alice", 3), Usage("bob", 8),
                                                                         Usage("alfred", 5)],
                inspect_user=lambda _r, user: View())
    body = await _get(api, "/api/population?tier=chat&q=al&sort=turns")
    assert [u["user"] for u in body["users"]] == ["alfred", "alice"] and body["total"] == 3
    assert (await _get(api, "/api/population?tier=chat&sort=nope", 400))["error"].startswith("unknown sort")
    user = await _get(api, "/api/users/alice")
    assert user["view"]["lane_holder"] == "chat-s0" and user["view"]["inbox_after_cursor"] == 2
    assert "invalid user id" in (await _get(api, "/api/users/a%20b", 400))["error"]


@pytest.mark.parametrize("path", ["/api/history", "/api/dead-letters", "/api/population",
                                  "/api/ledger?tier=NO", "/api/ledger?count=0"])
async def test_bad_queries_are_400_with_the_reason(api: TestClient[Any, Any], path: str) -> None:
    assert (await _get(api, path, 400))["error"]


# --- errors degrade to a section, never a 500 -------------------------------------------
async def test_redis_away_makes_error_sections_not_a_broken_page(rig: Rig,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    away = redis.Redis(port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5,
                       retry=Retry(NoBackoff(), 0))
    client = await _client(build_app(Metrics(), _monitor(rig, away)))
    try:
        body = await _get(client, "/api/overview")
        assert "error" in body["commanders"] and body["dead_letters_error"]
        assert body["tiers"][0]["ready"] == 2 and body["tiers"][0]["dead_letters"] is None  # from the board
        assert len((await _get(client, "/api/workers"))["workers"]) == 2
        # a read that is all Redis's answers 503 (Redis away or erring), with the reason
        assert "ConnectionError" in (await _get(client, "/api/ledger", 503))["error"]
        assert (await _get(client, "/api/dead-letters?tier=chat", 503))["error"]
        assert (await _get(client, "/api/history?tier=chat"))["ledger_error"]
        _fake_users(monkeypatch, active_users=lambda *a, **k: away.ping())
        assert (await _get(client, "/api/population?tier=chat", 503))["error"]
        resp = await client.post("/api/dead-letters/purge", json={"tier": "chat", "all": True})
        assert resp.status == 503 and (await resp.json())["error"]
    finally:
        await client.close()
        away.close()


async def test_before_the_first_pass_the_page_says_so(r: redis.Redis) -> None:
    rig = Rig(r, concurrency=4)
    client = await _client(build_app(None, _monitor(rig, r, leading=lambda: True)))
    try:
        body = await _get(client, "/api/overview")
        assert body["tiers"] == [] and "not finished a pass" in body["tiers_error"]
        assert "not finished a pass" in (await _get(client, "/api/workers"))["error"]
        assert (await client.get("/metrics")).status == 404  # served without a registry
    finally:
        await client.close()


# --- a standby --------------------------------------------------------------------------
async def test_a_standby_names_the_leader_and_its_monitor_url(rig: Rig, r: redis.Redis) -> None:
    info = CommanderInfo(commander="c1", pid=1, host="h", started=0, role="leader", epoch=1,
                         metrics="127.0.0.1:9999", seen=rig.clock.time())
    r.hset(keys.COMMANDERS, "c1", encode(info))
    standby = Monitor(board=rig.commander.board, leading=lambda: False, commander_id="c2", r=r)
    client = await _client(build_app(Metrics(), standby))
    try:
        body = await _get(client, "/api/overview", 503)
        assert (body["standby"], body["leader"], body["leader_url"]) == ("c2", "c1", "http://127.0.0.1:9999/")
        assert (await client.get("/api/workers")).status == 503
        assert (await client.get("/healthz")).status == 200 and (await client.get("/")).status == 200
    finally:
        await client.close()


# --- the page, /metrics and the token ---------------------------------------------------
async def test_the_page_and_its_assets_are_served_with_a_strict_csp(api: TestClient[Any, Any]) -> None:
    page = await api.get("/")
    text = await page.text()
    assert page.status == 200 and '<script src="/static/app.js">' in text
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    for asset in ("/static/app.js", "/static/style.css"):
        resp = await api.get(asset)
        assert resp.status == 200 and len(await resp.read()) > 1000
    assert (await api.get("/static/../server.py")).status in (403, 404)
    metrics = await api.get("/metrics")
    assert metrics.status == 200 and b"fleet_commander_is_leader" in await metrics.read()


async def test_the_token_guards_everything_and_a_browser_logs_in_once(rig: Rig, r: redis.Redis) -> None:
    client = await _client(build_app(Metrics(), _monitor(rig, r), Access(read_token=TOKEN)))
    try:
        for path in ("/api/overview", "/metrics", "/healthz", "/static/app.js"):
            assert (await client.get(path)).status == 401, path
        page = await client.get("/")
        assert page.status == 401 and "?token=" in await page.text()
        assert (await client.get("/?token=wrong")).status == 401
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert (await client.get("/api/overview", headers=bearer)).status == 200
        login = await client.get(f"/?token={TOKEN}", allow_redirects=False)
        assert login.status == 303 and login.headers["Location"] == "/"
        cookie = login.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
        assert f"{COOKIE}={cookie_value(TOKEN)}" in cookie
        assert (await client.get("/api/overview")).status == 200  # the client keeps the cookie
        assert (await client.get("/")).status == 200
    finally:
        await client.close()


async def test_rq_lists_nothing_without_an_rq_tier(api: TestClient[Any, Any]) -> None:
    assert await _get(api, "/api/rq") == {"tiers": {}, "error": None}


# --- who may write: the operator token; Host and Origin --------------------------------
def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def guarded(rig: Rig, r: redis.Redis) -> AsyncIterator[TestClient[Any, Any]]:
    """The monitor with both tokens: ``TOKEN`` reads, ``OPERATOR`` reads and writes."""
    access = Access(read_token=TOKEN, operator_token=OPERATOR)
    client = await _client(build_app(Metrics(), _monitor(rig, r), access))
    yield client
    await client.close()


ACTIONS = [("/api/dead-letters/retry", {"tier": "chat", "all": True}),
           ("/api/dead-letters/purge", {"tier": "chat", "all": True}),
           ("/api/rq/requeue", {"queue": "writeback", "all": True})]


async def test_posts_need_the_operator_token_and_change_nothing_without_it(
        guarded: TestClient[Any, Any], r: redis.Redis) -> None:
    _dead(r, "alice")
    for path, body in ACTIONS:
        assert (await guarded.post(path, json=body)).status == 401, path
        refused = await guarded.post(path, json=body, headers=_bearer(TOKEN))
        assert refused.status == 403 and "operator token" in (await refused.json())["error"], path
    assert r.xlen(keys.dead("chat")) == 1  # nothing retried, nothing purged
    for token in (TOKEN, OPERATOR):  # the operator token reads too
        assert (await guarded.get("/api/overview", headers=_bearer(token))).status == 200
    done = await guarded.post("/api/dead-letters/purge", json={"tier": "chat", "all": True},
                              headers=_bearer(OPERATOR))
    assert done.status == 200 and (await done.json())["purged"] == 1


async def test_a_browser_logged_in_with_the_read_token_cannot_write(
        guarded: TestClient[Any, Any], r: redis.Redis) -> None:
    _dead(r, "alice")
    assert (await guarded.get(f"/?token={TOKEN}", allow_redirects=False)).status == 303
    assert (await guarded.get("/api/overview")).status == 200
    same = {"Origin": f"http://{guarded.host}:{guarded.port}"}
    refused = await guarded.post("/api/dead-letters/purge", json={"tier": "chat", "all": True}, headers=same)
    assert refused.status == 403 and r.xlen(keys.dead("chat")) == 1
    assert (await guarded.get(f"/?token={OPERATOR}", allow_redirects=False)).status == 303
    done = await guarded.post("/api/dead-letters/purge", json={"tier": "chat", "all": True}, headers=same)
    assert done.status == 200 and r.xlen(keys.dead("chat")) == 0


async def test_a_foreign_origin_cannot_post_even_with_the_operator_token(
        guarded: TestClient[Any, Any], r: redis.Redis) -> None:
    _dead(r, "alice")
    assert guarded.port is not None
    for origin in ("http://evil.example", "null", f"http://{guarded.host}:{guarded.port + 1}"):
        resp = await guarded.post("/api/dead-letters/purge", json={"tier": "chat", "all": True},
                                  headers={**_bearer(OPERATOR), "Origin": origin})
        assert resp.status == 403 and "origin" in (await resp.json())["error"], origin
    assert r.xlen(keys.dead("chat")) == 1


async def test_without_a_token_only_loopback_hosts_and_same_origin_posts_pass(
        api: TestClient[Any, Any], r: redis.Redis) -> None:
    """The open default serves loopback only; a DNS-rebound name reaches it with its own Host."""
    for host in ("evil.example", "evil.example:9464", "10.0.0.5:9464"):
        for path in ("/", "/api/overview", "/metrics"):
            assert (await api.get(path, headers={"Host": host})).status == 421, (host, path)
    for host in ("localhost:9464", "127.0.0.1", "[::1]:9464"):
        assert (await api.get("/api/overview", headers={"Host": host})).status == 200, host
    _dead(r, "alice")
    foreign = await api.post("/api/dead-letters/purge", json={"tier": "chat", "all": True},
                             headers={"Origin": "http://evil.example"})
    assert foreign.status == 403 and r.xlen(keys.dead("chat")) == 1
    same = await api.post("/api/dead-letters/purge", json={"tier": "chat", "all": True},
                          headers={"Origin": f"http://{api.host}:{api.port}"})
    assert same.status == 200 and r.xlen(keys.dead("chat")) == 0


async def test_an_allowed_host_passes_and_may_post_from_its_origin(rig: Rig, r: redis.Redis) -> None:
    client = await _client(build_app(Metrics(), _monitor(rig, r), Access(allowed_hosts=("fleet.internal",))))
    try:
        named = {"Host": "fleet.internal:8080"}
        assert (await client.get("/api/overview", headers=named)).status == 200
        assert (await client.get("/api/overview", headers={"Host": "other.internal"})).status == 421
        _dead(r, "alice")
        resp = await client.post("/api/dead-letters/purge", json={"tier": "chat", "all": True},
                                 headers={**named, "Origin": "https://fleet.internal"})
        assert resp.status == 200 and r.xlen(keys.dead("chat")) == 0
    finally:
        await client.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_the_commander_will_not_bind_beyond_loopback_without_a_token(host: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_COMMANDER_")}
    done = subprocess.run([sys.executable, "-m", "commander", "--metrics-host", host,
                           "--redis-url", f"redis://127.0.0.1:{free_port()}/0"],
                          capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "FLEET_COMMANDER_OPERATOR_TOKEN" in lines[0] and host in lines[0], lines
    assert "Traceback" not in done.stderr
