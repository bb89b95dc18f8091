"""The ``kubernetes`` runtime against the stand-in API server: spawn, retire, refusals, Pending.

Every pod is a real ``fleet worker`` process on the test's redis-server. A wait is for a
condition of the stand-in (under its lock) or of Redis, with a deadline; nothing sleeps.
"""

from __future__ import annotations

import pytest
import redis

from commander import __main__ as commander_main
from commander.runtime import Lifecycle, Refused, WorkerHandle
from commander.runtime.kubernetes.api import ApiException
from commander.runtime.kubernetes.runtime import KubernetesRuntime
from commander.settings import CommanderSettings
from fleet.client import Fleet
from protocol import keys
from protocol.models import WorkerInfo
from protocol.policy import turns_policy
from stores.policies import write_policy
from stores.registry import read_entries
from tests.integration.conftest import wait_until
from tests.k8s.cluster import Ended
from tests.k8s.conftest import DEPLOYMENT, answered_once, api_for, listed_ready, running_and_ready
from tests.k8s.semantics import deletion_order
from tests.k8s.standin import StandIn

pytestmark = pytest.mark.integration


def registered(r: redis.Redis) -> dict[str, WorkerInfo]:
    """Registered workers with a live heartbeat, by id."""
    infos, _ = read_entries(r)
    return {i.worker: i for i in infos if r.exists(keys.heartbeat(i.worker))}


def states(runtime, tier: str = "chat") -> dict[str, Lifecycle]:
    runtime.reap()
    return {h.worker_id: h.state for h in runtime.list() if h.tier == tier}


def test_spawn_raises_replicas_and_placeholders_count_until_pods_register(standin: StandIn, make_runtime, r):
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
    runtime = make_runtime()
    ids = runtime.spawn("chat", 2)

    assert len(ids) == 2 and all(i.startswith(f"{DEPLOYMENT}:starting-") for i in ids)
    assert standin.cluster.deployments[DEPLOYMENT]["spec"]["replicas"] == 2
    # the pods do not exist yet, or are Pending: two starting workers either way (anti-windup)
    assert [h.state for h in runtime.live("chat")] == [Lifecycle.STARTING] * 2
    standin.wait_for(lambda c: len(c.pods) == 2, 10, "two pods")
    def both_running() -> list[str]:
        running = sorted(w for w, s in states(runtime).items() if s is Lifecycle.RUNNING)
        return running if running == sorted(standin.cluster.pods) else []

    running = wait_until(both_running, 30, "both pods registered and running")
    infos = registered(r)
    for pod in running:
        assert infos[pod].runtime == "kubernetes" and infos[pod].pod == pod
        assert infos[pod].host == infos[pod].node == standin.cluster.pods[pod]["spec"]["nodeName"]
    assert len(runtime.live("chat")) == 2  # the placeholders gave way to the pods


def test_spawn_is_refused_while_an_hpa_targets_the_deployment(standin: StandIn, make_runtime):
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
        standin.cluster.add_autoscaler("hpa", "chat-hpa", DEPLOYMENT)
    runtime = make_runtime()
    why = runtime.refusal("chat")
    assert why and "HorizontalPodAutoscaler chat-hpa" in why and DEPLOYMENT in why
    with pytest.raises(Refused):
        runtime.spawn("chat", 1)
    assert standin.cluster.deployments[DEPLOYMENT]["spec"]["replicas"] == 0
    assert standin.cluster.requests["PATCH scale"] == 0


SLOW = turns_policy(handler="sleep", handler_options={"sleep_ms": 400}, concurrency=2, report_interval_s=0.3,
                    drain_timeout_s=15)


def rs_guess(standin: StandIn) -> str:
    """The pod the ReplicaSet would delete now, by its own order (no cost written yet)."""
    with standin.cluster.lock:
        active = [p for p in standin.cluster.pods.values() if not p["metadata"].get("deletionTimestamp")]
        return str(deletion_order(active)[0]["metadata"]["name"])


def test_retire_deletes_the_chosen_pod_not_the_replicasets_guess_and_loses_no_turn(
        standin: StandIn, make_runtime, r, redis_server):
    write_policy(r, "chat", SLOW)
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=3)
    runtime = make_runtime()
    pods = running_and_ready(standin, 3)
    guess = rs_guess(standin)
    victim = next(p for p in pods if p != guess)
    wait_until(lambda: all(s is Lifecycle.RUNNING for s in states(runtime).values()) and states(runtime),
               20, "three running workers")
    listed_ready(runtime, "chat", 3)
    with Fleet(redis_server.url) as fleet:
        handles = fleet.submit_many([(f"u{i:02d}", f"turn {i}") for i in range(12)])
        wait_until(lambda: r.exists(*(keys.lane(f"u{i:02d}") for i in range(12))) >= 6, 20,
                   "every worker busy with turns")
        runtime.retire(victim, "reclaim-idle: test", drain_timeout_s=15)
        assert {h.worker_id: h.state for h in runtime.list()}[victim] is Lifecycle.DRAINING
        assert sorted(h.worker_id for h in runtime.live("chat")) == sorted(set(pods) - {victim})
        answered_once(r, fleet, handles, timeout=60)

    standin.wait_for(lambda c: victim in c.ended, 30, f"pod {victim} to go")
    assert standin.cluster.rs_deleted == [victim]  # the commander's choice, not the ReplicaSet's guess
    assert standin.cluster.ended[victim] == Ended(exit_code=0, killed=False, restarts=0)  # drained, then its
    # SIGTERM came: the container was not restarted in between
    assert standin.cluster.deployments[DEPLOYMENT]["spec"]["replicas"] == 2
    exits = wait_until(lambda: runtime.reap(), 10, "the runtime to see the pod gone")
    assert [(h.worker_id, h.drained, h.retire_reason) for h in exits] == [
        (victim, True, "reclaim-idle: test")]
    assert victim not in registered(r) and len(registered(r)) == 2


def test_a_pending_pod_is_starting_and_goes_before_a_victim_that_keeps_serving(standin: StandIn,
                                                                              make_runtime, r):
    with standin.cluster.lock:
        standin.cluster.nodes, standin.cluster.capacity = ("node-1",), 1  # room for one pod
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=1)
    runtime = make_runtime()
    (serving,) = running_and_ready(standin, 1)
    runtime.spawn("chat", 1)
    pending = standin.wait_for(lambda c: [n for n, p in c.pods.items() if any(
        x["reason"] == "Unschedulable" for x in p["status"]["conditions"])], 10, "an unschedulable pod")[0]

    def seen_pending() -> WorkerHandle | None:
        runtime.reap()
        return next((h for h in runtime.list() if h.worker_id == pending and h.pending_since), None)

    handle = wait_until(seen_pending, 10, "the runtime to see the pod Pending")
    assert handle.state is Lifecycle.STARTING and handle.pending_why.startswith("Unschedulable: 0/1 nodes")
    wait_until(lambda: states(runtime).get(serving) is Lifecycle.RUNNING, 20, "the serving pod registered")

    runtime.retire(serving, "reclaim-idle: test")  # the ReplicaSet deletes the Pending pod first
    standin.wait_for(lambda c: pending in c.ended, 10, "the Pending pod deleted")
    assert standin.cluster.rs_deleted == [pending]
    (note,) = runtime.notes()
    assert (note.action, note.workers) == ("substituted", (pending,))
    assert f"{serving} keeps serving" in note.reason
    assert states(runtime)[serving] is Lifecycle.RUNNING and serving in registered(r)
    assert standin.cluster.deployments[DEPLOYMENT]["spec"]["replicas"] == 1


def test_refusals_are_cached_keda_absent_is_none_and_a_concurrent_write_is_retried(standin: StandIn,
                                                                                    make_runtime):
    runtime = make_runtime(check_ttl_s=60.0)
    assert (runtime.refusal("chat") or "").startswith("no Deployment labelled")
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
        standin.cluster.add_deployment("fleet-worker-chat-2", "chat", replicas=0)
    wait_until(lambda: (runtime.refusal("chat") or "").startswith("2 Deployments labelled"), 5, "two seen")
    with standin.cluster.lock:
        del standin.cluster.deployments["fleet-worker-chat-2"]
        standin.cluster.keda = False  # no ScaledObject resource in this cluster: 404, not a refusal
    wait_until(lambda: runtime.refusal("chat") is None, 5, "one Deployment, no autoscaler")
    for _ in range(20):
        assert runtime.refusal("chat") is None
    assert standin.cluster.requests["GET horizontalpodautoscalers"] == 1  # checked once per TTL
    with standin.cluster.lock:
        standin.cluster.keda = True
        standin.cluster.add_autoscaler("keda", "chat-scaler", DEPLOYMENT)
    assert runtime.refusal("chat") is None  # (still cached)
    fresh = make_runtime()
    assert "ScaledObject chat-scaler targets Deployment fleet-worker-chat" in (fresh.refusal("chat") or "")

    with standin.cluster.lock:
        del standin.cluster.scaled_objects["chat-scaler"]
    racing = make_runtime(api=RacingApi(api_for(standin), standin))
    assert racing.spawn("chat", 2)
    assert standin.cluster.deployments[DEPLOYMENT]["spec"]["replicas"] == 3  # the other writer's 1, then +2
    assert standin.cluster.requests["PATCH scale"] == 2  # a 409 Conflict, read again, written


def test_a_forbidden_write_holds_the_tiers_writes_off_with_the_reason(standin: StandIn, make_runtime):
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
        standin.cluster.forbidden.add("PATCH scale")  # the Role lacks deployments/scale patch
    runtime = make_runtime()
    with pytest.raises(ApiException) as failed:
        runtime.spawn("chat", 1)
    assert failed.value.status == 403
    why = runtime.refusal("chat")
    assert why == f"writing Deployment {DEPLOYMENT} failed (HTTP 403 Forbidden): not tried again for 10s"
    with pytest.raises(Refused):
        runtime.spawn("chat", 1)
    assert standin.cluster.requests["PATCH scale"] == 1  # not hammered
    assert not runtime.live("chat")


class RacingApi:
    """The runtime's API, with another writer setting replicas to 1 between its first read of
    /scale and its patch: the patch carries the resourceVersion it read, so it meets 409."""

    def __init__(self, api, standin: StandIn) -> None:
        self.api, self.standin, self.raced = api, standin, False
        self.namespace = api.namespace

    def __getattr__(self, name: str):
        return getattr(self.api, name)

    def read_scale(self, deployment: str) -> tuple[int, str]:
        got = self.api.read_scale(deployment)
        if not self.raced:
            self.raced = True
            with self.standin.cluster.lock:
                d = self.standin.cluster.deployments[deployment]
                d["spec"]["replicas"], d["metadata"]["resourceVersion"] = 1, self.standin.cluster.version()
        return got


KUBECONFIG = """apiVersion: v1
kind: Config
clusters:
- name: standin
  cluster: {{server: "{url}"}}
users:
- name: fleet
  user: {{token: not-checked}}
contexts:
- name: fleet
  context: {{cluster: standin, user: fleet, namespace: fleet}}
current-context: fleet
"""


def test_the_commander_builds_the_runtime_from_a_kubeconfig_or_refuses_to_start(standin: StandIn,
                                                                               redis_server, tmp_path,
                                                                               caplog):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG.format(url=standin.url))
    settings = CommanderSettings(runtime="kubernetes", k8s_kubeconfig=str(kubeconfig), metrics_port=None)
    runtime = commander_main._runtime(settings, redis_server.url, redis_server.role_url("fleet-worker"))
    assert isinstance(runtime, KubernetesRuntime)
    try:
        assert runtime.api.namespace == "fleet"  # the context's namespace
        assert runtime.refusal("chat") == ("no Deployment labelled app.kubernetes.io/component=worker,"
                                           "fleet.dev/tier=chat in namespace fleet (the manifests name "
                                           "it fleet-worker-chat)")
        assert standin.cluster.requests["GET deployments"] == 1  # it did ask the stand-in
    finally:
        runtime.close()
    # outside a pod, with no kubeconfig: a clear error, no commander
    assert commander_main._runtime(CommanderSettings(runtime="kubernetes", metrics_port=None),
                                   redis_server.url, redis_server.url) is None
    assert "cannot configure the Kubernetes client from the in-cluster config" in caplog.text
    with pytest.raises(ValueError, match="stop_workers_on_exit does not apply to the kubernetes runtime"):
        CommanderSettings(runtime="kubernetes", stop_workers_on_exit=True)
