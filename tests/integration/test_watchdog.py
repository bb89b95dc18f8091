"""A worker whose event loop is blocked (a blocking call in an async handler) exits on its
watchdog, and the commander replaces it and hands its user on.

The worker runs with 30 s leases and a 30 s reclaim idle rule and is its tier's only worker
(``max_workers`` 1), so neither a lease's expiry, a reclaim nor another worker can explain the
user's turn answered within seconds: only the watchdog's exit, and the commander's takeover and
respawn after it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from fleet.client import Fleet
from protocol import keys
from protocol.models import EXIT_STUCK
from protocol.policy import turns_policy
from stores.policies import write_policy
from tests.helpers import Processes, ledger, live_workers, running, wait_until

pytestmark = pytest.mark.integration

LEASE_S = 30.0
STUCK_AFTER_S = 3.0
ENV = {
    "FLEET_WORKER_LANE_TTL_MS": str(int(LEASE_S * 1000)),
    "FLEET_WORKER_RECLAIM_IDLE_MS": str(int(LEASE_S * 1000)),
    "FLEET_WORKER_RECLAIM_INTERVAL_S": "0.3",
    "FLEET_WORKER_STUCK_AFTER_S": str(STUCK_AFTER_S),
}


def policy(**options: float) -> bytes:
    return turns_policy(handler="sleep", handler_options={"sleep_ms": 50, **options}, concurrency=2,
                        min_workers=1, max_workers=1, report_interval_s=0.3)


def test_a_worker_with_a_blocked_loop_exits_and_is_replaced(r, redis_server, start_commander,
                                                           processes: Processes):
    write_policy(r, "chat", policy(block_loop_ms=10 * LEASE_S * 1000))
    start_commander(env=ENV)
    (stuck,) = wait_until(lambda: live_workers(r, "chat"), 30, "the tier's worker")
    fleet = Fleet(redis_server.role_url("fleet-client"))
    first = fleet.submit("alice", "first")

    # in the handler: the lane is taken and the attempt counted, then the loop blocks
    wait_until(lambda: any(k.startswith(b"att:") for k in r.hkeys(keys.state("alice"))), 15, "the handler")
    blocked_at = time.monotonic()
    write_policy(r, "chat", policy())  # the replacement runs the same handler without the block

    wait_until(lambda: not running(stuck.pid), STUCK_AFTER_S + 10, "the stuck worker to exit", every=0.02)
    exited = time.monotonic() - blocked_at
    reply = first.result(timeout=LEASE_S)
    answered = time.monotonic() - blocked_at
    second = fleet.submit("alice", "second").result(timeout=LEASE_S)
    next_turn = time.monotonic() - blocked_at
    # (the replacement waits 1 s more here: a worker that exits within 10 s of its start counts
    # toward its pool's crash loop, commander.runtime.process.crashloop)
    print(f"\nblocked loop: the worker exited {exited:.2f}s after the block (stuck_after_s "
          f"{STUCK_AFTER_S:g}), its turn was answered by the replacement at {answered:.2f}s "
          f"({answered - exited:.2f}s after the exit) and the user's next turn at "
          f"{next_turn:.2f}s (lease {LEASE_S:.0f} s)")

    # (the loop's last turn may precede the block by a bump's interval, and the block our look)
    assert STUCK_AFTER_S - 1 <= exited < STUCK_AFTER_S + 3
    assert reply.ok and reply.text == "slept: first" and reply.worker != stuck.worker
    assert reply.attempts == 2  # re-run from the cursor by the replacement
    assert second.ok and second.text == "slept: second"
    assert answered < LEASE_S / 2, f"answered {answered:.1f}s after the block: that is the lease"
    (event,) = [e for e in ledger(r, "chat", "worker-exited") if e.victims == [stuck.worker]]
    assert f"code {EXIT_STUCK} (its event loop was stuck)" in event.reason
    assert event.why["takeover"]["users"] == 1
    worker_log = (processes.dir / "logs" / f"{stuck.worker}.log").read_text()
    (line,) = [line for line in worker_log.splitlines() if "event loop stuck for" in line]
    assert f"exiting with code {EXIT_STUCK}" in line and "in sleep" in line  # where: the handler
    fleet.close()


HUNG_AFTER_S = 2.0


def test_a_stopped_worker_is_killed_and_replaced(r, redis_server, start_commander):
    """A worker whose process lives but whose heartbeat is gone (SIGSTOP: its watchdog is stopped
    with it) holds the only slot until the commander kills it, by the pid it started."""
    write_policy(r, "chat", policy())
    start_commander(env={**ENV, "FLEET_WORKER_HEARTBEAT_TTL_MS": "1000",
                         "FLEET_COMMANDER_HUNG_AFTER_S": str(HUNG_AFTER_S)})
    (stopped,) = wait_until(lambda: live_workers(r, "chat"), 30, "the tier's worker")
    fleet = Fleet(redis_server.role_url("fleet-client"))
    assert fleet.submit("alice", "first").result(timeout=15).worker == stopped.worker
    os.kill(stopped.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_until(lambda: not running(stopped.pid), 30, "the stopped worker to be killed", every=0.02)
        killed = time.monotonic() - stopped_at
        reply = fleet.submit("alice", "second").result(timeout=LEASE_S)
        answered = time.monotonic() - stopped_at
    finally:
        if running(stopped.pid):
            os.kill(stopped.pid, signal.SIGCONT)
    print(f"\nSIGSTOP: killed {killed:.2f}s after the stop (heartbeat TTL 1 s, hung_after_s "
          f"{HUNG_AFTER_S:g}), the user's next turn answered by the replacement at {answered:.2f}s")

    assert reply.ok and reply.text == "slept: second" and reply.worker != stopped.worker
    assert killed < 1 + HUNG_AFTER_S + 3
    (event,) = [e for e in ledger(r, "chat", "worker-exited") if e.victims == [stopped.worker]]
    assert "was killed" in event.reason and "heartbeat missing for" in event.reason
    fleet.close()
