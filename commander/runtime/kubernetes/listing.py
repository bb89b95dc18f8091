"""What the ``kubernetes`` runtime knows of its workers: one listing of the namespace's worker
Deployments and pods every ``poll_s``, joined with the worker registry (``reconcile.py``), what
the runtime did to them (pods retired, pods expected to go instead of a victim), and the
placeholders of replicas that have no pod yet.

Polled, not watched: the commander's loop is a blocking loop of passes, and two LIST calls a
second are cheap for the API server and need no watch to resume after a 410 Gone. An API error
leaves the last view in place (logged every ``LOG_EVERY_S`` at most); the listing is tried again
at the next pass.
"""

from __future__ import annotations

import builtins
import itertools
import logging
from collections.abc import Callable
from dataclasses import replace

import redis

from commander.runtime.interface import Handles, Lifecycle, WorkerHandle
from commander.runtime.kubernetes.api import API_ERRORS, KubeApi, describe
from commander.runtime.kubernetes.model import Deployment, Pod, tier_deployment
from commander.runtime.kubernetes.reconcile import Retiring, live_pods, placeholders, reconcile
from commander.runtime.kubernetes.rq_pods import RqPods
from stores.registry import forget_workers, read_registry
from stores.retry import TRANSIENT

log = logging.getLogger(__name__)
LOG_EVERY_S = 30.0


class Listing:
    """The last listing and the workers' handles made from it. Not thread-safe: one loop owns it."""

    def __init__(self, api: KubeApi, r: redis.Redis, rq: RqPods, *, poll_s: float,
                 clock: Callable[[], float], monotonic: Callable[[], float]) -> None:
        """``rq``: which pods run RQ workers, and their registry."""
        self.api, self.r, self.rq = api, r, rq
        self.poll_s, self.clock, self.monotonic = poll_s, clock, monotonic
        self.deployments: builtins.list[Deployment] | None = None  # None: never listed
        self.pods: builtins.list[Pod] = []
        self._listed_at: float | None = None
        self._api_error: str | None = None
        self._logged_at = float("-inf")
        self._handles: dict[str, WorkerHandle] = {}
        self._placeholders: dict[str, builtins.list[WorkerHandle]] = {}
        self._retiring: dict[str, Retiring] = {}
        self._going: dict[str, float] = {}  # pod -> monotonic time the expectation lapses
        self._exits: builtins.list[WorkerHandle] = []
        self._unclean: set[str] = set()  # registry entries of ended pods still to remove
        self._adopted: set[str] = set()
        self._misnamed: set[str] = set()  # registry entries of pods under another id (warned)
        self._seq = itertools.count(1)

    # --- the runtime's view --------------------------------------------------------------
    def list(self) -> Handles:
        """Pods (live, draining, ended and not reaped) and placeholders, from the last listing."""
        starting = [h for hs in self._placeholders.values() for h in hs]
        return [replace(h) for h in (*self._handles.values(), *starting, *self._exits)]

    def has_exits(self) -> bool:
        return bool(self._exits)

    def reap(self) -> Handles:
        """List again (at most every ``poll_s``) and hand over the pods that ended."""
        self.refresh()
        self._clean_registry()
        exits, self._exits = self._exits, []
        return exits

    def adopt(self) -> Handles:
        """List now; the pods that predate this runtime, once."""
        self.refresh(force=True)
        found = [h for h in self._handles.values() if h.adopted and h.worker_id not in self._adopted]
        self._adopted.update(h.worker_id for h in found)
        return [replace(h) for h in found]

    def handle(self, worker_id: str) -> WorkerHandle | None:
        """A copy of the pod's handle (None: no such pod, or a placeholder)."""
        handle = self._handles.get(worker_id)
        return None if handle is None else replace(handle)

    def pod(self, name: str) -> Pod | None:
        return next((p for p in self.pods if p.name == name), None)

    def deployment(self, tier: str) -> Deployment | str:
        """The pool's one Deployment, or why there is not exactly one (or no listing)."""
        if self.deployments is None:
            return (f"the worker Deployments of namespace {self.api.namespace} could not be listed "
                    f"({self._api_error or 'not yet'})")
        return tier_deployment(tier, self.deployments, self.api.namespace)

    def live_pods(self, tier: str) -> builtins.list[Pod]:
        """The tier's pods that are capacity, now or soon (see ``reconcile.live_pods``)."""
        return live_pods(self.pods, tier, self._retiring, self._going)

    # --- what the runtime did ------------------------------------------------------------
    def retiring(self, worker_id: str, restarts: int, reason: str) -> None:
        """The pod was retired (drained, replicas lowered for it): DRAINING from now on."""
        self._retiring[worker_id] = Retiring(restarts, reason)
        handle = self._handles[worker_id]
        handle.state, handle.retire_reason = Lifecycle.DRAINING, reason

    def expect_gone(self, name: str, until: float) -> None:
        """The ReplicaSet is expected to delete pod ``name`` (instead of a victim) before the
        monotonic time ``until``: DRAINING meanwhile."""
        self._going[name] = until
        if name in self._handles:
            self._handles[name].state = Lifecycle.DRAINING

    def set_replicas(self, name: str, replicas: int) -> None:
        self.deployments = [replace(d, replicas=replicas) if d.name == name else d
                            for d in self.deployments or ()]

    def put_deployment(self, deployment: Deployment) -> None:
        """A Deployment made or patched by the runtime, in place of the listed one of its name."""
        self.deployments = [d for d in self.deployments or () if d.name != deployment.name] + [deployment]

    def drop_deployment(self, name: str) -> None:
        self.deployments = [d for d in self.deployments or () if d.name != name]

    def set_cost(self, name: str, cost: int) -> None:
        self.pods = [replace(p, cost=cost) if p.name == name else p for p in self.pods]

    # --- placeholders --------------------------------------------------------------------
    def add_placeholders(self, deployment: Deployment, n: int) -> builtins.list[str]:
        """``n`` new starting workers for replicas just added to the Deployment; their ids."""
        new = [self._placeholder(deployment) for _ in range(n)]
        self._placeholders.setdefault(deployment.tier, []).extend(new)
        self.sync_placeholders(deployment.tier)
        return [h.worker_id for h in new]

    def placeholder_tier(self, worker_id: str) -> str | None:
        return next((t for t, hs in self._placeholders.items() if any(h.worker_id == worker_id for h in hs)),
                    None)

    def sync_placeholders(self, tier: str) -> None:
        """As many placeholders as replicas without a pod; the oldest go first (pods came for them)."""
        deployment = self.deployment(tier)
        want = placeholders(deployment, self.pods, self._retiring, self._going)
        have = self._placeholders.setdefault(tier, [])
        del have[:max(0, len(have) - want)]
        while len(have) < want and isinstance(deployment, Deployment):
            have.append(self._placeholder(deployment))
        if not have:
            del self._placeholders[tier]

    def _placeholder(self, deployment: Deployment) -> WorkerHandle:
        return WorkerHandle(f"{deployment.name}:starting-{next(self._seq)}", deployment.tier, 0,
                            Lifecycle.STARTING, self.clock())

    # --- listing -------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """List the Deployments and pods again, unless the last listing is under ``poll_s`` old."""
        now = self.monotonic()
        if not force and self._listed_at is not None and now - self._listed_at < self.poll_s:
            return
        try:
            deployments, pods = self.api.deployments(), self.api.pods()
        except API_ERRORS as exc:
            self._api_failed("listing the worker Deployments and pods", exc)
            return
        self._api_ok()
        registry = self._registry()
        first, self._listed_at = self._listed_at is None, now
        self.deployments, self.pods = deployments, pods
        self._going = {name: until for name, until in self._going.items() if until > now}
        registered = self.rq.registered(registry, pods, self._handles.values())
        view = reconcile(self._handles, pods, registered, self._retiring, self._going, self.clock(), first)
        for name in view.revived:
            log.warning("pod %s was drained but the ReplicaSet kept it (its container restarted): "
                        "it serves again", name)
        self._handles, self._retiring = view.handles, view.retiring
        self._exits += view.exits
        self._unclean.update(h.worker_id for h in view.exits
                             if registry is not None and h.worker_id in registry)
        for tier in {d.tier for d in deployments} | set(self._placeholders):
            self.sync_placeholders(tier)

    def _registry(self) -> dict[str, bool] | None:
        """Worker id -> heartbeat alive, for every registry entry (None: Redis unreachable)."""
        try:
            registry = read_registry(self.r)
        except TRANSIENT as exc:
            log.debug("registry not readable: pods keep their states (%s)", exc)
            return None
        for wid, (info, _alive) in registry.workers.items():
            if info.pod and info.pod != wid and wid not in self._misnamed:
                self._misnamed.add(wid)
                log.warning("worker %s runs in pod %s under another id: the kubernetes runtime knows "
                            "a pod's worker by the pod's name (leave FLEET_WORKER_WORKER_ID unset)",
                            wid, info.pod)
        return {**dict.fromkeys(registry.unreadable, False),
                **{wid: alive for wid, (_info, alive) in registry.workers.items()}}

    def _clean_registry(self) -> None:
        """Remove what an ended pod's worker could not (it was killed): entry, heartbeat, control."""
        if not self._unclean:
            return
        try:
            forget_workers(self.r, sorted(self._unclean))
        except TRANSIENT as exc:
            log.debug("registry cleanup postponed: %s", exc)
            return
        self._unclean.clear()

    def _api_failed(self, what: str, exc: BaseException) -> None:
        self._api_error = describe(exc)
        now = self.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning("%s failed (%s): acting on the last view until the API answers",
                        what, self._api_error)
            self._logged_at = now

    def _api_ok(self) -> None:
        if self._api_error is not None:
            log.info("the Kubernetes API answers again")
        self._api_error, self._logged_at = None, float("-inf")
