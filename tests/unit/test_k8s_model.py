"""The kubernetes runtime's pure parts (commander/runtime/kubernetes/model.py, reconcile.py): what it reads
of the API's JSON, which Deployment is a tier's, who else autoscales it, the ReplicaSet's order
as far as a victim cares, the deletion costs to write, the placeholders, and the view of the
pods joined with the registry. Tables of cases; no API server, no Redis."""

from __future__ import annotations

import pytest

from commander.runtime.interface import Lifecycle, WorkerHandle
from commander.runtime.kubernetes.model import (
    COST_MIN,
    DELETION_COST,
    Deployment,
    Pod,
    conventional_name,
    cost_patches,
    deployment_of,
    outranking,
    outstanding,
    parse_time,
    pod_of,
    refusal,
    scalers_of,
    tier_deployment,
    tier_selector,
)
from commander.runtime.kubernetes.reconcile import Retiring, live_pods, placeholders, reconcile

LABELS = {"app.kubernetes.io/component": "worker", "fleet.dev/tier": "chat"}


def pod_json(name: str = "p1", phase: str = "Running", node: str = "n1", ready: bool = True,
             cost: str | None = None, deleting: bool = False, restarts: int = 0,
             conditions: list[dict[str, str]] | None = None) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "labels": LABELS, "creationTimestamp": "2024-05-01T12:00:00Z"}
    if cost is not None:
        meta["annotations"] = {DELETION_COST: cost}
    if deleting:
        meta["deletionTimestamp"] = "2024-05-01T12:01:00Z"
    conds = conditions if conditions is not None else [{"type": "Ready", "status": str(ready)}]
    return {"metadata": meta, "spec": {"nodeName": node},
            "status": {"phase": phase, "conditions": conds,
                       "containerStatuses": [{"restartCount": restarts, "state": {"running": {}}}]}}


def test_a_pod_is_read_from_the_apis_json() -> None:
    pod = pod_of(pod_json(cost="-5", restarts=2))
    assert pod == Pod(name="p1", tier="chat", phase="Running", node="n1", ready=True,
                      created=parse_time("2024-05-01T12:00:00Z"), deleting=False, cost=-5, restarts=2)
    assert parse_time("2024-05-01T12:00:00Z") == 1714564800.0
    assert pod_of({"metadata": {"name": "x", "labels": {}}}) is None  # not a worker of a tier
    unscheduled = pod_of(pod_json(phase="Pending", node="", ready=False, conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient cpu."}]))
    assert unscheduled is not None and unscheduled.pending and not unscheduled.node
    assert unscheduled.waiting == "Unschedulable: 0/3 nodes are available: 3 Insufficient cpu."
    assert pod_of(pod_json(cost="cheap")).cost == 0  # an unparsable cost counts 0, as for the ReplicaSet
    assert pod_of(pod_json(phase="Failed")).gone and pod_of(pod_json(deleting=True)).deleting


def test_a_deployment_is_read_with_its_replicas_and_grace() -> None:
    body = {"metadata": {"name": "fleet-worker-chat", "labels": LABELS},
            "spec": {"replicas": 3, "template": {"metadata": {"labels": LABELS},
                                                 "spec": {"terminationGracePeriodSeconds": 45}}}}
    assert deployment_of(body) == Deployment("fleet-worker-chat", "chat", 3, 45.0)
    bare = {"metadata": {"name": "d", "labels": LABELS},
            "spec": {"template": {"metadata": {"labels": LABELS}}}}
    assert deployment_of(bare) == Deployment("d", "chat", 1)  # replicas unset: 1, grace unset
    assert conventional_name("gpu_big") == "fleet-worker-gpu-big"
    assert tier_selector("chat") == "app.kubernetes.io/component=worker,fleet.dev/tier=chat"


@pytest.mark.parametrize(("deployments", "found"), [
    ([Deployment("a", "chat", 1)], "a"),
    ([Deployment("a", "vip", 1)], "no Deployment labelled"),
    ([], "no Deployment labelled"),
    ([Deployment("a", "chat", 1), Deployment("b", "chat", 2)], "2 Deployments labelled"),
])
def test_a_tier_has_exactly_one_deployment(deployments: list[Deployment], found: str) -> None:
    got = tier_deployment("chat", deployments, "ns")
    assert (got.name if isinstance(got, Deployment) else got).startswith(found)


def hpa(name: str, target: str, kind: str = "Deployment") -> dict[str, object]:
    return {"metadata": {"name": name}, "spec": {"scaleTargetRef": {"kind": kind, "name": target}}}


@pytest.mark.parametrize(("hpas", "scaled", "refused"), [
    ([], [], None),
    ([hpa("h", "other")], [], None),
    ([hpa("h", "fleet-worker-chat", kind="StatefulSet")], [], None),
    ([hpa("h", "fleet-worker-chat")], [], "HorizontalPodAutoscaler h targets"),
    ([], [{"metadata": {"name": "so"}, "spec": {"scaleTargetRef": {"name": "fleet-worker-chat"}}}],
     "ScaledObject so targets"),
    ([hpa("keda-hpa-so", "fleet-worker-chat")],
     [{"metadata": {"name": "so"}, "spec": {"scaleTargetRef": {"name": "fleet-worker-chat"}}}],
     "HorizontalPodAutoscaler keda-hpa-so and ScaledObject so targets"),
])
def test_another_autoscaler_on_the_deployment_refuses(hpas: list[dict[str, object]],
                                                      scaled: list[dict[str, object]],
                                                      refused: str | None) -> None:
    deployment = Deployment("fleet-worker-chat", "chat", 1)
    why = refusal("chat", deployment, scalers_of(hpas, scaled))
    assert (why is None) if refused is None else (why is not None and why.startswith(refused))


@pytest.mark.parametrize(("template", "stray"), [
    (LABELS, ""),
    ({**LABELS, "app": "x"}, ""),  # more labels: fine
    (None, "is not labelled app.kubernetes.io/component=worker"),
    ({"app.kubernetes.io/component": "worker"}, "has no valid fleet.dev/tier label"),
    ({**LABELS, "fleet.dev/tier": "vip"}, "is labelled for pool vip"),
    ({**LABELS, "fleet.dev/group": "green"}, "is labelled for pool chat.green"),
])
def test_a_deployment_whose_pod_template_is_not_labelled_for_its_pool_is_refused(
        template: dict[str, str] | None, stray: str) -> None:
    body = {"metadata": {"name": "d", "labels": LABELS},
            "spec": {"template": {"metadata": {"labels": template}}}}
    deployment = deployment_of(body)
    assert deployment is not None and deployment.stray_template == stray
    why = refusal("chat", deployment, {})
    if not stray:
        assert why is None
    else:
        assert why == (f"the pod template of Deployment d {stray}: its pods would not count as pool chat's "
                       "workers; label the template app.kubernetes.io/component=worker,fleet.dev/tier=chat")


def test_no_deployment_or_an_unknown_autoscaler_state_refuses_too() -> None:
    assert refusal("chat", "no Deployment labelled x", {}) == "no Deployment labelled x"
    why = refusal("chat", Deployment("d", "chat", 1), "HTTP 403 Forbidden")
    assert why is not None and why.startswith("cannot check") and "HTTP 403" in why


VICTIM = Pod("v", "chat", "Running", "n1", ready=True, created=10.0)


@pytest.mark.parametrize(("other", "ahead"), [
    (Pod("o", "chat", "Running", "n1", ready=True, created=20.0, cost=COST_MIN), False),  # cost: after
    (Pod("o", "chat", "Pending", "", ready=False, created=5.0), True),  # unscheduled
    (Pod("o", "chat", "Pending", "n2", ready=False, created=5.0), True),  # scheduled, not started
    (Pod("o", "chat", "Running", "n2", ready=False, created=5.0), True),  # not ready
    (Pod("o", "chat", "Unknown", "n2", ready=True, created=5.0), True),  # Unknown before Running
])
def test_pods_the_replicaset_deletes_before_the_victim_whatever_the_costs(other: Pod, ahead: bool) -> None:
    assert (outranking(VICTIM, [VICTIM, other]) == [other]) is ahead


def test_an_unready_victim_is_outranked_only_by_unscheduled_or_earlier_phases() -> None:
    victim = Pod("v", "chat", "Running", "n1", ready=False, created=10.0)
    not_ready = Pod("o", "chat", "Running", "n2", ready=False, created=5.0)
    pending = [Pod(f"p{i}", "chat", "Pending", "", created=float(i)) for i in range(3)]
    assert outranking(victim, [victim, not_ready]) == []
    assert [p.name for p in outranking(victim, [victim, not_ready, *pending])] == ["p2", "p1", "p0"]


@pytest.mark.parametrize(("victim_cost", "others", "patches"), [
    (0, [0, 5], {"v": COST_MIN}),
    (COST_MIN, [0], {}),  # already the cheapest
    (0, [COST_MIN, 3], {"v": COST_MIN, "o0": COST_MIN + 1}),  # someone else had the lowest
    (COST_MIN, [COST_MIN, COST_MIN], {"o0": COST_MIN + 1, "o1": COST_MIN + 1}),
])
def test_the_victim_gets_strictly_the_lowest_deletion_cost(victim_cost: int, others: list[int],
                                                           patches: dict[str, int]) -> None:
    victim = Pod("v", "chat", cost=victim_cost)
    pods = [victim, *(Pod(f"o{i}", "chat", cost=c) for i, c in enumerate(others))]
    assert cost_patches(victim, pods) == patches


@pytest.mark.parametrize(("replicas", "live", "want"), [(3, 1, 2), (3, 3, 0), (2, 4, 0), (0, 0, 0)])
def test_replicas_without_a_pod_are_starting_workers(replicas: int, live: int, want: int) -> None:
    assert outstanding(replicas, live) == want


def test_placeholders_leave_out_ending_retired_and_going_pods() -> None:
    pods = [Pod("a", "chat"), Pod("b", "chat", deleting=True), Pod("c", "chat"),
            Pod("d", "chat", phase="Failed"), Pod("e", "chat"), Pod("x", "vip")]
    retiring = {"c": Retiring(0, "reclaim-idle")}
    assert [p.name for p in live_pods(pods, "chat", retiring, {"e"})] == ["a"]
    assert placeholders(Deployment("d", "chat", 3), pods, retiring, {"e"}) == 2
    assert placeholders("no Deployment", pods, retiring, ()) == 0


def handle(name: str, state: Lifecycle, **kw: object) -> WorkerHandle:
    return WorkerHandle(name, "chat", 0, state, 1.0, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("pod", "registry", "retiring", "going", "state"), [
    (Pod("p", "chat", "Pending", ""), {}, {}, (), Lifecycle.STARTING),
    (Pod("p", "chat", "Running", "n1"), {}, {}, (), Lifecycle.STARTING),  # not registered yet
    (Pod("p", "chat", "Running", "n1"), {"p": False}, {}, (), Lifecycle.STARTING),  # heartbeat gone
    (Pod("p", "chat", "Running", "n1"), {"p": True}, {}, (), Lifecycle.RUNNING),
    (Pod("p", "chat", "Running", "n1", deleting=True), {"p": True}, {}, (), Lifecycle.DRAINING),
    (Pod("p", "chat", "Running", "n1"), {"p": True}, {"p": Retiring(0, "r")}, (), Lifecycle.DRAINING),
    (Pod("p", "chat", "Pending", ""), {}, {}, ("p",), Lifecycle.DRAINING),
    # retired, but its container restarted and the pod is not terminating: the ReplicaSet kept it
    (Pod("p", "chat", "Running", "n1", restarts=1), {"p": True}, {"p": Retiring(0, "r")}, (),
     Lifecycle.RUNNING),
    (Pod("p", "chat", "Running", "n1"), None, {}, (), Lifecycle.STARTING),  # registry unreadable
])
def test_a_pods_state_joins_the_pod_the_registry_and_what_the_runtime_did(
        pod: Pod, registry: dict[str, bool] | None, retiring: dict[str, Retiring], going: tuple[str, ...],
        state: Lifecycle) -> None:
    view = reconcile({}, [pod], registry, retiring, going, now=100.0)
    assert view.handles["p"].state is state
    assert view.revived == (["p"] if pod.restarts and retiring else [])


def test_an_ended_pod_is_an_exit_once_and_drained_only_if_it_left_the_registry() -> None:
    prior = {"a": handle("a", Lifecycle.DRAINING, retire_reason="reclaim-idle"),
             "b": handle("b", Lifecycle.RUNNING), "c": handle("c", Lifecycle.RUNNING)}
    pods = [Pod("c", "chat", "Failed", "n1")]  # evicted
    view = reconcile(prior, pods, {"b": False, "c": True}, {}, (), now=100.0)
    exits = {h.worker_id: h for h in view.exits}
    assert set(exits) == {"a", "b", "c"} and not view.handles
    assert all(h.state is Lifecycle.EXITED for h in exits.values())
    assert exits["a"].drained and exits["a"].retire_reason == "reclaim-idle"  # deregistered: clean
    assert not exits["b"].drained and not exits["c"].drained  # entries left: taken over
    again = reconcile(view.handles, pods, {}, {}, (), now=101.0)
    assert again.exits == []  # the Failed pod is reported once
    assert not reconcile(prior, [], None, {}, (), now=100.0).exits[0].drained  # registry unknown


def test_a_pending_pod_says_since_when_and_why_and_a_first_listing_adopts() -> None:
    pod = Pod("p", "chat", "Pending", "", created=50.0, waiting="Unschedulable: no room")
    view = reconcile({}, [pod], {}, {}, (), now=100.0, first=True)
    got = view.handles["p"]
    assert (got.pending_since, got.pending_why, got.started, got.adopted) == (50.0, "Unschedulable: no room",
                                                                                50.0, True)
    later = reconcile(view.handles, [Pod("p", "chat", "Running", "n1", created=50.0)], {"p": True}, {}, (),
                      now=120.0)
    assert later.handles["p"].pending_since is None and later.handles["p"].state is Lifecycle.RUNNING
