"""Fast takeover on real processes: a worker SIGKILLed mid-handler, its user served at once.

The workers run with 30 s leases and a 30 s XAUTOCLAIM idle rule, so neither the lane's
expiry nor a reclaim can explain a turn answered within seconds: only the commander, which
sees the process exit, clears the dead worker's lanes and hands its notifications on.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.codec import decode
from protocol.models import SessionEntry
from protocol.policy import turns_policy
from stores.policies import write_policy
from tests.helpers import ledger, live_workers, wait_until

pytestmark = pytest.mark.integration

LEASE_S = 30.0
LONG_LEASES = {
    "FLEET_WORKER_LANE_TTL_MS": str(int(LEASE_S * 1000)),
    "FLEET_WORKER_RECLAIM_IDLE_MS": str(int(LEASE_S * 1000)),
    "FLEET_WORKER_RECLAIM_INTERVAL_S": "0.3",
    "FLEET_WORKER_HOUSEKEEPING_INTERVAL_S": "1",
}
HANDLER_MS = 1500


def consumer_names(r: redis.Redis) -> set[str]:
    return {c["name"].decode() for c in r.xinfo_consumers(keys.ready("chat"), keys.GROUP)}


def test_sigkill_mid_handler_is_taken_over_long_before_the_lease_expires(r, redis_server, start_commander):
    write_policy(r, "chat", turns_policy(handler="sleep", handler_options={"sleep_ms": HANDLER_MS},
                                         concurrency=2, min_workers=2, max_workers=2, report_interval_s=0.3))
    start_commander(env=LONG_LEASES)
    wait_until(lambda: len(live_workers(r)) == 2, 30, "two workers")
    fleet = Fleet(redis_server.role_url("fleet-client"))
    handle = fleet.submit("alice", "are you there?")

    # mid-handler: the lane is taken and the attempt counted (the pull precedes the handler)
    owner = wait_until(lambda: (r.get(keys.lane("alice")) or b"").decode().split("|")[0], 15, "a lane")
    wait_until(lambda: any(k.startswith(b"att:") for k in r.hkeys(keys.state("alice"))), 5, "the handler")
    assert owner in consumer_names(r)
    (pid,) = [w.pid for w in live_workers(r) if w.worker == owner]
    os.kill(pid, signal.SIGKILL)
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
    (event,) = [e for e in ledger(r, None, "worker-exited") if e.victims == [owner]]
    assert event.why["takeover"]["users"] == 1 and event.why["takeover"]["lanes_cleared"] == 1
    assert event.why["takeover"]["consumer_removed"] and f"worker {owner} exited" in event.reason
    session = [decode(SessionEntry, raw).text for raw in r.lrange(keys.session("alice"), 0, -1)]
    assert session == ["are you there?"]  # exactly once
    wait_until(lambda: r.xpending(keys.ready("chat"), keys.GROUP)["pending"] == 0, 10,
               "the new owner to ack once it released the lane")
    fleet.close()
