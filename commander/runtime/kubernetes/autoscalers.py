"""The other autoscalers of the namespace (HPAs, KEDA ScaledObjects), listed at most every
``ttl_s``: a Deployment one of them targets is not Fleet's to scale (``model.refusal``)."""

from __future__ import annotations

from collections.abc import Callable

from commander.runtime.kubernetes.api import API_ERRORS, KubeApi, describe

Scalers = dict[str, list[str]] | str  # deployment -> the autoscalers on it; or why unknown
ERROR_TTL_S = 5.0  # a listing that failed is tried again this soon (at most ttl_s)


class Autoscalers:
    """The last listing of the autoscalers, kept ``ttl_s``."""

    def __init__(self, api: KubeApi, ttl_s: float, monotonic: Callable[[], float]) -> None:
        self.api, self.ttl_s, self.monotonic = api, ttl_s, monotonic
        self._cached: tuple[float, Scalers] | None = None  # (until, value)

    def now(self) -> Scalers:
        """Deployment name -> the autoscalers that target it; or why they could not be listed."""
        now = self.monotonic()
        if self._cached is not None and now < self._cached[0]:
            return self._cached[1]
        value: Scalers
        try:
            value, ttl = self.api.scalers(), self.ttl_s
        except API_ERRORS as exc:
            value, ttl = describe(exc), min(ERROR_TTL_S, self.ttl_s)  # asked again soon
        self._cached = (now + ttl, value)
        return value
