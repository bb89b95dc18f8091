"""Workers that keep exiting at start are started again with exponential back-off, as a
kubelet's CrashLoopBackOff: after the n-th failure in a row the pool's next start waits
``min(cap_s, first_s * 2**(n-1))`` (1 s, 2 s, 4 s, ... 5 min). A failure is an exit nobody
asked for within ``healthy_s`` of the worker's start, or a start that never registered in time.
A worker of the pool started after the last failure that has run ``healthy_s`` ends the loop.

Only the back-off's schedule reads the injected clock; the runtime says when each worker
started (its handle's unix time), so "started after the last failure" compares like with like.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

FIRST_S = 1.0
CAP_S = 300.0
HEALTHY_S = 10.0


def backoff_s(failures: int, first_s: float = FIRST_S, cap_s: float = CAP_S) -> float:
    """The wait before the next start after ``failures`` failures in a row (0: none)."""
    return 0.0 if failures <= 0 else min(cap_s, first_s * 2.0 ** min(failures - 1, 64))


@dataclass
class _Loop:
    failures: int  # in a row
    until: float  # clock time before which no worker of the pool starts
    wait_s: float  # the wait that ``until`` ends
    started: float  # unix start time of the last failed worker
    why: str  # the last failure: the worker, its exit code, the last line of its log


class CrashLoops:
    """The pools in a crash loop, and how long each still waits. Owned by one runtime's loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, first_s: float = FIRST_S,
                 cap_s: float = CAP_S, healthy_s: float = HEALTHY_S) -> None:
        self._clock, self.first_s, self.cap_s, self.healthy_s = clock, first_s, cap_s, healthy_s
        self._loops: dict[str, _Loop] = {}

    def failed(self, pool: str, started: float, why: str) -> None:
        """A worker of ``pool`` that started at ``started`` (unix time) failed at start."""
        failures = self._loops[pool].failures + 1 if pool in self._loops else 1
        wait = backoff_s(failures, self.first_s, self.cap_s)
        self._loops[pool] = _Loop(failures, self._clock() + wait, wait, started, why)

    def healthy(self, pool: str, started: float) -> None:
        """A worker of ``pool`` that started at ``started`` has run ``healthy_s``: if it started
        after the last failure, the loop is over."""
        loop = self._loops.get(pool)
        if loop is not None and started > loop.started:
            del self._loops[pool]

    def waiting_s(self, pool: str) -> float:
        """The wait the pool's last failure set (0 when it is in no loop)."""
        loop = self._loops.get(pool)
        return loop.wait_s if loop else 0.0

    def refusal(self, pool: str) -> str | None:
        """Why no worker of ``pool`` may start now (one line, the same for the whole wait), or None."""
        loop = self._loops.get(pool)
        if loop is None or self._clock() >= loop.until:
            return None
        return f"{self._line(loop)}; no start for {loop.wait_s:g} s (crash-loop back-off)"

    def loops(self) -> dict[str, str]:
        """Every pool in a loop (waiting, or started again and not yet healthy): one line each."""
        return {pool: self._line(loop) for pool, loop in sorted(self._loops.items())}

    @staticmethod
    def _line(loop: _Loop) -> str:
        return f"its workers keep exiting at start ({loop.failures} in a row, the last: {loop.why})"
