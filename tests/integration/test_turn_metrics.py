"""Turn metrics end to end: real workers serve turns on a real Redis, their reports carry the
counts, and the commander's /metrics shows them per tier, kept as workers come and go."""

from __future__ import annotations

import time

import pytest
import redis

from commander.commander import Commander
from commander.metrics import Metrics, sample
from fleet.client import Fleet
from stores.policies import write_policy
from tests.integration.conftest import wait_until
from tests.integration.test_commander import policy
from tests.unit.commander_helpers import RecordingRuntime, leading

pytestmark = pytest.mark.integration


def one_worker(**over: object) -> object:
    # one worker per tier, never scaled; every first attempt fails (a retry per turn)
    return policy(min_workers=1, max_workers=1, report_interval_s=0.1,
                  **{"handler_options": {"sleep_ms": 10, "fail_attempts": 1}, **over})


def commander(r: redis.Redis) -> tuple[Commander, Metrics, RecordingRuntime]:
    """A leading commander whose runtime starts nothing: the test's own worker processes serve
    (registered, not the runtime's)."""
    metrics, runtime = Metrics(), RecordingRuntime()
    # the test runs the passes by hand, with work in between (workers stopped and started): a
    # lease of the default 3 s runs out on a loaded machine, and a pass then does nothing
    cmd = leading(r, runtime, metrics, commander_id="cm", interval_s=0.2, always_tiers=("chat",),
                  lease_ttl_ms=600_000)
    return cmd, metrics, runtime


def passes_until(cmd: Commander, metrics: Metrics, name: str, labels: dict[str, str], want: float) -> None:
    """Run passes until a sample reaches ``want`` (the reports come every 0.1 s)."""
    def reached() -> bool:
        cmd.pass_once(time.time())
        return sample(metrics, name, labels) == want
    wait_until(reached, 20, f"{name}{labels} == {want} (now {sample(metrics, name, labels)})", every=0.1)


def hist(metrics: Metrics, name: str, tier: str) -> tuple[float | None, float | None]:
    return (sample(metrics, f"fleet_turn_{name}_seconds_count", {"tier": tier}),
            sample(metrics, f"fleet_turn_{name}_seconds_sum", {"tier": tier}))


def test_metrics_count_the_turns_workers_served_and_keep_them_when_workers_go(r, redis_server,
                                                                               start_worker):
    write_policy(r, "chat", one_worker())
    write_policy(r, "dl", one_worker(max_attempts=2, handler_options={"sleep_ms": 10, "fail_attempts": 9}))
    chat_a = start_worker(worker_id="chat-a")
    start_worker(tier="dl", worker_id="dl-a")
    fleet = Fleet(redis_server.role_url("fleet-client"))
    handles = fleet.submit_many([(f"u{i}", f"turn {i}") for i in range(10)])
    failing = fleet.submit_many([(f"d{i}", f"turn {i}") for i in range(4)], tier="dl")
    assert all(rep.ok and rep.attempts == 2 for rep in fleet.results(handles, timeout=30))
    assert not any(rep.ok for rep in fleet.results(failing, timeout=30))

    cmd, m, runtime = commander(r)
    chat, dl = {"tier": "chat"}, {"tier": "dl"}
    passes_until(cmd, m, "fleet_turns_total", {**chat, "result": "ok"}, 10)
    passes_until(cmd, m, "fleet_turns_total", {**dl, "result": "error"}, 4)
    assert sample(m, "fleet_turns_total", {**chat, "result": "error"}) == 0
    assert sample(m, "fleet_turns_total", {**dl, "result": "ok"}) == 0
    assert sample(m, "fleet_turn_retries_total", chat) == 10  # attempt 2 of each turn
    assert sample(m, "fleet_turn_retries_total", dl) == 4
    assert sample(m, "fleet_dead_letters_total", chat) == 0
    assert sample(m, "fleet_dead_letters_total", dl) == 4
    assert sample(m, "fleet_fenced_total", chat) == 0
    # queue wait: one per turn (its first attempt); handler: every call; latency: every reply
    assert hist(m, "queue_wait", "chat")[0] == 10 and hist(m, "queue_wait", "dl")[0] == 4
    assert hist(m, "handler", "chat")[0] == 20 and hist(m, "handler", "dl")[0] == 8
    latency_count, latency_sum = hist(m, "latency", "chat")
    assert latency_count == 10 and hist(m, "latency", "dl")[0] == 4
    handler_sum = hist(m, "handler", "chat")[1]
    assert handler_sum is not None and latency_sum is not None and latency_sum >= handler_sum >= 10 * 0.01
    assert sample(m, "fleet_turn_latency_seconds_bucket", {**chat, "le": "+Inf"}) == 10
    assert b'fleet_turns_total{result="ok",tier="chat"} 10.0' in m.render()

    # the worker goes, a new one (a new id) serves more: the tier's counters only grow
    chat_a.proc.terminate()
    chat_a.proc.wait(timeout=15)
    start_worker(worker_id="chat-b")
    more = fleet.submit_many([(f"v{i}", f"more {i}") for i in range(5)])
    assert all(rep.ok for rep in fleet.results(more, timeout=30))
    passes_until(cmd, m, "fleet_turns_total", {**chat, "result": "ok"}, 15)
    assert sample(m, "fleet_turn_retries_total", chat) == 15
    assert hist(m, "handler", "chat")[0] == 30 and hist(m, "queue_wait", "chat")[0] == 15
    assert runtime.spawned == []  # the workers the test started served every turn
