"""The ``kubernetes`` runtime's view of its workers, rebuilt from each listing of the pods: pure.

``reconcile`` joins the pods with the worker registry (id -> heartbeat alive) and what the
runtime itself did (pods it retired, pods it expects the ReplicaSet to delete instead) into
``WorkerHandle``s, level-triggered: the same inputs give the same view, whatever came before,
but for what only the past knows (when a handle was first seen, why it was retired).

A pod's state:

- terminating (a deletionTimestamp), retired by us, or expected to go instead of a victim:
  ``DRAINING`` (no capacity); a retired pod whose container restarted since, and that is not
  terminating, was kept by the ReplicaSet: it is live again (``revived``);
- Running with a registry entry and a live heartbeat: ``RUNNING``;
- anything else alive (Pending, unscheduled, the container starting, restarted and not
  registered yet): ``STARTING``, with ``pending_since`` while the pod is Pending;
- Failed or Succeeded (evicted), or gone from the listing: ``EXITED``, once. It left nothing
  behind (``drained``) when the registry has no entry for it: a worker deregisters last thing
  on a clean exit, and one that never registered took no work. A registry that could not be
  read says nothing: not drained, and the commander's takeover finds out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from commander.runtime.interface import Lifecycle, WorkerHandle
from commander.runtime.kubernetes.model import Deployment, Pod, outstanding


@dataclass(frozen=True, slots=True)
class Retiring:
    """A pod this runtime retired: drained, and replicas lowered for it."""

    restarts: int  # its containers' restarts when it was retired
    reason: str


@dataclass
class View:
    """The runtime's workers after one listing."""

    handles: dict[str, WorkerHandle] = field(default_factory=dict)  # live and draining pods
    exits: list[WorkerHandle] = field(default_factory=list)  # ended since the last listing
    retiring: dict[str, Retiring] = field(default_factory=dict)  # still retiring
    revived: list[str] = field(default_factory=list)  # retired, but the ReplicaSet kept them


def _exited(handle: WorkerHandle, registry: Mapping[str, bool] | None) -> WorkerHandle:
    left_nothing = registry is not None and handle.worker_id not in registry
    return replace(handle, state=Lifecycle.EXITED, drained=left_nothing, pending_since=None)


def _live_state(pod: Pod, prior: Lifecycle | None, registry: Mapping[str, bool] | None) -> Lifecycle:
    if registry is None:  # unreadable: as it was, or starting
        return prior if prior in (Lifecycle.RUNNING, Lifecycle.STARTING) else Lifecycle.STARTING
    if pod.phase == "Running" and registry.get(pod.name, False):
        return Lifecycle.RUNNING
    return Lifecycle.STARTING


def _handle(pod: Pod, prior: WorkerHandle | None, now: float, first: bool) -> WorkerHandle:
    if prior is not None:
        return replace(prior)
    return WorkerHandle(pod.name, pod.tier, 0, Lifecycle.STARTING, pod.created or now, adopted=first)


def reconcile(prior: Mapping[str, WorkerHandle], pods: Sequence[Pod], registry: Mapping[str, bool] | None,
              retiring: Mapping[str, Retiring], going: Iterable[str], now: float,
              first: bool = False) -> View:
    """The handles for ``pods`` (see the module's doc). ``prior``: the last view's handles;
    ``going``: pods expected to be deleted instead of a victim; ``first``: the runtime's first
    listing (its pods predate it: ``adopted``)."""
    view, going = View(), set(going)
    seen = {p.name for p in pods}
    for name, handle in prior.items():
        if name not in seen:
            view.exits.append(_exited(handle, registry))
    for pod in pods:
        before = prior.get(pod.name)
        handle = _handle(pod, before, now, first)
        if pod.gone:
            if before is not None:  # reported once: an ended pod is not in ``prior`` again
                view.exits.append(_exited(handle, registry))
            continue
        mark = retiring.get(pod.name)
        if mark is not None and pod.restarts > mark.restarts and not pod.deleting:
            view.revived.append(pod.name)
            mark = None
        if mark is not None:
            view.retiring[pod.name] = mark
        handle.pending_since = pod.created if pod.pending else None
        handle.pending_why = pod.waiting if pod.pending else ""
        if pod.deleting or mark is not None or pod.name in going:
            handle.state = Lifecycle.DRAINING
            handle.retire_reason = mark.reason if mark else (handle.retire_reason or None)
        else:
            handle.state = _live_state(pod, before.state if before else None, registry)
            handle.retire_reason = None
        view.handles[pod.name] = handle
    return view


def live_pods(pods: Iterable[Pod], tier: str, retiring: Mapping[str, Retiring],
              going: Iterable[str]) -> list[Pod]:
    """The tier's pods that are capacity, now or soon: not ending, not retired, not going."""
    out = set(retiring) | set(going)
    return [p for p in pods if p.tier == tier and not p.deleting and not p.gone and p.name not in out]


def placeholders(deployment: Deployment | str, pods: Iterable[Pod], retiring: Mapping[str, Retiring],
                 going: Iterable[str]) -> int:
    """Starting workers the tier has no pod for yet: replicas the ReplicaSet has still to create
    (none when the tier has no single Deployment)."""
    if isinstance(deployment, str):
        return 0
    return outstanding(deployment.replicas, len(live_pods(pods, deployment.tier, retiring, going)))
