"""What the ``kubernetes`` runtime reads of the API, as plain values, and its pure decisions.

Nothing here talks to the API server or reads the clock: the objects come in as the JSON the
API serves (``pod_of``, ``deployment_of``, ``scalers_of``), ``now`` comes in as an argument,
and the answers are table-tested (tests/unit/test_k8s_model.py).

The ReplicaSet's choice on a scale-down (kubernetes ``pkg/controller/controller_utils.go``,
``ActivePodsWithRanks.Less``) compares, in order: unassigned before assigned; Pending before
Unknown before Running; not ready before ready; lower ``controller.kubernetes.io/pod-deletion-cost``
first; then pods doubled up on a node, the most recently ready, more restarts, the newest. So
the cost decides only between pods equal on the first three: a Pending or not-ready pod goes
before any victim the commander marks (``outranking``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.groups import pool_name, validate_group
from protocol.ids import InvalidId, validate_tier

COMPONENT = "app.kubernetes.io/component"
TIER_LABEL = "fleet.dev/tier"
GROUP_LABEL = "fleet.dev/group"  # a group's Deployment and pods: their pool is <tier>.<group>
COPIED_FROM = "fleet.dev/copied-from"  # the annotation of a Deployment the runtime made for a group
WORKER_CONTAINER = "worker"  # the container a group's image goes to (else the pod's first)
WORKERS_SELECTOR = f"{COMPONENT}=worker"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
COST_MIN = -(2**31)  # the annotation is an int32
_PHASE_ORDER = {"Pending": 0, "Unknown": 1, "Running": 2}

Obj = Mapping[str, Any]  # one API object, as JSON


def tier_selector(pool: str) -> str:
    """The label selector of a pool's worker Deployment (and its pods): a tier's, or a group's
    (``chat.green``: ``fleet.dev/tier=chat,fleet.dev/group=green``)."""
    tier, _sep, group = pool.partition(".")
    return f"{WORKERS_SELECTOR},{TIER_LABEL}={tier}" + (f",{GROUP_LABEL}={group}" if group else "")


def conventional_name(pool: str) -> str:
    """The name the manifests give a pool's Deployment (the selector, not the name, finds it):
    ``fleet-worker-<tier>[-<group>]``, ``_`` as ``-``."""
    return "fleet-worker-" + pool.replace("_", "-").replace(".", "-")


def pool_of(labels: Mapping[str, str] | None) -> str | None:
    """The pool of an object by its labels: ``<tier>`` (no group label) or ``<tier>.<group>``;
    None without a tier label, or with labels that name no valid pool (not a worker of ours)."""
    labels = labels or {}
    tier, group = labels.get(TIER_LABEL), labels.get(GROUP_LABEL)
    if not tier:
        return None
    try:
        return validate_tier(tier) if group is None else pool_name(validate_tier(tier), validate_group(group))
    except InvalidId:
        return None


@dataclass(frozen=True, slots=True)
class Pod:
    """One worker pod, as the ReplicaSet and the commander care about it."""

    name: str
    tier: str
    phase: str = "Pending"  # Pending, Running, Succeeded, Failed, Unknown
    node: str = ""  # "" while unscheduled
    ready: bool = False
    created: float = 0.0
    deleting: bool = False  # a deletionTimestamp: terminating
    cost: int = 0
    restarts: int = 0
    waiting: str = ""  # why it is Pending, as the scheduler or the kubelet says

    @property
    def gone(self) -> bool:
        """Ended for good without a deletion (evicted: Failed; or Succeeded)."""
        return self.phase in ("Succeeded", "Failed")

    @property
    def pending(self) -> bool:
        return self.phase == "Pending" and not self.deleting


@dataclass(frozen=True, slots=True)
class Deployment:
    """A pool's worker Deployment (a tier's, or a group's: ``tier`` is then ``<tier>.<group>``)."""

    name: str
    tier: str
    replicas: int
    grace_s: float | None = None  # its pods' terminationGracePeriodSeconds (None: 30, the default)
    image: str = ""  # its worker container's image ("" if it names none)
    stray_template: str = ""  # what its pod template's labels get wrong ("": they name its pool)
    copied_from: str = ""  # the runtime made it for a group, a copy of this one ("": not ours)


def parse_time(value: object) -> float:
    """An RFC 3339 time of the API (``2024-05-01T12:00:00Z``) as unix seconds; 0 if absent."""
    if not isinstance(value, str) or not value:
        return 0.0
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _int(value: object, default: int = 0) -> int:
    try:
        return int(str(value))
    except ValueError:
        return default


def _waiting(status: Obj) -> str:
    for cond in status.get("conditions") or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{cond.get('reason') or 'unscheduled'}: {cond.get('message') or ''}".strip(": ")
    for cs in status.get("containerStatuses") or ():
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:
            return f"{waiting.get('reason') or 'waiting'}: {waiting.get('message') or ''}".strip(": ")
    return ""


def pod_of(obj: Obj) -> Pod | None:
    """A pod from its JSON (its ``tier`` is its pool); None for one without a tier label (not a
    worker of ours)."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    tier = pool_of(meta.get("labels"))
    if not tier:
        return None
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or ())
    restarts = sum(_int(cs.get("restartCount")) for cs in status.get("containerStatuses") or ())
    cost = _int((meta.get("annotations") or {}).get(DELETION_COST), 0)
    return Pod(name=meta["name"], tier=tier, phase=status.get("phase") or "Pending",
               node=spec.get("nodeName") or "", ready=ready,
               created=parse_time(meta.get("creationTimestamp")),
               deleting=bool(meta.get("deletionTimestamp")), cost=cost, restarts=restarts,
               waiting=_waiting(status))


def deployment_of(obj: Obj) -> Deployment | None:
    """A Deployment from its JSON (its ``tier`` is its pool); None for one without a tier label."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    tier = pool_of(meta.get("labels"))
    if not tier:
        return None
    pod = (spec.get("template") or {}).get("spec") or {}
    grace = pod.get("terminationGracePeriodSeconds")
    replicas = spec.get("replicas")
    containers = pod.get("containers") or []
    index = worker_index(containers)
    image = str(containers[index].get("image") or "") if containers else ""
    template_labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels")
    return Deployment(name=meta["name"], tier=tier, replicas=1 if replicas is None else int(replicas),
                      grace_s=None if grace is None else float(grace), image=image,
                      stray_template=_stray(tier, template_labels),
                      copied_from=str((meta.get("annotations") or {}).get(COPIED_FROM) or ""))


def _stray(pool: str, labels: Mapping[str, str] | None) -> str:
    """What a pod template's labels get wrong for ``pool`` ("" if nothing): its pods are counted
    by their own labels, so a template without the pool's would make pods nobody counts."""
    labels = labels or {}
    if labels.get(COMPONENT) != "worker":
        return f"is not labelled {WORKERS_SELECTOR}"
    theirs = pool_of(labels)
    if theirs != pool:
        return f"is labelled for pool {theirs}" if theirs else f"has no valid {TIER_LABEL} label"
    return ""


def worker_index(containers: Sequence[Obj]) -> int:
    """The index of the worker container among a pod template's: the one named ``worker``, else 0."""
    return next((i for i, c in enumerate(containers) if c.get("name") == WORKER_CONTAINER), 0)


def scalers_of(hpas: Iterable[Obj], scaled_objects: Iterable[Obj]) -> dict[str, list[str]]:
    """Deployment name -> the autoscalers that target it (``HorizontalPodAutoscaler x``, ...)."""
    found: dict[str, list[str]] = {}
    for kind, items in (("HorizontalPodAutoscaler", hpas), ("ScaledObject", scaled_objects)):
        for obj in items:
            ref = (obj.get("spec") or {}).get("scaleTargetRef") or {}
            if ref.get("kind", "Deployment") != "Deployment" or not ref.get("name"):
                continue
            found.setdefault(ref["name"], []).append(f"{kind} {obj['metadata']['name']}")
    return found


def tier_deployment(tier: str, deployments: Sequence[Deployment], namespace: str) -> Deployment | str:
    """The pool's one Deployment (a tier's, or a group's), or why there is not exactly one."""
    mine = [d for d in deployments if d.tier == tier]
    if len(mine) == 1:
        return mine[0]
    if not mine:
        return (f"no Deployment labelled {tier_selector(tier)} in namespace {namespace} "
                f"(the manifests name it {conventional_name(tier)})")
    names = ", ".join(sorted(d.name for d in mine))
    return f"{len(mine)} Deployments labelled {tier_selector(tier)} in namespace {namespace} ({names})"


def refusal(tier: str, deployment: Deployment | str, scalers: Mapping[str, list[str]] | str) -> str | None:
    """Why the runtime may not write the tier's replica count, or None: the Deployment must be
    one, and no other autoscaler may target it (Fleet is its single writer). ``scalers`` is a
    string when they could not be listed: not knowing refuses too."""
    if isinstance(deployment, str):
        return deployment
    if deployment.stray_template:
        return (f"the pod template of Deployment {deployment.name} {deployment.stray_template}: its pods "
                f"would not count as pool {tier}'s workers; label the template {tier_selector(tier)}")
    if isinstance(scalers, str):
        return f"cannot check that no HPA or ScaledObject targets Deployment {deployment.name}: {scalers}"
    owners = scalers.get(deployment.name)
    if owners:
        return (f"{' and '.join(owners)} targets Deployment {deployment.name}: Fleet is the single "
                f"writer of its replicas; remove the other autoscaler to let Fleet scale tier {tier}")
    return None


# --- the ReplicaSet's order -------------------------------------------------------------
def outranking(victim: Pod, pods: Iterable[Pod]) -> list[Pod]:
    """Pods the ReplicaSet deletes before ``victim`` whatever their deletion cost: unassigned
    while it is assigned, an earlier phase, or not ready while it is ready. The newest first
    (the ReplicaSet's last tie-breaker among them, nodes and restarts aside)."""
    def before(p: Pod) -> bool:
        if bool(p.node) != bool(victim.node):
            return not p.node
        mine, theirs = _PHASE_ORDER.get(p.phase, 0), _PHASE_ORDER.get(victim.phase, 0)
        if mine != theirs:
            return mine < theirs
        return not p.ready and victim.ready

    ahead = [p for p in pods if p.name != victim.name and before(p)]
    return sorted(ahead, key=lambda p: (bool(p.node), _PHASE_ORDER.get(p.phase, 0), p.ready, -p.created,
                                        p.name))


def cost_patches(victim: Pod, others: Iterable[Pod]) -> dict[str, int]:
    """The deletion costs to write so that ``victim`` is strictly the cheapest of the pods:
    the lowest cost on it, and one above on any other pod that has it (none, unless someone
    else marked one). Pods already right are left out."""
    patches = {} if victim.cost == COST_MIN else {victim.name: COST_MIN}
    for pod in others:
        if pod.name != victim.name and pod.cost <= COST_MIN:
            patches[pod.name] = COST_MIN + 1
    return patches


def outstanding(replicas: int, live: int) -> int:
    """Replicas the ReplicaSet has yet to create a pod for: each counts as a starting worker."""
    return max(0, replicas - live)
