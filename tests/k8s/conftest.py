"""Fixtures of the ``kubernetes`` runtime's tests: the stand-in API server (``standin.py``) whose
pods are real ``fleet worker`` processes on the test's own redis-server, and the runtime talking
to it through the official client over HTTP."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from fleet.client import Fleet, TurnHandle
from protocol import keys
from protocol.codec import decode
from protocol.models import Reply, SessionEntry
from tests.conftest import RedisServer
from tests.helpers import fleet_argv as fleet_command  # (test_worker_pod.py imports it from here)
from tests.integration.conftest import FAST_WORKER_ENV, wait_until
from tests.k8s.cluster import Cluster
from tests.k8s.standin import StandIn

try:
    from kubernetes import client
except ImportError:  # the k8s extra is missing: scripts/test installs it; CI must not skip
    if os.environ.get("CI"):
        raise
    pytest.skip("the kubernetes client is not installed (pip install -e '.[k8s]')", allow_module_level=True)

from commander.runtime.kubernetes.api import KubeApi
from commander.runtime.kubernetes.runtime import KubernetesRuntime

NAMESPACE = "fleet"
DEPLOYMENT = "fleet-worker-chat"


@pytest.fixture
def standin(fleet_env: dict[str, str], r: redis.Redis, tmp_path: Path) -> Iterator[StandIn]:
    """The stand-in, serving namespace ``fleet``; its pods' processes are killed (by process
    group) when the test ends."""
    cluster = Cluster(NAMESPACE, tmp_path, {**fleet_env, **FAST_WORKER_ENV}, fleet_command())
    stand = StandIn(cluster)
    stand.start()
    try:
        yield stand
    finally:
        stand.stop()


def api_for(stand: StandIn) -> KubeApi:
    """The runtime's API calls on the official client, pointed at the stand-in."""
    return KubeApi(client.ApiClient(client.Configuration(host=stand.url)), NAMESPACE)


@pytest.fixture
def make_runtime(standin: StandIn, redis_server: RedisServer) -> Iterator[Callable[..., KubernetesRuntime]]:
    """Factory of runtimes on the stand-in (listing every 0.1 s, checking autoscalers every 1 s);
    ``api``: the calls to make instead of ``api_for(standin)``'s."""
    made: list[KubernetesRuntime] = []

    def make(api: Any = None, **kwargs: Any) -> KubernetesRuntime:
        kwargs = {"poll_s": 0.1, "check_ttl_s": 1.0, **kwargs}
        runtime = KubernetesRuntime(api or api_for(standin), redis_server.client(), **kwargs)
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.close()


def answered_once(r: redis.Redis, fleet: Fleet, handles: list[TurnHandle], timeout: float) -> list[Reply]:
    """Every turn's reply (all ok), each turn once in its user's session and no second reply
    waiting: no turn lost, none answered twice."""
    replies = fleet.results(handles, timeout=timeout)
    assert all(rep.ok for rep in replies), [rep for rep in replies if not rep.ok]
    for h in handles:
        assert r.llen(keys.reply(h.user, h.turn_id)) == 0, f"a second reply to {h.turn_id}"
        session = [decode(SessionEntry, raw).turn_id for raw in r.lrange(keys.session(h.user), 0, -1)]
        assert session.count(h.turn_id) == 1, (h.turn_id, session)
    return replies


def running_and_ready(stand: StandIn, n: int, timeout: float = 30) -> list[str]:
    """Wait until the namespace has ``n`` pods, every one Running and Ready (its /readyz said 200);
    return their names."""
    def ready(cluster: Cluster) -> list[str]:
        pods = [p for p in cluster.pods.values() if not p["metadata"].get("deletionTimestamp")]
        ok = [p["metadata"]["name"] for p in pods if p["status"]["phase"] == "Running"
              and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])]
        return sorted(ok) if len(ok) == len(pods) == n else []

    return list(stand.wait_for(ready, timeout, f"{n} pods Running and Ready"))


def listed_ready(runtime: KubernetesRuntime, tier: str, n: int, timeout: float = 30) -> None:
    """Wait until the runtime's own listing has ``n`` pods of ``tier``, every one Ready. A retire
    judges the pods from that listing (up to ``poll_s`` old, or older while the API errs), not
    from the cluster: one it still lists as not ready is deleted in the victim's place."""
    def ready() -> bool:
        runtime.reap()
        pods = runtime.listing.live_pods(tier)
        return len(pods) == n and all(p.ready for p in pods)

    wait_until(ready, timeout, f"the runtime to list {n} ready pods of {tier}")
