"""A real ``fleet worker`` as in a pod: its /readyz and /livez, its wait for SIGTERM after a drain by
command, and its drain on SIGTERM within the pod's terminationGracePeriodSeconds (on the stand-in:
a turn that fits in the grace is finished, one that does not is killed with its pod and run again
on another, answered once)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.codec import decode
from protocol.models import Control, WorkerInfo
from protocol.policy import turns_policy
from stores.control import send_control
from stores.policies import write_policy
from stores.takeover import take_over
from tests.conftest import free_port
from tests.integration.conftest import FAST_WORKER_ENV, wait_until
from tests.k8s.cluster import Ended
from tests.k8s.conftest import DEPLOYMENT, answered_once, fleet_command, running_and_ready
from tests.k8s.standin import StandIn

pytestmark = pytest.mark.integration
POD = "fleet-worker-chat-5f7c9d8b6-abcde"


def probe(port: int, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def pod_worker(fleet_env: dict[str, str], r: redis.Redis,
               tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """One worker started as the manifests start it: its pod's name and node in the environment,
    the health endpoint on a port. Stopped (by pid) after the test."""
    port = free_port()
    env = {**fleet_env, **FAST_WORKER_ENV, "FLEET_WORKER_POD_NAME": POD, "FLEET_WORKER_NODE_NAME": "node-9",
           "FLEET_WORKER_HEALTH_PORT": str(port), "FLEET_WORKER_HEALTH_HOST": "127.0.0.1"}
    with (tmp_path / "worker.log").open("wb") as out:
        proc = subprocess.Popen([*fleet_command(), "worker", "--tier", "chat"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_ready_once_registered_alive_while_beating_and_waits_for_sigterm_after_a_drain(pod_worker, r):
    proc, port = pod_worker

    def answers() -> tuple[int, dict[str, object]] | None:
        try:
            return probe(port, "/readyz")
        except OSError:  # not listening yet
            return None

    status, body = wait_until(lambda: (got := answers()) and got[0] == 200 and got, 20, "/readyz 200")
    assert body == {"ok": True, "why": "registered and reading", "worker": POD}
    assert probe(port, "/livez")[0] == 200
    info = decode(WorkerInfo, r.hget(keys.WORKERS, POD))
    assert (info.worker, info.runtime, info.pod) == (POD, "kubernetes", POD)
    assert info.node == info.host == "node-9"

    send_control(r, POD, Control(kind="drain", ts=time.time(), reason="reclaim-idle"), maxlen=10)
    wait_until(lambda: not r.hexists(keys.WORKERS, POD), 10, "the drained worker to leave the registry")
    assert probe(port, "/readyz") == (503, {"ok": False, "why": "draining", "worker": POD})
    assert probe(port, "/livez")[0] == 200  # lingering, not wedged: the kubelet must not restart it
    assert proc.poll() is None  # it waits for the SIGTERM of its pod's deletion
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


LONG = turns_policy(handler="sleep", handler_options={"sleep_ms": 1500}, concurrency=2, report_interval_s=0.3)


def test_sigterm_drains_within_the_grace_period_and_a_kill_at_its_end_loses_no_turn(
        standin: StandIn, make_runtime, r, redis_server):
    write_policy(r, "chat", LONG)
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=3, grace_s=10)
    running_and_ready(standin, 3)
    runtime = make_runtime()
    runtime.reap()
    with Fleet(redis_server.url) as fleet:
        handles = [fleet.submit("u1", "fits in the grace")]
        holder = holder_of(r, "u1")
        started = time.monotonic()
        with standin.cluster.lock:
            standin.cluster.delete_pod(holder)  # kubectl delete pod: SIGTERM, SIGKILL after 10 s
        answered_once(r, fleet, handles, timeout=30)
        standin.wait_for(lambda c: holder in c.ended, 15, "the pod gone")
        assert standin.cluster.ended[holder] == Ended(0, killed=False, restarts=0)
        assert time.monotonic() - started < 10  # the turn in flight finished, the worker exited

        handles = [fleet.submit("u2", "longer than the grace")]
        holder = holder_of(r, "u2")
        # the holder may be the first pod's replacement, created since the runtime's last listing:
        # list now (a pod born and gone between two listings is never seen; its registry entry's
        # heartbeat expiry is what hands its users on then, as for any worker not the runtime's)
        runtime.adopt()
        with standin.cluster.lock:
            standin.cluster.delete_pod(holder, grace_s=1)  # SIGKILL after 1 s: mid-turn
        standin.wait_for(lambda c: holder in c.ended, 15, "the pod killed")
        assert standin.cluster.ended[holder].killed
        exits = wait_until(lambda: [h for h in runtime.reap() if h.worker_id == holder], 10, "its exit seen")
        assert not exits[0].drained  # its registry entry is left: the commander takes its users over
        take_over(r, "chat", holder, 100)  # (as the commander does for such an exit: commander.dead_workers)
        (reply,) = answered_once(r, fleet, handles, timeout=30)  # run again on another pod
        assert reply.worker != holder and reply.attempts == 2


def holder_of(r: redis.Redis, user: str) -> str:
    """The worker whose turn of ``user`` is in its handler (it holds the user's lane)."""
    lane = wait_until(lambda: r.get(keys.lane(user)), 10, f"a turn of {user} started")
    return bytes(lane).decode().split("|")[0]
