"""Metrics: values after the commander's calls, gone workers removed, the HTTP endpoint and its token."""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import pytest

from commander.decide import Plan
from commander.metrics import Metrics, busy_workers, sample, series
from commander.monitor.access import Access
from commander.snapshot import TierSnapshot, WorkerView


def _views() -> tuple[WorkerView, ...]:
    return (
        WorkerView("chat-a", occupancy=0.25, busy=1, total=4),
        WorkerView("chat-b", occupancy=0.75, busy=3, total=4),
        WorkerView("chat-c", state="draining", occupancy=0.1, busy=1, total=4),
        WorkerView("chat-d", state="starting", total=4),
        WorkerView("chat-e", occupancy=0.0, busy=2, total=4, fresh=False),
    )


def _observe(m: Metrics, pressure_total: int = 7) -> None:
    snap = TierSnapshot("chat", _views(), active_users=12, backlog=5, pressure_events=2)
    plan = Plan("chat", current=4, desired=5, target=6)
    m.observe_tier("chat", snap, plan, running=3, starting=1, pressure_total=pressure_total)


@pytest.fixture
def m() -> Iterator[Metrics]:
    metrics = Metrics()
    yield metrics
    metrics.stop()


def test_observe_tier_sets_every_tier_gauge(m: Metrics) -> None:
    _observe(m)
    chat = {"tier": "chat"}
    assert sample(m, "fleet_tier_desired_workers", chat) == 5
    assert sample(m, "fleet_tier_target_workers", chat) == 6
    assert sample(m, "fleet_tier_running_workers", chat) == 3
    assert sample(m, "fleet_tier_starting_workers", chat) == 1
    assert sample(m, "fleet_tier_draining_workers", chat) == 1
    assert sample(m, "fleet_tier_backlog", chat) == 5
    assert sample(m, "fleet_tier_active_users", chat) == 12
    assert sample(m, "fleet_tier_busy_slots", chat) == 7
    assert sample(m, "fleet_tier_slots", chat) == 20
    # Σ busy/total over fresh ready workers: 1/4 + 3/4; draining, starting and stale ones do not count
    assert sample(m, "fleet_tier_busy_workers", chat) == pytest.approx(1.0)
    assert sample(m, "fleet_tier_pressure_events_total", chat) == 7


def test_busy_workers_counts_workers_worth_of_slots() -> None:
    views = [WorkerView(f"w{i}", busy=1, total=4) for i in range(3)]
    assert busy_workers(views) == pytest.approx(0.75)
    assert busy_workers([WorkerView("z", busy=0, total=0)]) == 0


def test_pressure_counter_follows_the_commanders_total(m: Metrics) -> None:
    _observe(m, pressure_total=3)
    _observe(m, pressure_total=10)
    assert sample(m, "fleet_tier_pressure_events_total", {"tier": "chat"}) == 10
    _observe(m, pressure_total=2)  # the commander restarted its count: a counter reset
    assert sample(m, "fleet_tier_pressure_events_total", {"tier": "chat"}) == 2


def test_observe_workers_sets_occupancy_and_removes_gone_workers(m: Metrics) -> None:
    m.observe_workers("chat", _views())
    m.observe_workers("batch", [WorkerView("batch-a", occupancy=0.5, busy=1, total=2)])
    assert sample(m, "fleet_worker_occupancy", {"tier": "chat", "worker": "chat-b"}) == 0.75
    assert sample(m, "fleet_worker_busy_slots", {"tier": "chat", "worker": "chat-b"}) == 3
    m.observe_workers("chat", [WorkerView("chat-a", occupancy=0.5), WorkerView("chat-f", occupancy=0.9)])
    workers = {s["worker"] for s in series(m, "fleet_worker_occupancy")}
    assert workers == {"chat-a", "chat-f", "batch-a"}  # gone chat workers removed, other tier untouched
    assert {s["worker"] for s in series(m, "fleet_worker_busy_slots")} == workers
    assert sample(m, "fleet_worker_occupancy", {"tier": "chat", "worker": "chat-a"}) == 0.5
    assert b'worker="chat-b"' not in m.render()
    m.observe_workers("chat", [])
    assert {s["worker"] for s in series(m, "fleet_worker_occupancy")} == {"batch-a"}


def test_scale_events_decide_leader_and_policy(m: Metrics) -> None:
    m.scale_event("chat", "up")
    m.scale_event("chat", "up")
    m.scale_event("chat", "down")
    assert sample(m, "fleet_scale_events_total", {"tier": "chat", "direction": "up"}) == 2
    assert sample(m, "fleet_scale_events_total", {"tier": "chat", "direction": "down"}) == 1
    with pytest.raises(ValueError):
        m.scale_event("chat", "sideways")  # type: ignore[arg-type]
    m.decide_seconds(0.002)
    m.decide_seconds(0.004)
    assert sample(m, "fleet_decide_seconds_count") == 2
    assert sample(m, "fleet_decide_seconds_sum") == pytest.approx(0.006)
    assert sample(m, "fleet_decide_seconds_bucket", {"le": "0.0025"}) == 1
    m.is_leader(True)
    assert sample(m, "fleet_commander_is_leader") == 1
    m.is_leader(False)
    assert sample(m, "fleet_commander_is_leader") == 0
    m.policy_rejected("chat", True)
    assert sample(m, "fleet_policy_rejected", {"tier": "chat"}) == 1
    m.policy_rejected("chat", False)
    assert sample(m, "fleet_policy_rejected", {"tier": "chat"}) == 0


def test_forget_tier_removes_its_series(m: Metrics) -> None:
    _observe(m)
    m.observe_workers("chat", _views())
    m.scale_event("chat", "up")
    m.policy_rejected("chat", True)
    m.observe_workers("batch", [WorkerView("batch-a")])
    m.forget_tier("chat")
    assert b'tier="chat"' not in m.render()
    assert sample(m, "fleet_worker_occupancy", {"tier": "batch", "worker": "batch-a"}) == 0


def test_each_metrics_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()  # would raise "Duplicated timeseries" on a shared registry
    a.is_leader(True)
    assert sample(a, "fleet_commander_is_leader") == 1
    assert sample(b, "fleet_commander_is_leader") == 0


# --- the HTTP endpoint ----------------------------------------------------------------
def _get(host: str, port: int, path: str, token: str | None = None) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type") or ""
    finally:
        conn.close()


def test_serve_binds_loopback_by_default_and_serves_metrics(m: Metrics) -> None:
    _observe(m)
    host, port = m.serve()
    assert host == "127.0.0.1"
    assert port > 0
    status, body, ctype = _get(host, port, "/metrics")
    assert status == 200
    assert ctype.startswith("text/plain")
    assert b'fleet_tier_desired_workers{tier="chat"} 5.0' in body
    assert _get(host, port, "/healthz")[:2] == (200, b"ok\n")
    assert _get(host, port, "/nope")[0] == 404
    with pytest.raises(RuntimeError):
        m.serve()


def test_token_is_required_when_set(m: Metrics) -> None:
    host, port = m.serve(access=Access(read_token="s3cret"))
    assert _get(host, port, "/metrics")[0] == 401
    assert _get(host, port, "/metrics", token="wrong")[0] == 401
    assert _get(host, port, "/healthz")[0] == 401
    status, body, _ = _get(host, port, "/metrics", token="s3cret")
    assert status == 200
    assert b"fleet_commander_is_leader" in body
    assert _get(host, port, "/healthz", token="s3cret")[0] == 200


def test_every_interface_needs_a_token(m: Metrics) -> None:
    with pytest.raises(ValueError, match="FLEET_COMMANDER_OPERATOR_TOKEN"):
        m.serve("0.0.0.0")
    host, port = m.serve("0.0.0.0", access=Access(operator_token="s3cret"))
    assert host == "0.0.0.0"
    assert _get("127.0.0.1", port, "/healthz", token="s3cret")[0] == 200


def test_stop_closes_the_port(m: Metrics) -> None:
    host, port = m.serve()
    m.stop()
    with pytest.raises(OSError):
        _get(host, port, "/healthz")
    m.stop()  # idempotent
    host, port = m.serve()  # and it can serve again
    assert _get(host, port, "/healthz")[0] == 200
