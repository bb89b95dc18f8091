"""The backlog signal on a real worker and Redis: jobs in progress are not backlog.

A worker keeps the notifications of its jobs pending, and claims them to itself every renew,
until the jobs end. The commander's backlog (and ``fleet status``) must count only turns no
worker has started: what is undelivered, and what a dead worker left pending.
"""

from __future__ import annotations

import time

import pytest
import redis

from commander.observe import Observer
from fleet.client import Fleet
from fleet.status import tier_backlog
from protocol import keys
from protocol.policy import turns_policy
from stores.policies import write_policy
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration

N = 3  # users the worker is busy on: exactly its concurrency


def observed(r: redis.Redis) -> int:
    """The backlog as the commander reads it in a pass: registry first, then the signals."""
    obs = Observer(r)
    obs.registry()
    return obs.tier_signals(["chat"], {"chat": 60.0}, time.time())["chat"].backlog


def held_by(r: redis.Redis, worker: str) -> int:
    try:
        consumers = r.xinfo_consumers(keys.ready("chat"), keys.GROUP)
    except redis.ResponseError:
        return 0
    return sum(int(c["pending"]) for c in consumers if c["name"].decode() == worker)


def test_jobs_in_progress_are_not_backlog(r, redis_server, start_worker):
    write_policy(r, "chat", turns_policy(handler="sleep", handler_options={"sleep_ms": 60_000}, concurrency=N,
                                         users_per_instance=None, report_interval_s=0.5))
    w = start_worker("chat", env={"FLEET_WORKER_HEARTBEAT_TTL_MS": "1500"})
    fleet = Fleet(redis_server.role_url("fleet-client"))
    try:
        for i in range(N):
            fleet.submit(f"busy{i}", "think hard")
        wait_until(lambda: held_by(r, w.worker_id) == N, 20, f"the worker to start {N} jobs")

        # over several renews (0.4 s: the worker claims its pending entries to itself again),
        # every job in progress stays out of the backlog (sampled for 2 s: that nothing changes
        # over time is the thing under test)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert observed(r) == 0
            time.sleep(0.2)
        assert tier_backlog(r, "chat") == {"lag": 0, "pending": N, "in_progress": N, "backlog": 0}

        # a turn the full worker has not read is backlog: only it
        fleet.submit("waiting", "me next")
        wait_until(lambda: tier_backlog(r, "chat")["lag"] == 1, 10, "the new notification")
        assert observed(r) == 1
        assert tier_backlog(r, "chat") == {"lag": 1, "pending": N, "in_progress": N, "backlog": 1}

        # SIGKILLed, the worker stays a consumer of the group with its entries pending: once its
        # heartbeat is gone no one serves them, and they are backlog again
        w.kill()
        wait_until(lambda: not r.exists(keys.heartbeat(w.worker_id)), 10, "the heartbeat to expire")
        assert held_by(r, w.worker_id) == N
        assert observed(r) == N + 1
        assert tier_backlog(r, "chat") == {"lag": 1, "pending": N, "in_progress": 0, "backlog": N + 1}
    finally:
        fleet.close()


def test_lag_unknown_after_a_deletion_counts_what_is_not_pending(r):
    """Real Redis reports no lag once an undelivered entry was XDELed; the reader estimates it
    from the entries that are not pending, still leaving a live worker's jobs out."""
    ready = keys.ready("chat")
    r.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    ids = [r.xadd(ready, {"user": f"u{i}"}) for i in range(5)]
    r.xreadgroup(keys.GROUP, "w1", {ready: ">"}, count=2)
    r.xdel(ready, ids[3])
    assert r.xinfo_groups(ready)[0]["lag"] is None
    assert tier_backlog(r, "chat", live={"w1"}) == {"lag": 2, "pending": 2, "in_progress": 2, "backlog": 2}
