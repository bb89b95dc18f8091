"""The ``kubernetes`` runtime's rq tiers: which pods run RQ workers, and RQ's registry of them.

A tier of kind rq has a Deployment found as a turns tier's is (``app.kubernetes.io/component=
worker``, ``fleet.dev/tier=<tier>``) whose container runs ``fleet rq-worker --queues …``: each
pod's RQ worker is named after the pod (``FLEET_WORKER_POD_NAME``, the downward API). What
differs from a turns tier:

- *Registered* means in RQ's worker registry under the pod's name (``stores.registry.
  rq_registered``), not in Fleet's. A pod counts as running once it is Running, Ready (a
  container without a readiness probe is Ready while it runs) and registered; a pod whose RQ
  worker died without deregistering (its container killed) is not Ready, so it counts as
  starting from the next listing on, not as a worker, until its container is back (the new RQ
  worker hands back what the dead one held: ``worker/rq/rq_worker.py``).
- An ended pod *left nothing behind* (``drained``) when RQ's registry no longer has its name: a
  warm shutdown deregisters last thing; one still registered died with its job, which the
  commander hands back to RQ.
- *Retiring* sends no drain over Redis: the pod's deletion is its kubelet's SIGTERM, RQ's warm
  shutdown (the job in hand finishes, then the worker exits), within the pod's
  ``terminationGracePeriodSeconds``; a shorter grace than the tier's ``drain_timeout_s`` is
  warned about once per Deployment (``short_grace``).

RQ's registry is read only for the pods of tiers the commander said are rq (``configure``):
without one, RQ's keys are none of this runtime's business (the commander's ACL may not grant
them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import redis

from commander.runtime.interface import WorkerHandle
from commander.runtime.kubernetes.model import Deployment, Pod
from stores.registry import rq_registered
from stores.retry import TRANSIENT

log = logging.getLogger(__name__)
RQ_JOB_TIMEOUT_S = 180  # RQ's default job timeout: what a warm shutdown may have to wait for


def rq_names(tiers: Iterable[str], pods: Iterable[Pod], handles: Iterable[WorkerHandle]) -> list[str]:
    """The pods of rq ``tiers`` whose RQ registration matters: listed now, or known before (an
    ended pod, gone from the listing, is judged by whether it deregistered)."""
    rq = set(tiers)
    return sorted({p.name for p in pods if p.tier in rq} | {h.worker_id for h in handles if h.tier in rq})


def rq_registry(names: Sequence[str], registered: Sequence[bool], pods: Iterable[Pod]) -> dict[str, bool]:
    """The registry ``reconcile.reconcile`` reads for rq pods: a name RQ has -> whether its pod is
    Running and Ready (its RQ worker alive); a name RQ does not have is left out (not registered,
    and on exit: left nothing behind)."""
    alive = {p.name: p.phase == "Running" and p.ready for p in pods}
    return {name: alive.get(name, False) for name, known in zip(names, registered, strict=True) if known}


def short_grace(deployment: Deployment, drain_timeout_s: float | None, rq: bool,
                default_s: float) -> str | None:
    """Why the Deployment's grace period is too short for the tier's ``drain_timeout_s``, or None."""
    grace = default_s if deployment.grace_s is None else deployment.grace_s
    if drain_timeout_s is None or grace >= drain_timeout_s:
        return None
    head = (f"Deployment {deployment.name}: terminationGracePeriodSeconds {grace:g} is under the "
            f"tier's drain_timeout_s {drain_timeout_s:g}: the kubelet kills")
    if rq:
        return (f"{head} an RQ worker's warm shutdown at {grace:g}s, and its job still running then is "
                f"run again (if it has retries left) or failed; set the tier's job_timeout_s (at most "
                f"drain_timeout_s) and a grace period over drain_timeout_s (without job_timeout_s, "
                f"RQ's default job timeout is {RQ_JOB_TIMEOUT_S}s)")
    return f"{head} a drain at {grace:g}s, and the turns in flight run again elsewhere"


class RqPods:
    """The rq tiers (``configure``), and the registry their pods' states are read from."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._tiers: dict[str, tuple[str, ...]] = {}  # tier -> its queues

    def configure(self, tier: str, kind: str, queues: Sequence[str] = ()) -> None:
        """Remember the rq tiers (their pods run RQ workers on ``queues``)."""
        if kind == "rq":
            self._tiers[tier] = tuple(queues) or (tier,)
        else:
            self._tiers.pop(tier, None)

    def __contains__(self, tier: object) -> bool:
        """Whether ``tier`` is an rq tier."""
        return tier in self._tiers

    def registered(self, registry: Mapping[str, bool] | None, pods: Sequence[Pod],
                   handles: Iterable[WorkerHandle]) -> Mapping[str, bool] | None:
        """Fleet's ``registry``, and for the rq tiers' pods RQ's (see ``rq_registry``); None when
        either could not be read (the pods keep their states). ``handles``: the last view's."""
        names = rq_names(self._tiers, pods, handles)
        if registry is None or not names:
            return registry
        try:
            registered = rq_registered(self.r, names)
        except TRANSIENT as exc:
            log.debug("RQ's worker registry not readable: pods keep their states (%s)", exc)
            return None
        return {**registry, **rq_registry(names, registered, pods)}
