"""Workers of ours whose process runs but whose heartbeat has been missing for ``hung_after_s``:
stopped (SIGSTOP), or hung where their own watchdog (``worker.watchdog``) cannot end them. The
runtime judges the workers it runs by their process, which lives, so without this such a worker
would hold a ``max_workers`` slot and serve nobody for ever. The commander retires it at once
(drain timeout 0: its runtime kills the process it started on its next reap), and its users are
taken over like a crashed worker's.

Only a running worker with a registry entry is judged: a start has its own deadline, a drain its
kill time, and an RQ worker no heartbeat of Fleet's. Time counts only while the commander's view
is trusted: after an outage (Redis away, the commander paused) every heartbeat may have expired,
the live workers' too, so the count starts again from the outage's end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from commander.runtime import Lifecycle, WorkerHandle
from protocol.models import WorkerInfo


class HungWorkers:
    """When each running worker of ours was first seen without a heartbeat."""

    def __init__(self, after_s: float, clock: Callable[[], float],
                 trusted_since: Callable[[], float]) -> None:
        """``clock``: wall time; ``trusted_since``: the wall time the last outage of the view ended."""
        self.after_s = after_s
        self._clock, self._trusted_since = clock, trusted_since
        self._missing: dict[str, float] = {}  # worker -> wall time its heartbeat was first missed

    def judge(self, registry: Mapping[str, tuple[WorkerInfo, bool]],
              handles: Iterable[WorkerHandle]) -> list[tuple[WorkerHandle, float]]:
        """The running workers whose heartbeat has been missing for ``after_s`` or more, each with
        how long (seconds); every other worker's count is dropped."""
        now = self._clock()
        missing: dict[str, float] = {}
        hung = []
        for handle in handles:
            entry = registry.get(handle.worker_id)
            if handle.state is not Lifecycle.RUNNING or entry is None or entry[1]:
                continue
            since = missing[handle.worker_id] = self._missing.get(handle.worker_id, now)
            missing_s = now - max(since, self._trusted_since())
            if missing_s >= self.after_s:
                hung.append((handle, missing_s))
        self._missing = missing
        return hung
