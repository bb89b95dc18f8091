"""A group's Deployment on the ``kubernetes`` runtime, decided and written as plain values: pure.

A group of a tier (protocol.groups) runs in a pool ``<tier>.<group>`` of its own, and on
Kubernetes a pool is one Deployment: the one labelled ``fleet.dev/tier=<tier>`` and
``fleet.dev/group=<group>`` (and ``app.kubernetes.io/component=worker``); a tier's own Deployment
is the one with the tier label and no group label. What the runtime does for a group
(:func:`group_action`), from the group's ``deployment``, the ``image`` its runtime gives (an
allowed one, from the commander's ``group_runtimes``) and the Deployments listed:

- the pool's Deployment exists (by its labels; and it is the one ``deployment`` names, if the
  group names one): nothing, or, when the group's runtime gives an ``image`` its worker container does not
  run, set that image (a rollout of the pool);
- none exists and the group's runtime gives an ``image``: create one (named ``deployment``, else
  ``fleet-worker-<tier>-<group>``) as a copy of the tier's own Deployment (the one without a
  group label; failing that, the tier's group Deployment first by name), with the group's labels
  on it, its selector and its pod template, ``FLEET_WORKER_GROUP=<group>`` and the image on the
  worker container, and 0 replicas (:func:`clone_for_group`): the commander scales it; with
  its PodDisruptionBudget (:func:`budget_for`);
- else: the group cannot start here, and why.

Nothing here talks to the API server; tests/unit/test_k8s_clone.py has the tables.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from commander.runtime.kubernetes.model import (
    COPIED_FROM,
    GROUP_LABEL,
    TIER_LABEL,
    Deployment,
    Obj,
    conventional_name,
    tier_selector,
    worker_index,
)
from protocol.groups import split_pool

GROUP_ENV = "FLEET_WORKER_GROUP"


@dataclass(frozen=True, slots=True)
class GroupAction:
    """What to do for a group's pool: ``ok`` (its Deployment is right), ``set-image``, ``create``
    (a copy of ``source`` named ``name``), or ``refuse`` (``why``)."""

    kind: Literal["ok", "set-image", "create", "refuse"]
    deployment: Deployment | None = None  # ok, set-image: the pool's; create: the one to copy
    name: str = ""  # create: the new Deployment's name
    why: str = ""  # refuse


def _source(tier: str, deployments: Sequence[Deployment]) -> Deployment | None:
    """The Deployment a group's is copied from: the tier's own, else its groups' first by name."""
    own = sorted((d for d in deployments if d.tier == tier), key=lambda d: d.name)
    if own:
        return own[0]
    grouped = sorted((d for d in deployments if d.tier.partition(".")[0] == tier), key=lambda d: d.name)
    return grouped[0] if grouped else None


def group_action(pool: str, named: str | None, image: str | None, deployments: Sequence[Deployment],
                 namespace: str) -> GroupAction:
    """What the runtime does for ``pool``'s group, which names Deployment ``named`` and ``image``
    (either may be None), given the worker ``deployments`` of the namespace (see the module's doc)."""
    tier, group = split_pool(pool)
    selector = tier_selector(pool)
    mine = [d for d in deployments if d.tier == pool]
    if named is not None:
        other = next((d for d in deployments if d.name == named and d.tier != pool), None)
        if other is not None:
            return GroupAction("refuse", why=f"Deployment {named}, named by group {group} of tier {tier}, is "
                               f"labelled for pool {other.tier}: label it and its pod template {selector}")
        if mine and mine[0].name != named:
            names = ", ".join(sorted(d.name for d in mine))
            return GroupAction("refuse", why=f"group {group} of tier {tier} names Deployment {named}, "
                               f"but the one labelled {selector} is {names}")
    if len(mine) > 1:
        names = ", ".join(sorted(d.name for d in mine))
        return GroupAction("refuse", why=f"{len(mine)} Deployments labelled {selector} in namespace "
                           f"{namespace} ({names})")
    if mine:
        kind: Literal["ok", "set-image"] = "set-image" if image and mine[0].image != image else "ok"
        return GroupAction(kind, mine[0])
    if not image:
        what = f"Deployment {named} " if named else "Deployment "
        return GroupAction("refuse", why=f"no {what}labelled {selector} in namespace {namespace} and the "
                           "group names no runtime with an image")
    source = _source(tier, deployments)
    if source is None:
        return GroupAction("refuse", why=f"group {group}'s runtime gives image {image}, but tier {tier} "
                           f"has no "
                           f"Deployment to copy (one labelled {tier_selector(tier)}) and none is "
                           f"labelled {selector}")
    return GroupAction("create", source, name=named or conventional_name(pool))


def _labelled(labels: Obj | None, tier: str, group: str) -> dict[str, str]:
    return {**(labels or {}), TIER_LABEL: tier, GROUP_LABEL: group}


def _group_env(env: Sequence[Obj], group: str) -> list[dict[str, Any]]:
    return [*(dict(e) for e in env if e.get("name") != GROUP_ENV), {"name": GROUP_ENV, "value": group}]


def clone_for_group(source: Obj, pool: str, image: str, name: str) -> dict[str, Any]:
    """A new Deployment for ``pool``'s group from ``source``'s JSON (see the module's doc): its
    spec, with the group's labels on the Deployment, its selector and its pod template (a selector
    term on the group label is dropped: it is the group's own now), the group's image and
    ``FLEET_WORKER_GROUP`` on the worker container, 0 replicas; none of the source's identity,
    status or annotations."""
    tier, group = split_pool(pool)
    meta = source.get("metadata") or {}
    spec = copy.deepcopy(dict(source.get("spec") or {}))
    spec["replicas"] = 0
    selector = spec.setdefault("selector", {})
    selector["matchLabels"] = _labelled(selector.get("matchLabels"), tier, group)
    expressions = [e for e in selector.pop("matchExpressions", ()) if e.get("key") != GROUP_LABEL]
    if expressions:
        selector["matchExpressions"] = expressions
    template = spec.setdefault("template", {})
    template_meta = template.setdefault("metadata", {})
    template_meta["labels"] = _labelled(template_meta.get("labels"), tier, group)
    containers = template.setdefault("spec", {}).setdefault("containers", [])
    if containers:
        worker = containers[worker_index(containers)]
        worker["image"] = image
        worker["env"] = _group_env(worker.get("env") or (), group)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": _labelled(meta.get("labels"), tier, group),
                         "annotations": {COPIED_FROM: str(meta.get("name") or "")}},
            "spec": spec}


def budget_for(deployment: Obj) -> dict[str, Any]:
    """The PodDisruptionBudget of a Deployment made for a group (``clone_for_group``'s): named and
    labelled as it, over exactly its pods (its selector, which has the group label), letting a
    node drain evict one at a time (each drains first), as the manifests' budget of a tier."""
    meta, spec = deployment.get("metadata") or {}, deployment.get("spec") or {}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})},
            "spec": {"maxUnavailable": 1, "selector": copy.deepcopy(spec.get("selector") or {})}}


def image_patch(obj: Obj, image: str) -> list[dict[str, Any]]:
    """The JSON patch that sets the worker container's image of a Deployment's JSON, only if that
    container is still the one at its index (a ``test`` of its name first: else the API refuses)."""
    containers = ((obj.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []
    if not containers:
        raise ValueError(f"Deployment {(obj.get('metadata') or {}).get('name')} has no container")
    index = worker_index(containers)
    path = f"/spec/template/spec/containers/{index}"
    return [{"op": "test", "path": f"{path}/name", "value": containers[index].get("name")},
            {"op": "replace", "path": f"{path}/image", "value": image}]
