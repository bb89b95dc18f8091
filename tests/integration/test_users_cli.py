"""``fleet user U`` and the stores behind it: one user as an operator sees it, and the
population of a tier, against a real redis-server and a real worker."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from stores.users import active_users, inspect_user
from tests.helpers import fleet_cli
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


SLOW_MS = 8000  # the turn that holds ann's lane while both views of it are read


def fleet_cli_both(env: dict[str, str], cwd: Path,
                   *runs: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Several ``fleet`` commands at once: each is an interpreter start (seconds on a loaded
    machine), and they must all see the lane the slow turn holds."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda argv: fleet_cli(env, *argv, cwd=cwd), runs))


def test_fleet_user_shows_the_lane_holder_inbox_session_and_pending(r, redis_server, start_worker,
                                                                   fleet_env, tmp_path):
    write_policy(r, "chat", TurnsPolicy(handler="sleep", handler_options={"sleep_ms": 1}))
    w = start_worker()
    fleet = Fleet(redis_server.role_url("fleet-client"))
    first = fleet.submit("ann", "hello there")
    assert first.result(10).ok
    slow = fleet.submit("ann", "slow one", meta={"sleep_ms": SLOW_MS})
    queued = [fleet.submit("ann", f"then {i}") for i in range(2)]
    wait_until(lambda: r.get(keys.lane("ann")), 10, "the worker to take ann's lane")
    r.xadd(keys.dead("chat"), {"user": "ann", "entry": "1-0", "turn_id": "t-old", "reason": "boom"})
    r.xadd(keys.dead("chat"), {"user": "someone-else", "reason": "boom"})

    out, text = fleet_cli_both(fleet_env, tmp_path, ["user", "ann", "--json"],
                               ["user", "ann", "--tier", "chat"])
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert view["lane_holder"] == w.worker_id and 0 < view["lane_ttl_ms"] <= 2000
    assert view["inbox_after_cursor"] == 3 and view["inbox_exact"]  # the slow one is not committed yet
    assert [e["text"] for e in view["session"]] == ["hello there"]
    assert view["pending"] == ["chat"]  # its job keeps the notification pending until it ends
    assert view["usage"]["turns"] == 1 and view["usage"]["chars_in"] == len("hello there")
    dead = [(d["turn_id"], d["reason"], d["retriable"]) for d in view["dead_letters"]]
    assert dead == [("t-old", "boom", False)]

    assert text.returncode == 0, text.stderr
    assert f"lane     held by {w.worker_id}" in text.stdout
    assert "inbox    3 turn(s) queued after the cursor" in text.stdout
    assert "hello there" in text.stdout and "pending  notification in: chat" in text.stdout

    assert slow.result(SLOW_MS / 1000 + 10).ok and all(h.result(10).ok for h in queued)
    # the worker gives the lane up, then acks the notification it served: wait for both
    wait_until(lambda: not r.exists(keys.lane("ann")) and not inspect_user(r, "ann").pending, 10,
               "the lane's release and the notification's ack")
    done = inspect_user(r, "ann")
    assert (done.lane_holder, done.inbox_after_cursor, done.pending) == (None, 0, [])
    assert len(done.session) == 4 and done.cursor
    pop = active_users(r, "chat")
    assert [(u.user, u.turns, u.errors) for u in pop] == [("ann", 4, 0)]
    assert pop[0].chars_out > 0 and pop[0].last_active_ts > 0
    assert pop[0].handler_ms >= SLOW_MS  # the slow turn slept in its handler: the worker counts it


def test_an_undelivered_notification_is_pending_and_bad_ids_are_usage_errors(r, fleet_env, tmp_path):
    r.xgroup_create(keys.ready("chat"), keys.GROUP, id="0", mkstream=True)
    r.xadd(keys.inbox("zed"), {"text": "waiting"})
    r.xadd(keys.ready("chat"), {"user": "zed"})
    view = inspect_user(r, "zed", tiers=["chat", "gpu"])
    assert (view.pending, view.pending_partial, view.inbox_after_cursor) == (["chat"], [], 1)
    assert view.lane_holder is None and view.cursor == "" and view.session == []
    assert inspect_user(r, "nobody").pending == []

    for argv, why in ((["user", "a b"], "invalid user id"),
                      (["user", "ann", "--tier", "Bad"], "invalid tier"), (["user"], "required")):
        out = fleet_cli(fleet_env, *argv, cwd=tmp_path)
        assert out.returncode == 2 and why in out.stderr and len(out.stderr.splitlines()) == 1, (argv, out)


def test_active_users_newest_first_with_a_limit(r: redis.Redis):
    r.zadd(keys.active("chat"), {"u1": 100.0, "u2": 300.0, "u3": 200.0, "bad}{id": 400.0})
    r.hset(keys.usage("u2"), mapping={"turns": 5, "errors": 1, "chars_in": 10, "chars_out": 20})
    got = active_users(r, "chat", limit=3)
    assert [u.user for u in got] == ["u2", "u3"]  # the bad member is skipped, not a key
    u2 = got[0]
    assert (u2.turns, u2.errors, u2.chars_in, u2.chars_out, u2.handler_ms) == (5, 1, 10, 20, 0)
    assert active_users(r, "chat", limit=0) == []
