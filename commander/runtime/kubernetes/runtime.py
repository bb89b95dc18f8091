"""The ``kubernetes`` runtime: one worker Deployment per tier, whose replicas Fleet alone writes.

A tier's Deployment is the one labelled ``app.kubernetes.io/component=worker`` and
``fleet.dev/tier=<tier>`` in the runtime's namespace (the manifests name it
``fleet-worker-<tier>``, ``_`` as ``-``; only the labels count). Its pods carry the same labels,
and each pod's worker registers under the pod's name (``FLEET_WORKER_POD_NAME``). A group's pool
``<tier>.<group>`` is a tier of its own here: its Deployment is also labelled
``fleet.dev/group=<group>``, made from a copy of the tier's when the group names a runtime
whose image the commander allows (``group_deployments.py``). A tier of kind rq is run the same
way by pods of ``fleet rq-worker``, known by RQ's worker registry and retired by their SIGTERM
(RQ's warm shutdown), with no drain over Redis (``rq_pods.py``).

- ``spawn(tier, n)`` raises the Deployment's ``spec.replicas`` by ``n`` through its ``/scale``
  subresource (``writes.py``) and returns ``n`` placeholder ids (``<deployment>:starting-<k>``):
  the pods do not exist yet. A placeholder counts as a starting worker until a pod takes its
  place (``reconcile.placeholders``: replicas the ReplicaSet has not created a pod for), so the
  commander's anti-windup sees them.
- ``retire(pod)`` gives the pod the lowest ``controller.kubernetes.io/pod-deletion-cost`` (one
  above it on any other pod that had it), sends it the drain command and lowers replicas by one,
  so the ReplicaSet deletes the pod the commander chose; it is DRAINING (no capacity) from then
  on. A pod the ReplicaSet deletes first whatever the costs (unscheduled, Pending, not ready)
  goes instead: replicas are lowered, the victim keeps serving and a ``substituted`` note says so.
- Before it writes, the runtime checks that the tier has exactly one Deployment and that no
  HorizontalPodAutoscaler or KEDA ScaledObject targets it (``autoscalers.py``, listed at most
  every ``check_ttl_s``); else ``refusal`` says why and ``spawn``/``retire`` raise ``Refused``.
- ``reap``/``list``/``adopt`` come from one listing of the namespace's worker pods and
  Deployments every ``poll_s`` (two LIST calls) joined with the worker registry (``listing.py``).
- ``stop_all`` changes nothing: on Kubernetes a commander's exit is a rollout or a failover to
  its standby, not the fleet's end; scale the Deployments with kubectl to stop the workers.

API errors while listing leave the last view in place (logged every 30 s at most); errors
while writing are raised to the commander, which logs them and retries on its next pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import redis

from commander.group_runtimes import GroupRuntime
from commander.runtime.interface import (
    Handles,
    Lifecycle,
    Notes,
    Refused,
    Runtime,
    RuntimeNote,
    UnknownWorker,
    WorkerIds,
)
from commander.runtime.kubernetes.api import KubeApi
from commander.runtime.kubernetes.autoscalers import Autoscalers
from commander.runtime.kubernetes.group_deployments import GroupDeployments
from commander.runtime.kubernetes.listing import Listing
from commander.runtime.kubernetes.model import Deployment, Pod, cost_patches, outranking, refusal
from commander.runtime.kubernetes.rq_pods import RqPods, short_grace
from commander.runtime.kubernetes.writes import Writes
from protocol.groups import validate_pool
from protocol.models import Control
from stores.control import send_control
from stores.retry import TRANSIENT

log = logging.getLogger(__name__)
CONTROL_MAXLEN = 64
DEFAULT_GRACE_S = 30.0  # a pod's terminationGracePeriodSeconds when its spec says none


class KubernetesRuntime(Runtime):
    """Worker pods of one Deployment per tier, in one namespace. Not thread-safe: one loop owns it.

    Composed of: ``listing`` (what it knows of the pods and Deployments), ``writes`` (to them,
    with their backoff), ``autoscalers`` (the others on the namespace), ``groups`` (the groups'
    Deployments) and ``rq_pods`` (the rq tiers)."""

    name = "kubernetes"

    def __init__(self, api: KubeApi, r: redis.Redis, *, poll_s: float = 1.0, check_ttl_s: float = 30.0,
                 group_runtimes: Mapping[str, GroupRuntime] | None = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """``group_runtimes``: the runtimes a group may name (the commander's setting): a group's
        image is only ever one of theirs."""
        self.api, self.r, self.clock, self.monotonic = api, r, clock, monotonic
        self.going_s = max(10.0, 5 * poll_s)  # a substituted pod is expected to go within this
        self.rq_pods = RqPods(r)
        self.listing = Listing(api, r, self.rq_pods, poll_s=poll_s, clock=clock, monotonic=monotonic)
        self.writes = Writes(api, self.listing, monotonic)
        self.autoscalers = Autoscalers(api, check_ttl_s, monotonic)
        self._notes: list[RuntimeNote] = []
        self.groups = GroupDeployments(api, self.listing, self.writes, r, self._notes.append,
                                       dict(group_runtimes or {}))
        self._warned_grace: set[str] = set()  # Deployments whose short grace period was warned about

    def close(self) -> None:
        self.api.close()
        self.r.close()

    def configure(self, tier: str, kind: str, queues: Sequence[str] = ()) -> None:
        """Remember the rq tiers (their pods run RQ workers on ``queues``)."""
        self.rq_pods.configure(tier, kind, queues)

    # --- may it act? ---------------------------------------------------------------------
    def refusal(self, tier: str) -> str | None:
        """Why the tier's replicas may not be written now (no single Deployment, another
        autoscaler on it, a write that failed, or the API could not say), or None."""
        self.listing.refresh()
        group_why = self.groups.check(tier)  # (a group's pool: its Deployment made, its image set)
        if group_why is not None:
            return group_why
        deployment = self.listing.deployment(tier)
        if isinstance(deployment, str):
            return deployment
        held = self.writes.held(tier)
        if held is not None:
            return held
        return refusal(tier, deployment, self.autoscalers.now())

    def check_group(self, pool: str) -> str | None:
        """Why the group of ``pool`` can have no Deployment here, or None (it has one, now)."""
        self.listing.refresh()
        return self.groups.check(pool)

    def pool_forgotten(self, pool: str) -> None:
        """Delete the Deployment this runtime made for the gone group of ``pool`` (see
        ``GroupDeployments.forgotten``)."""
        self.groups.forgotten(pool)

    def _acting_on(self, tier: str) -> Deployment:
        why = self.refusal(tier)
        if why is not None:
            raise Refused(why)
        deployment = self.listing.deployment(tier)
        assert isinstance(deployment, Deployment)  # (refusal said so)
        return deployment

    # --- act -----------------------------------------------------------------------------
    def spawn(self, tier: str, n: int = 1) -> WorkerIds:
        """Raise the tier's replicas by ``n``; return ``n`` placeholder ids."""
        validate_pool(tier)
        if n < 0:
            raise ValueError(f"cannot spawn {n} workers")
        if n == 0:
            return []
        deployment = self._acting_on(tier)
        before, after = self.writes.scale(deployment, n)
        ids = self.listing.add_placeholders(deployment, n)
        log.info("tier %s: Deployment %s replicas %d -> %d through /scale", tier, deployment.name,
                 before, after)
        return ids

    def retire(self, worker_id: str, reason: str = "", drain_timeout_s: float | None = None) -> None:
        """Make the pod the ReplicaSet's cheapest, drain it, lower replicas by one."""
        handle = self.listing.handle(worker_id)
        if handle is None:
            self._retire_placeholder(worker_id)
            return
        if handle.state in (Lifecycle.DRAINING, Lifecycle.EXITED):
            return
        deployment = self._acting_on(handle.tier)  # (it may list again: look the pod up after)
        handle = self.listing.handle(worker_id)
        victim = self.listing.pod(worker_id)
        if handle is None or victim is None or handle.state is Lifecycle.DRAINING:
            return  # it ended, or began to, meanwhile
        live = self.listing.live_pods(handle.tier)
        ahead = outranking(victim, live)
        if ahead:
            self._substitute(deployment, victim, ahead[0])
            return
        patches = cost_patches(victim, live)
        self.writes.deletion_costs(deployment, patches, last=worker_id)
        if handle.tier not in self.rq_pods:  # an RQ worker's drain is its SIGTERM
            self._send_drain(worker_id, reason)
        # draining from now on, even if lowering replicas fails: the worker drains and, once its
        # linger is over, exits; its container restarts and the pod counts again (revived)
        self.listing.retiring(worker_id, victim.restarts, reason)
        before, after = self.writes.scale(deployment, -1)
        self._check_grace(deployment, drain_timeout_s)
        log.info("retiring pod %s (tier %s): deletion cost %d, drained, replicas %d -> %d: %s",
                 worker_id, handle.tier, patches.get(worker_id, victim.cost), before, after,
                 reason or "no reason given")

    def _retire_placeholder(self, worker_id: str) -> None:
        """A replica with no pod yet: lower replicas by one, so it is never created."""
        tier = self.listing.placeholder_tier(worker_id)
        if tier is None:
            raise UnknownWorker(worker_id)
        self.writes.scale(self._acting_on(tier), -1)
        self.listing.sync_placeholders(tier)

    def _substitute(self, deployment: Deployment, victim: Pod, instead: Pod) -> None:
        before, after = self.writes.scale(deployment, -1)
        self.listing.expect_gone(instead.name, self.monotonic() + self.going_s)
        how = "unscheduled" if not instead.node else "Pending" if instead.pending else "not ready"
        reason = (f"replicas {before} -> {after}: the ReplicaSet deletes {how} pod {instead.name} "
                  f"before {victim.name}, whatever their deletion costs; {victim.name} keeps serving")
        log.warning("tier %s: %s", deployment.tier, reason)
        self._notes.append(RuntimeNote(deployment.tier, "substituted", reason, (instead.name,)))

    def _send_drain(self, worker_id: str, reason: str) -> None:
        try:
            send_control(self.r, worker_id, Control(kind="drain", ts=self.clock(), reason=reason[:200]),
                         maxlen=CONTROL_MAXLEN)
        except TRANSIENT as exc:  # the pod's deletion sends SIGTERM, which drains it as well
            log.warning("cannot send drain to %s over Redis (%s): its SIGTERM will drain it", worker_id, exc)

    def _check_grace(self, deployment: Deployment, drain_timeout_s: float | None) -> None:
        why = short_grace(deployment, drain_timeout_s, deployment.tier in self.rq_pods, DEFAULT_GRACE_S)
        if why is not None and deployment.name not in self._warned_grace:
            self._warned_grace.add(deployment.name)
            log.warning("%s", why)

    def stop_all(self, timeout: float | None = None) -> Handles:
        """Nothing: the Deployments keep their replicas (see the module's doc)."""
        log.warning("the kubernetes runtime leaves the worker Deployments as they are on exit: "
                    "scale them with kubectl to stop the workers")
        return []

    # --- observe -------------------------------------------------------------------------
    def notes(self) -> Notes:
        out = self._notes.copy()
        self._notes.clear()  # (the same list: ``groups`` appends to it)
        return out

    def list(self) -> Handles:
        """Pods (live, draining, ended and not reaped) and placeholders, from the last listing."""
        return self.listing.list()

    def has_exits(self) -> bool:
        return self.listing.has_exits()

    def reap(self) -> Handles:
        """List again (at most every ``poll_s``) and hand over the pods that ended."""
        return self.listing.reap()

    def adopt(self) -> Handles:
        """List now; the pods that predate this runtime, once."""
        return self.listing.adopt()
