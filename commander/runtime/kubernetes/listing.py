"""The ``kubernetes`` runtime's view of its workers (a mixin of ``KubernetesRuntime``): one
listing of the namespace's worker Deployments and pods every ``poll_s``, joined with the worker
registry (``k8s_view.reconcile``), and the placeholders of replicas that have no pod yet.

Polled, not watched: the commander's loop is a blocking loop of passes, and two LIST calls a
second are cheap for the API server and need no watch to resume after a 410 Gone. An API error
leaves the last view in place (logged every ``LOG_EVERY_S`` at most); the listing is tried again
at the next pass.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import redis
import urllib3

from commander.runtime.interface import Handles, Lifecycle, Notes, WorkerHandle
from commander.runtime.kubernetes.api import ApiException, KubeApi
from commander.runtime.kubernetes.model import Deployment, Pod, tier_deployment
from commander.runtime.kubernetes.reconcile import Retiring, placeholders, reconcile
from stores.registry import forget_workers, read_registry
from stores.retry import TRANSIENT

log = logging.getLogger("commander.runtime.kubernetes")  # the runtime's logger
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)  # ValueError: bad JSON
LOG_EVERY_S = 30.0


def describe(exc: BaseException) -> str:
    """One line for an API error."""
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason or ''}".strip()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


class Listing:
    """The view side of ``KubernetesRuntime``, which provides the state below."""

    api: KubeApi
    r: redis.Redis
    namespace: str
    poll_s: float
    clock: Callable[[], float]
    monotonic: Callable[[], float]
    _deployments: list[Deployment] | None
    _pods: list[Pod]
    _handles: dict[str, WorkerHandle]
    _placeholders: dict[str, list[WorkerHandle]]
    _retiring: dict[str, Retiring]
    _going: dict[str, float]
    _exits: list[WorkerHandle]
    _notes: Notes
    _unclean: set[str]
    _listed_at: float | None
    _api_error: str | None
    _logged_at: float
    _adopted: set[str]
    _misnamed: set[str]
    _seq: itertools.count[int]

    def list(self) -> Handles:
        """Pods (live, draining, ended and not reaped) and placeholders, from the last listing."""
        starting = [h for hs in self._placeholders.values() for h in hs]
        return [replace(h) for h in (*self._handles.values(), *starting, *self._exits)]

    def has_exits(self) -> bool:
        return bool(self._exits)

    def reap(self) -> Handles:
        """List again (at most every ``poll_s``) and hand over the pods that ended."""
        self._refresh()
        self._clean_registry()
        exits, self._exits = self._exits, []
        return exits

    def adopt(self) -> Handles:
        """List now; the pods that predate this runtime, once."""
        self._refresh(force=True)
        found = [h for h in self._handles.values() if h.adopted and h.worker_id not in self._adopted]
        self._adopted.update(h.worker_id for h in found)
        return [replace(h) for h in found]

    def _refresh(self, force: bool = False) -> None:
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
        self._deployments, self._pods = deployments, pods
        self._going = {name: until for name, until in self._going.items() if until > now}
        view = reconcile(self._handles, pods, self._registered(registry, pods), self._retiring,
                         self._going, self.clock(), first)
        for name in view.revived:
            log.warning("pod %s was drained but the ReplicaSet kept it (its container restarted): "
                        "it serves again", name)
        self._handles, self._retiring = view.handles, view.retiring
        self._exits += view.exits
        self._unclean.update(h.worker_id for h in view.exits
                             if registry is not None and h.worker_id in registry)
        for tier in {d.tier for d in deployments} | set(self._placeholders):
            self._sync_placeholders(tier)

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

    def _registered(self, registry: Mapping[str, bool] | None,
                    pods: Sequence[Pod]) -> Mapping[str, bool] | None:
        """The registry the pods' states are read from (the rq tiers' pods: RQ's, ``k8s_rq``)."""
        return registry

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

    def _sync_placeholders(self, tier: str) -> None:
        """As many placeholders as replicas without a pod; the oldest go first (pods came for them)."""
        deployment = self._deployment(tier)
        want = placeholders(deployment, self._pods, self._retiring, self._going)
        have = self._placeholders.setdefault(tier, [])
        del have[:max(0, len(have) - want)]
        while len(have) < want and isinstance(deployment, Deployment):
            have.append(self._placeholder(deployment))
        if not have:
            del self._placeholders[tier]

    def _placeholder(self, deployment: Deployment) -> WorkerHandle:
        return WorkerHandle(f"{deployment.name}:starting-{next(self._seq)}", deployment.tier, 0,
                            Lifecycle.STARTING, self.clock())

    def _deployment(self, tier: str) -> Deployment | str:
        if self._deployments is None:
            return (f"the worker Deployments of namespace {self.namespace} could not be listed "
                    f"({self._api_error or 'not yet'})")
        return tier_deployment(tier, self._deployments, self.namespace)

    # --- API errors ----------------------------------------------------------------------
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
