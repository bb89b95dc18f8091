"""Groups on the kubernetes runtime, the pure parts (commander/runtime/kubernetes/model.py's
pools, clone.py): the pool of an object's labels, a group's selector and name, what the runtime does
for a group given the Deployments listed, the copy of a tier's Deployment for a group, and the
patch of an image. Tables of cases; no API server."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from commander.runtime.kubernetes.clone import COPIED_FROM, clone_for_group, group_action, image_patch
from commander.runtime.kubernetes.model import (
    Deployment,
    conventional_name,
    deployment_of,
    pod_of,
    pool_of,
    tier_selector,
)
from tests.k8s.semantics import json_patch
from tests.k8s.standin_writes import invalid

W, T, G = "app.kubernetes.io/component", "fleet.dev/tier", "fleet.dev/group"


@pytest.mark.parametrize(("labels", "pool"), [
    ({W: "worker", T: "chat"}, "chat"),
    ({W: "worker", T: "chat", G: "green"}, "chat.green"),
    ({W: "worker", T: "gpu_big", G: "v2-canary"}, "gpu_big.v2-canary"),
    ({W: "worker"}, None),  # no tier: not ours
    ({W: "worker", T: "chat", G: ""}, None),  # an empty group names no pool
    ({W: "worker", T: "chat", G: "Green"}, None),  # not a group name
    ({W: "worker", T: "chat.green"}, None),  # a tier label holding a pool
    (None, None),
])
def test_the_pool_of_labels(labels: dict[str, str] | None, pool: str | None) -> None:
    assert pool_of(labels) == pool
    obj = {"metadata": {"name": "x", "labels": labels}, "spec": {}}
    assert getattr(pod_of(obj), "tier", None) == pool and getattr(deployment_of(obj), "tier", None) == pool


@pytest.mark.parametrize(("pool", "selector", "name"), [
    ("chat", f"{W}=worker,{T}=chat", "fleet-worker-chat"),
    ("chat.green", f"{W}=worker,{T}=chat,{G}=green", "fleet-worker-chat-green"),
    ("gpu_big.v_2", f"{W}=worker,{T}=gpu_big,{G}=v_2", "fleet-worker-gpu-big-v-2"),
])
def test_a_pools_selector_and_conventional_name(pool: str, selector: str, name: str) -> None:
    assert (tier_selector(pool), conventional_name(pool)) == (selector, name)


def test_a_deployment_is_read_with_its_worker_containers_image() -> None:
    containers = [{"name": "sidecar", "image": "proxy:1"}, {"name": "worker", "image": "fleet:2"}]
    labels = {"app.kubernetes.io/component": "worker", T: "chat", G: "green"}
    body = {"metadata": {"name": "d", "labels": labels},
            "spec": {"replicas": 0, "template": {"metadata": {"labels": labels},
                                                 "spec": {"containers": containers}}}}
    assert deployment_of(body) == Deployment("d", "chat.green", 0, image="fleet:2")
    body["spec"]["template"]["spec"]["containers"] = [{"name": "app", "image": "x:1"}]
    assert deployment_of(body) == Deployment("d", "chat.green", 0, image="x:1")  # no `worker`: the first


TIER_D = Deployment("fleet-worker-chat", "chat", 0, image="fleet:1")
BLUE_D = Deployment("fleet-worker-chat-blue", "chat.blue", 2, image="fleet:1")
GREEN_D = Deployment("fleet-worker-chat-green", "chat.green", 1, image="fleet:2")
OTHER_D = Deployment("fleet-worker-vip", "vip", 1)
SEL = f"{W}=worker,{T}=chat,{G}=green"


@pytest.mark.parametrize(("named", "image", "listed", "kind", "target", "says"), [
    # the pool's Deployment by its labels
    (None, None, [TIER_D, BLUE_D, GREEN_D], "ok", GREEN_D, ""),
    (None, "fleet:2", [GREEN_D], "ok", GREEN_D, ""),
    (None, "fleet:3", [GREEN_D], "set-image", GREEN_D, ""),
    ("fleet-worker-chat-green", "fleet:3", [GREEN_D], "set-image", GREEN_D, ""),
    # none: made from the tier's own, else from a group's (first by name), named as the group says
    (None, "fleet:3", [BLUE_D, TIER_D, OTHER_D], "create", TIER_D, "fleet-worker-chat-green"),
    ("green-v3", "fleet:3", [BLUE_D, TIER_D], "create", TIER_D, "green-v3"),
    (None, "fleet:3", [BLUE_D, Deployment("a-chat-red", "chat.red", 0)], "create",
     Deployment("a-chat-red", "chat.red", 0), "fleet-worker-chat-green"),
    # why not
    (None, None, [TIER_D, BLUE_D], "refuse", None,
     f"no Deployment labelled {SEL} in namespace ns and the group names no runtime with an image"),
    ("green-v3", None, [TIER_D], "refuse", None,
     f"no Deployment green-v3 labelled {SEL} in namespace ns and the group names no runtime with an image"),
    (None, "fleet:3", [OTHER_D], "refuse", None, "group green's runtime gives image fleet:3, but tier chat "
     "has no "
     f"Deployment to copy (one labelled {W}=worker,{T}=chat) and none is labelled {SEL}"),
    ("fleet-worker-chat-blue", None, [BLUE_D], "refuse", None, "Deployment fleet-worker-chat-blue, named by "
     f"group green of tier chat, is labelled for pool chat.blue: label it and its pod template {SEL}"),
    ("green-v3", "fleet:3", [GREEN_D], "refuse", None,
     "group green of tier chat names Deployment green-v3, but the one labelled "
     f"{SEL} is fleet-worker-chat-green"),
    (None, None, [GREEN_D, Deployment("g2", "chat.green", 0)], "refuse", None,
     f"2 Deployments labelled {SEL} in namespace ns (fleet-worker-chat-green, g2)"),
])
def test_what_the_runtime_does_for_a_group(named: str | None, image: str | None, listed: list[Deployment],
                                           kind: str, target: Deployment | None, says: str) -> None:
    action = group_action("chat.green", named, image, listed, "ns")
    assert (action.kind, action.deployment) == (kind, target)
    assert (action.why if kind == "refuse" else action.name) == says


def tier_json(**spec: Any) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "fleet", W: "worker", T: "chat"}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "fleet-worker-chat", "labels": dict(labels), "uid": "u1",
                         "resourceVersion": "7", "generation": 4, "creationTimestamp": "2024-05-01T12:00:00Z",
                         "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}},
            "spec": {"replicas": 3, "selector": {"matchLabels": dict(labels)},
                     "template": {"metadata": {"labels": dict(labels)},
                                  "spec": {"terminationGracePeriodSeconds": 45, "containers": [
                                      {"name": "proxy", "image": "envoy:1"},
                                      {"name": "worker", "image": "fleet:1",
                                       "env": [{"name": "REDIS_URL", "value": "redis://r"},
                                               {"name": "FLEET_WORKER_GROUP", "value": "blue"}]}]}},
                     **spec},
            "status": {"replicas": 3}}


@pytest.mark.parametrize("selector", [
    None,  # matchLabels, as the manifests write it
    {"matchLabels": {W: "worker", T: "chat"}, "matchExpressions": [{"key": G, "operator": "DoesNotExist"}]},
    {"matchLabels": {W: "worker", T: "chat"}, "matchExpressions": [
        {"key": G, "operator": "DoesNotExist"}, {"key": "tenant", "operator": "NotIn", "values": ["x"]}]},
])
def test_a_groups_deployment_is_a_valid_copy_of_its_tiers(selector: dict[str, Any] | None) -> None:
    source = tier_json(**({"selector": selector} if selector else {}))
    before = copy.deepcopy(source)
    made = clone_for_group(source, "chat.green", "fleet:2", "fleet-worker-chat-green")
    assert source == before  # the source is not touched
    assert invalid(made) is None  # the API server would take it
    group = {W: "worker", T: "chat", G: "green"}
    meta, spec = made["metadata"], made["spec"]
    assert meta == {"name": "fleet-worker-chat-green", "labels": {"app.kubernetes.io/name": "fleet", **group},
                    "annotations": {COPIED_FROM: "fleet-worker-chat"}}  # no uid, version, last-applied
    assert spec["replicas"] == 0 and "status" not in made
    assert group.items() <= spec["selector"]["matchLabels"].items()
    assert all(e["key"] != G for e in spec["selector"].get("matchExpressions", ()))
    assert spec["template"]["metadata"]["labels"] == {"app.kubernetes.io/name": "fleet", **group}
    proxy, worker = spec["template"]["spec"]["containers"]
    assert proxy == {"name": "proxy", "image": "envoy:1"}  # only the worker container changes
    assert worker["image"] == "fleet:2"
    assert worker["env"] == [{"name": "REDIS_URL", "value": "redis://r"},
                             {"name": "FLEET_WORKER_GROUP", "value": "green"}]  # one, the group's
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] == 45


def test_the_image_patch_sets_the_worker_containers_image_only_if_it_is_still_there() -> None:
    source = tier_json()
    ops = image_patch(source, "fleet:3")
    assert ops == [{"op": "test", "path": "/spec/template/spec/containers/1/name", "value": "worker"},
                   {"op": "replace", "path": "/spec/template/spec/containers/1/image", "value": "fleet:3"}]
    after = json_patch(source, ops)
    assert [c["image"] for c in after["spec"]["template"]["spec"]["containers"]] == ["envoy:1", "fleet:3"]
    moved = copy.deepcopy(source)
    moved["spec"]["template"]["spec"]["containers"].reverse()  # changed since it was read
    with pytest.raises(ValueError, match="test failed"):
        json_patch(moved, ops)
    with pytest.raises(ValueError, match="no container"):
        image_patch({"metadata": {"name": "d"}, "spec": {}}, "fleet:3")
