"""Since when the workers' reports can be trusted to describe their load.

The first pass of a leadership, a pass after a failed one, or a pass after a long stall (Redis
paused) ends an outage: reports made before it do not describe the workers' load (they could
not reach Redis, or the commander did not see them), so scale-in waits for reports made after
it, and a missing heartbeat counts as a dead worker only after a grace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("fleet.commander")
MIN_STALL_S = 2.0  # a gap between passes longer than this (and three intervals) is a stall


class Outages:
    """Notes each pass, and when the last outage of the commander's view ended."""

    def __init__(self, interval_s: float, monotonic: Callable[[], float]) -> None:
        self._stall_s = max(3 * interval_s, MIN_STALL_S)
        self._monotonic = monotonic
        self._last_pass: float | None = None  # monotonic start of the last pass
        self.trusted_since = 0.0  # wall time the last outage ended: older reports are not trusted

    def interrupted(self) -> None:
        """The view was interrupted (a failed pass, a new leadership): the next pass ends it."""
        self._last_pass = None

    def note_pass(self, now: float) -> None:
        """A pass starts at wall time ``now``: it ends an outage if one was under way."""
        mono = self._monotonic()
        if self._last_pass is None or mono - self._last_pass > self._stall_s:
            if self.trusted_since:
                log.warning("observations were interrupted: scale-in waits for new reports")
            self.trusted_since = now
        self._last_pass = mono
