"""The ``kubernetes`` runtime: one worker Deployment per tier, whose replicas Fleet alone writes.

A group's pool ``<tier>.<group>`` (protocol.groups) is a tier of its own here: its Deployment is
the one labelled ``fleet.dev/tier=<tier>`` and ``fleet.dev/group=<group>`` (a tier's own has no
group label), made from a copy of the tier's when the group gives an image (``k8s_groups.py``).

A tier's Deployment is the one labelled ``app.kubernetes.io/component=worker`` and
``fleet.dev/tier=<tier>`` in the runtime's namespace (the manifests name it
``fleet-worker-<tier>``, ``_`` as ``-``; only the labels count). Its pods carry the same labels,
and each pod's worker registers under the pod's name (``FLEET_WORKER_POD_NAME``). A tier of kind
rq is run the same way by pods of ``fleet rq-worker``, known by RQ's worker registry and retired by
their SIGTERM (RQ's warm shutdown), with no drain over Redis (``k8s_rq.py``).

- ``spawn(tier, n)`` raises the Deployment's ``spec.replicas`` by ``n`` through its ``/scale``
  subresource (read, then a patch conditional on the resourceVersion read) and returns ``n``
  placeholder ids (``<deployment>:starting-<k>``): the pods do not exist yet. A placeholder
  counts as a starting worker until a pod takes its place (``k8s_view.placeholders``: replicas
  the ReplicaSet has not created a pod for), so the commander's anti-windup sees them.
- ``retire(pod)`` gives the pod the lowest ``controller.kubernetes.io/pod-deletion-cost`` (one
  above it on any other pod that had it), sends it the drain command and lowers replicas by one,
  so the ReplicaSet deletes the pod the commander chose; it is DRAINING (no capacity) from then
  on. A pod the ReplicaSet deletes first whatever the costs (unscheduled, Pending, not ready)
  goes instead: replicas are lowered, the victim keeps serving and a ``substituted`` note says so.
- Before it writes, the runtime checks that the tier has exactly one Deployment and that no
  HorizontalPodAutoscaler or KEDA ScaledObject targets it (listed at most every
  ``check_ttl_s``); else ``refusal`` says why and ``spawn``/``retire`` raise ``Refused``.
- ``reap``/``list``/``adopt`` come from one listing of the namespace's worker pods and
  Deployments every ``poll_s`` (two LIST calls) joined with the worker registry
  (``k8s_listing.py``, ``k8s_view.reconcile``).
- ``stop_all`` changes nothing: on Kubernetes a commander's exit is a rollout or a failover to
  its standby, not the fleet's end; scale the Deployments with kubectl to stop the workers.

API errors while listing leave the last view in place (logged every 30 s at most); errors
while writing are raised to the commander, which logs them and retries on its next pass.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import redis

from commander.runtime.interface import (
    Handles,
    Lifecycle,
    Notes,
    Refused,
    Runtime,
    RuntimeNote,
    UnknownWorker,
    WorkerHandle,
    WorkerIds,
)
from commander.runtime.kubernetes.api import ApiException, KubeApi
from commander.runtime.kubernetes.group_deployments import GroupDeployments
from commander.runtime.kubernetes.listing import API_ERRORS, Listing, describe
from commander.runtime.kubernetes.model import Deployment, Pod, cost_patches, outranking, refusal
from commander.runtime.kubernetes.reconcile import Retiring, live_pods
from commander.runtime.kubernetes.rq_pods import RqPods, short_grace
from protocol.groups import validate_pool
from protocol.models import Control
from stores.control import send_control
from stores.retry import TRANSIENT

log = logging.getLogger(__name__)
CONFLICT_TRIES = 3  # a /scale patch that meets a newer resourceVersion is read and tried again
CONTROL_MAXLEN = 64
WRITE_BACKOFF_S = 10.0  # a failed write to a tier's Deployment or pods holds its writes off this long
DEFAULT_GRACE_S = 30.0  # a pod's terminationGracePeriodSeconds when its spec says none
Scalers = dict[str, list[str]] | str  # deployment -> the autoscalers on it; or why unknown


class KubernetesRuntime(RqPods, GroupDeployments, Listing, Runtime):
    """Worker pods of one Deployment per tier, in one namespace. Not thread-safe: one loop owns it."""

    name = "kubernetes"

    def __init__(self, api: KubeApi, r: redis.Redis, *, poll_s: float = 1.0, check_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.api, self.r, self.namespace = api, r, api.namespace
        self.poll_s, self.check_ttl_s = poll_s, check_ttl_s
        self.clock, self.monotonic = clock, monotonic
        self.going_s = max(10.0, 5 * poll_s)  # a substituted pod is expected to go within this
        self._deployments: list[Deployment] | None = None  # None: never listed
        self._pods: list[Pod] = []
        self._handles: dict[str, WorkerHandle] = {}
        self._placeholders: dict[str, list[WorkerHandle]] = {}
        self._retiring: dict[str, Retiring] = {}
        self._rq: dict[str, tuple[str, ...]] = {}  # rq tiers (configure, k8s_rq): tier -> queues
        self._going: dict[str, float] = {}  # pod -> monotonic time the expectation lapses
        self._exits: list[WorkerHandle] = []
        self._notes: list[RuntimeNote] = []
        self._unclean: set[str] = set()  # registry entries of ended pods still to remove
        self._scalers: tuple[float, Scalers] | None = None  # (until, value)
        self._listed_at: float | None = None
        self._api_error: str | None = None
        self._logged_at = float("-inf")
        self._adopted: set[str] = set()
        self._warned_grace: set[str] = set()
        self._failed: dict[str, tuple[float, str]] = {}  # tier -> (monotonic until, why): a write failed
        self._misnamed: set[str] = set()  # registry entries of pods under another id (warned)
        self._seq = itertools.count(1)

    def close(self) -> None:
        self.api.close()
        self.r.close()

    # --- may it act? ---------------------------------------------------------------------
    def refusal(self, tier: str) -> str | None:
        """Why the tier's replicas may not be written now (no single Deployment, another
        autoscaler on it, or the API could not say), or None."""
        self._refresh()
        group_why = self._group_check(tier)  # (a group's pool: its Deployment made, its image set)
        if group_why is not None:
            return group_why
        deployment = self._deployment(tier)
        if isinstance(deployment, str):
            return deployment
        until, why = self._failed.get(tier, (0.0, ""))
        if self.monotonic() < until:
            return why
        return refusal(tier, deployment, self._scalers_now())

    def _scalers_now(self) -> Scalers:
        now = self.monotonic()
        if self._scalers is not None and now < self._scalers[0]:
            return self._scalers[1]
        value: Scalers
        try:
            value, ttl = self.api.scalers(), self.check_ttl_s
        except API_ERRORS as exc:
            value, ttl = describe(exc), min(5.0, self.check_ttl_s)  # asked again soon
        self._scalers = (now + ttl, value)
        return value

    def _acting_on(self, tier: str) -> Deployment:
        why = self.refusal(tier)
        if why is not None:
            raise Refused(why)
        deployment = self._deployment(tier)
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
        before, after = self._scale(deployment, n)
        new = [self._placeholder(deployment) for _ in range(n)]
        self._placeholders.setdefault(tier, []).extend(new)
        self._sync_placeholders(tier)
        log.info("tier %s: Deployment %s replicas %d -> %d through /scale", tier, deployment.name,
                 before, after)
        return [h.worker_id for h in new]

    def retire(self, worker_id: str, reason: str = "", drain_timeout_s: float | None = None) -> None:
        """Make the pod the ReplicaSet's cheapest, drain it, lower replicas by one."""
        handle = self._handles.get(worker_id)
        if handle is None:
            self._retire_placeholder(worker_id)
            return
        if handle.state in (Lifecycle.DRAINING, Lifecycle.EXITED):
            return
        deployment = self._acting_on(handle.tier)  # (it may list again: look the pod up after)
        handle = self._handles.get(worker_id)
        victim = next((p for p in self._pods if p.name == worker_id), None)
        if handle is None or victim is None or handle.state is Lifecycle.DRAINING:
            return  # it ended, or began to, meanwhile
        live = live_pods(self._pods, handle.tier, self._retiring, self._going)
        ahead = outranking(victim, live)
        if ahead:
            self._substitute(deployment, victim, ahead[0])
            return
        patches = cost_patches(victim, live)
        with self._writing(deployment):
            for name in sorted(patches, key=lambda name: name == worker_id):  # the victim last
                self.api.annotate(name, patches[name])
                self._pods = [replace(p, cost=patches[name]) if p.name == name else p for p in self._pods]
        if handle.tier not in self._rq:  # an RQ worker's drain is its SIGTERM (k8s_rq)
            self._send_drain(worker_id, reason)
        # draining from now on, even if lowering replicas fails: the worker drains and, once its
        # linger is over, exits; its container restarts and the pod counts again (revived)
        self._retiring[worker_id] = Retiring(victim.restarts, reason)
        handle.state, handle.retire_reason = Lifecycle.DRAINING, reason
        before, after = self._scale(deployment, -1)
        self._check_grace(deployment, drain_timeout_s)
        log.info("retiring pod %s (tier %s): deletion cost %d, drained, replicas %d -> %d: %s",
                 worker_id, handle.tier, patches.get(worker_id, victim.cost), before, after,
                 reason or "no reason given")

    def _retire_placeholder(self, worker_id: str) -> None:
        """A replica with no pod yet: lower replicas by one, so it is never created."""
        tier = next((t for t, hs in self._placeholders.items() if any(h.worker_id == worker_id for h in hs)),
                    None)
        if tier is None:
            raise UnknownWorker(worker_id)
        self._scale(self._acting_on(tier), -1)
        self._sync_placeholders(tier)

    def _substitute(self, deployment: Deployment, victim: Pod, instead: Pod) -> None:
        before, after = self._scale(deployment, -1)
        self._going[instead.name] = self.monotonic() + self.going_s
        if instead.name in self._handles:
            self._handles[instead.name].state = Lifecycle.DRAINING
        how = "unscheduled" if not instead.node else "Pending" if instead.pending else "not ready"
        reason = (f"replicas {before} -> {after}: the ReplicaSet deletes {how} pod {instead.name} "
                  f"before {victim.name}, whatever their deletion costs; {victim.name} keeps serving")
        log.warning("tier %s: %s", deployment.tier, reason)
        self._notes.append(RuntimeNote(deployment.tier, "substituted", reason, (instead.name,)))

    @contextlib.contextmanager
    def _writing(self, deployment: Deployment) -> Iterator[None]:
        """A write for the tier: one that fails holds its next writes off for ``WRITE_BACKOFF_S``
        (``refusal`` says why), so a lasting error (403: the Role lacks a verb) is neither
        retried every pass nor ledgered every pass."""
        try:
            yield
        except API_ERRORS as exc:
            why = (f"writing Deployment {deployment.name} failed ({describe(exc)}): "
                   f"not tried again for {WRITE_BACKOFF_S:g}s")
            self._failed[deployment.tier] = (self.monotonic() + WRITE_BACKOFF_S, why)
            raise

    def _scale(self, deployment: Deployment, delta: int) -> tuple[int, int]:
        """Add ``delta`` to the Deployment's replicas through ``/scale``: (before, after)."""
        with self._writing(deployment):
            return self._scale_once(deployment, delta)

    def _scale_once(self, deployment: Deployment, delta: int) -> tuple[int, int]:
        for attempt in range(1, CONFLICT_TRIES + 1):
            replicas, version = self.api.read_scale(deployment.name)
            target = max(0, replicas + delta)
            if target == replicas:
                return replicas, replicas
            try:
                after = self.api.write_scale(deployment.name, target, version)
            except ApiException as exc:
                if exc.status != 409 or attempt == CONFLICT_TRIES:
                    raise
                log.info("Deployment %s changed since it was read: reading /scale again", deployment.name)
                continue
            self._deployments = [replace(d, replicas=after) if d.name == deployment.name else d
                                 for d in self._deployments or ()]
            return replicas, after
        raise AssertionError("unreachable")  # (the loop returns or raises)

    def _send_drain(self, worker_id: str, reason: str) -> None:
        try:
            send_control(self.r, worker_id, Control(kind="drain", ts=self.clock(), reason=reason[:200]),
                         maxlen=CONTROL_MAXLEN)
        except TRANSIENT as exc:  # the pod's deletion sends SIGTERM, which drains it as well
            log.warning("cannot send drain to %s over Redis (%s): its SIGTERM will drain it", worker_id, exc)

    def _check_grace(self, deployment: Deployment, drain_timeout_s: float | None) -> None:
        why = short_grace(deployment, drain_timeout_s, deployment.tier in self._rq, DEFAULT_GRACE_S)
        if why is not None and deployment.name not in self._warned_grace:
            self._warned_grace.add(deployment.name)
            log.warning("%s", why)

    def notes(self) -> Notes:
        out, self._notes = self._notes, []
        return out

    def stop_all(self, timeout: float | None = None) -> Handles:
        """Nothing: the Deployments keep their replicas (see the module's doc)."""
        log.warning("the kubernetes runtime leaves the worker Deployments as they are on exit: "
                    "scale them with kubectl to stop the workers")
        return []
