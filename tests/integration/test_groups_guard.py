"""The rollout guard end to end, and each group's pool scaled on its own demand: a real commander
(process runtime) and real workers on a private redis-server, under a load of many users.

A tier splits its users 75/25 between ``blue`` and a canary ``green`` whose handler fails each
turn's first attempt (the retry answers it). Under load the guard sees green's error rate over
its window and aborts it: green's weight goes to 0 with the reason in the ledger, and the next
turns of green's users are served by blue, each after its last green turn. Every turn is
answered once and in order, and while both groups served, each pool's worker count followed its
own demand: blue, with three times the users, ran more workers than green, and green, once its
users were gone, was scaled back to its minimum.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from commander.runtime.process import ProcessRuntime
from fleet.client import Fleet
from protocol import keys
from protocol.codec import decode
from protocol.groups import assign
from protocol.models import SessionEntry
from protocol.policy import parse_policy
from stores.policies import read_policy, write_policy
from stores.registry import read_registry
from tests.helpers import ledger
from tests.integration.conftest import wait_until, wait_workers_saw

pytestmark = pytest.mark.integration
USERS = [f"user-{i}" for i in range(24)]
SPLIT = [("blue", 75.0), ("green", 25.0)]
SLEEP = {"sleep_ms": 250}
POLICY: dict[str, Any] = {
    "min_workers": 0, "report_interval_s": 0.5, "concurrency": 4, "users_per_instance": 4,
    "scale_down_stabilization_s": 2, "active_window_s": 5,
    "canary": "green",
    "rollout_guard": {"window_s": 30, "min_turns": 8, "error_rate_margin": 0.2, "latency_margin": None},
    "groups": [
        {"name": "blue", "weight": 75, "handler": "sleep", "handler_options": SLEEP,
         "min_workers": 1, "max_workers": 6},
        {"name": "green", "weight": 25, "handler": "sleep", "handler_options": {**SLEEP, "fail_attempts": 1},
         "min_workers": 1, "max_workers": 6}]}


class PoolCounts(threading.Thread):
    """Samples each pool's live workers (the registry) every 0.1 s until stopped."""

    def __init__(self, r: redis.Redis) -> None:
        super().__init__(daemon=True)
        self.r, self.stop, self.samples = r, threading.Event(), list[tuple[float, dict[str, int]]]()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            counts: dict[str, int] = {}
            for info, alive in read_registry(self.r).workers.values():
                if alive:
                    counts[info.tier] = counts.get(info.tier, 0) + 1
            self.samples.append((time.monotonic(), counts))

    def peak(self, pool: str, since: float = 0.0, until: float = float("inf")) -> int:
        return max((c.get(pool, 0) for t, c in self.samples if since <= t <= until), default=0)

    def last(self, pool: str) -> int:
        return self.samples[-1][1].get(pool, 0)


def pools(r: redis.Redis) -> set[str]:
    return {info.tier for info, alive in read_registry(r).workers.values() if alive}


def test_the_guard_aborts_a_failing_canary_under_load_and_each_pool_follows_its_demand(
        redis_server: Any, r: redis.Redis, process_commander: ProcessRuntime) -> None:
    write_policy(r, "chat", parse_policy(POLICY))
    wait_until(lambda: {"chat.blue", "chat.green"} <= pools(r), 60, "a worker in each group")
    green_users = {u for u in USERS if assign(u, SPLIT) == "green"}
    assert 0 < len(green_users) < len(USERS) / 2
    counts = PoolCounts(r)
    counts.start()
    client = Fleet(redis_server.role_url("fleet-client"))
    served: dict[str, list[str]] = {u: [] for u in USERS}  # each user's turns: the pool that served it
    rounds = 0
    try:
        loaded = time.monotonic()
        while not ledger(r, None, "rollout-abort"):  # rounds of one turn per user, all submitted at once
            assert rounds < 40, "the guard did not abort the failing canary"
            for h in client.submit_many([(u, f"{u} turn {rounds}") for u in USERS]):
                reply = h.result(timeout=60)
                assert reply.ok and reply.text == f"slept: {h.user} turn {rounds}", reply
                served[h.user].append(reply.worker.rpartition("-")[0])
            rounds += 1
        aborted = time.monotonic()
        (abort,) = ledger(r, None, "rollout-abort")
        assert abort.tier == "chat" and "canary green aborted: error rate" in abort.reason, abort.reason
        assert read_policy(r, "chat").policy.rollout.weights() == (("blue", 100.0), ("green", 0.0))
        wait_workers_saw(process_commander, r, "groups of chat now blue 100, green 0",
                         "every worker to see the abort")
        client.reread_policies()
        for n in range(rounds, rounds + 3):  # after the abort: everyone on blue
            for h in client.submit_many([(u, f"{u} turn {n}") for u in USERS]):
                reply = h.result(timeout=60)
                assert reply.ok and reply.text == f"slept: {h.user} turn {n}", reply
                served[h.user].append(reply.worker.rpartition("-")[0])
        try:
            wait_until(lambda: counts.last("chat.green") == 1, 60, "green back to its minimum")
        finally:
            print("green's workers, a sample a second:",
                  [c.get("chat.green", 0) for _t, c in counts.samples[::10]])
    finally:
        counts.stop.set()
        counts.join(timeout=5)
        client.close()

    for u in USERS:  # every turn answered once, in order; a green user moved once, to blue for good
        rows = r.lrange(keys.session(u), 0, -1)
        texts = [decode(SessionEntry, raw).text for raw in rows]
        assert texts == [f"{u} turn {n}" for n in range(rounds + 3)], (u, texts)
        assert served[u][-3:] == ["chat.blue"] * 3, (u, served[u])
        if u in green_users:
            first_blue = served[u].index("chat.blue")
            assert set(served[u][:first_blue]) == {"chat.green"}, (u, served[u])
            assert set(served[u][first_blue:]) == {"chat.blue"}, (u, served[u])
        else:
            assert set(served[u]) == {"chat.blue"}, (u, served[u])
    blue_peak = counts.peak("chat.blue", loaded, aborted)
    green_peak = counts.peak("chat.green", loaded, aborted)
    print(f"\nrounds before the abort: {rounds}; peak workers under load: blue {blue_peak}, "
          f"green {green_peak}")
    # each pool sized on its own users (4 per worker): blue's 18 want 5, green's 6 want 2
    assert blue_peak >= 4 and 1 <= green_peak <= 3 and blue_peak > green_peak, (blue_peak, green_peak)
