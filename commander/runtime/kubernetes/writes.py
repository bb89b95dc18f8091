"""The ``kubernetes`` runtime's writes to a pool's Deployment and pods, and their backoff.

Replicas are written through the Deployment's ``/scale`` subresource: read, then a patch
conditional on the resourceVersion read (``CONFLICT_TRIES`` times when someone wrote it
meanwhile). A write that fails holds the pool's next writes off for ``WRITE_BACKOFF_S`` (``held``
says why), so a lasting error (403: the Role lacks a verb) is neither retried every pass nor
ledgered every pass.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping

from commander.runtime.kubernetes.api import API_ERRORS, ApiException, KubeApi, describe
from commander.runtime.kubernetes.listing import Listing
from commander.runtime.kubernetes.model import Deployment

log = logging.getLogger(__name__)
CONFLICT_TRIES = 3  # a /scale patch that meets a newer resourceVersion is read and tried again
WRITE_BACKOFF_S = 10.0  # a failed write to a pool's Deployment or pods holds its writes off this long


class Writes:
    """Writes to the pools' Deployments and pods; the listing is kept in step with them."""

    def __init__(self, api: KubeApi, listing: Listing, monotonic: Callable[[], float]) -> None:
        self.api, self.listing, self.monotonic = api, listing, monotonic
        self._failed: dict[str, tuple[float, str]] = {}  # pool -> (monotonic until, why)

    def held(self, pool: str) -> str | None:
        """Why the pool's writes are held off now (a write failed), or None."""
        until, why = self._failed.get(pool, (0.0, ""))
        return why if self.monotonic() < until else None

    @contextlib.contextmanager
    def writing(self, deployment: Deployment) -> Iterator[None]:
        """A write for the Deployment's pool: one that fails holds its next writes off."""
        try:
            yield
        except API_ERRORS as exc:
            why = (f"writing Deployment {deployment.name} failed ({describe(exc)}): "
                   f"not tried again for {WRITE_BACKOFF_S:g}s")
            self._failed[deployment.tier] = (self.monotonic() + WRITE_BACKOFF_S, why)
            raise

    def scale(self, deployment: Deployment, delta: int) -> tuple[int, int]:
        """Add ``delta`` to the Deployment's replicas through ``/scale``: (before, after)."""
        with self.writing(deployment):
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
            self.listing.set_replicas(deployment.name, after)
            return replicas, after
        raise AssertionError("unreachable")  # (the loop returns or raises)

    def deletion_costs(self, deployment: Deployment, costs: Mapping[str, int], last: str) -> None:
        """Set the pods' ``controller.kubernetes.io/pod-deletion-cost``, pod ``last`` last."""
        with self.writing(deployment):
            for name in sorted(costs, key=lambda name: name == last):
                self.api.annotate(name, costs[name])
                self.listing.set_cost(name, costs[name])
