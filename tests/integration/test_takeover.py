"""Fast takeover on real processes: a worker SIGKILLed mid-handler, its user served at once.

The workers run with 30 s leases and a 30 s XAUTOCLAIM idle rule, so neither the lane's
expiry nor a reclaim can explain a turn answered within seconds: only the commander, which
sees the process exit, clears the dead worker's lanes and hands its notifications on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.codec import decode
from protocol.models import LedgerEvent, SessionEntry, WorkerInfo
from protocol.policy import turns_policy
from stores.policies import write_policy
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration

LEASE_S = 30.0
LONG_LEASES = {
    "FLEET_WORKER_LANE_TTL_MS": str(int(LEASE_S * 1000)),
    "FLEET_WORKER_RECLAIM_IDLE_MS": str(int(LEASE_S * 1000)),
    "FLEET_WORKER_RECLAIM_INTERVAL_S": "0.3",
    "FLEET_WORKER_HOUSEKEEPING_INTERVAL_S": "1",
}
HANDLER_MS = 1500


def registry(r: redis.Redis) -> dict[str, WorkerInfo]:
    return {i.worker: i for i in (decode(WorkerInfo, b) for b in r.hgetall(keys.WORKERS).values())}


def live(r: redis.Redis) -> list[str]:
    return [w for w in registry(r) if r.exists(keys.heartbeat(w))]


def consumer_names(r: redis.Redis) -> set[str]:
    return {c["name"].decode() for c in r.xinfo_consumers(keys.ready("chat"), keys.GROUP)}


@pytest.fixture
def commander(fleet_env: dict[str, str], r: redis.Redis,
              tmp_path: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Factory: a commander whose workers have long leases; it and its workers stopped after."""
    procs: list[subprocess.Popen[bytes]] = []
    pids: set[int] = set()

    def start() -> subprocess.Popen[bytes]:
        with (tmp_path / "commander.log").open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "commander", "--commander-id", "c1", "--no-metrics",
                 "--interval", "0.2", "--log-dir", str(tmp_path / "logs"), "--stop-workers-on-exit"],
                env={**fleet_env, **LONG_LEASES}, stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        wait_until(lambda: r.get(keys.LEADER) or proc.poll() is not None, 15, "a leader")
        assert proc.poll() is None, (tmp_path / "commander.log").read_text()[-3000:]
        return proc

    yield start
    pids.update(i.pid for i in registry(r).values())
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    pids.update(i.pid for i in registry(r).values())
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"worker processes left behind: {left}"


def test_sigkill_mid_handler_is_taken_over_long_before_the_lease_expires(r, redis_server, commander):
    write_policy(r, "chat", turns_policy(handler="sleep", handler_options={"sleep_ms": HANDLER_MS},
                                         concurrency=2, min_workers=2, max_workers=2, report_interval_s=0.3))
    commander()
    wait_until(lambda: len(live(r)) == 2, 30, "two workers")
    fleet = Fleet(redis_server.url)
    handle = fleet.submit("alice", "are you there?")

    # mid-handler: the lane is taken and the attempt counted (the pull precedes the handler)
    owner = wait_until(lambda: (r.get(keys.lane("alice")) or b"").decode().split("|")[0], 15, "a lane")
    wait_until(lambda: any(k.startswith(b"att:") for k in r.hkeys(keys.state("alice"))), 5, "the handler")
    assert owner in consumer_names(r)
    os.kill(registry(r)[owner].pid, signal.SIGKILL)
    killed_at = time.monotonic()

    wait_until(lambda: owner not in consumer_names(r), LEASE_S, "the dead consumer to go", every=0.01)
    taken = time.monotonic() - killed_at
    reply = handle.result(timeout=LEASE_S)
    took = time.monotonic() - killed_at
    print(f"\ntaken over {taken:.2f}s and answered {took:.2f}s after the SIGKILL "
          f"(handler {HANDLER_MS} ms, lease {LEASE_S:.0f} s)")

    assert reply.ok and reply.text == "slept: are you there?"
    assert reply.worker != owner and reply.attempts == 2  # re-run from the cursor elsewhere
    assert took < LEASE_S / 2, f"answered {took:.1f}s after the kill: that is the lease, not a takeover"
    assert owner not in consumer_names(r)  # the dead consumer is gone from XINFO CONSUMERS
    lane = r.get(keys.lane("alice"))  # read once: the survivor may let it go between two reads
    assert lane is None or not lane.startswith(owner.encode())
    events = [decode(LedgerEvent, f[b"m"]) for _id, f in r.xrange(keys.EVENTS)]
    (event,) = [e for e in events if e.action == "worker-exited" and e.victims == [owner]]
    assert event.why["takeover"]["users"] == 1 and event.why["takeover"]["lanes_cleared"] == 1
    assert event.why["takeover"]["consumer_removed"] and f"worker {owner} exited" in event.reason
    session = [decode(SessionEntry, raw).text for raw in r.lrange(keys.session("alice"), 0, -1)]
    assert session == ["are you there?"]  # exactly once
    wait_until(lambda: r.xpending(keys.ready("chat"), keys.GROUP)["pending"] == 0, 10,
               "the new owner to ack once it released the lane")
    fleet.close()
