"""The rollout guard, pure: the canary's error rate and latency over a window against the other
groups', and the verdict that aborts it (``RolloutGuard`` in the policy).

The counts come from the workers' reports (their cumulative ``counters``, as the evaluator's
rows keep them): per worker, the difference between its newest row and its oldest one inside
the window (a worker that restarted counts from its first report there).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from commander.evaluator import Row
from protocol.groups import RolloutGuard


@dataclass(frozen=True)
class GroupWindow:
    """What a group's workers did inside the window."""

    turns: float = 0.0
    errors: float = 0.0
    handler_s: float = 0.0

    @property
    def error_rate(self) -> float:
        """The share of handler calls that failed: ``errors`` counts every failed attempt (a
        retried turn fails, then is answered: one error, one turn), so errors per turn could
        pass 100 %; failed calls per call (turns + errors) cannot."""
        calls = self.turns + self.errors
        return self.errors / calls if calls else 0.0

    @property
    def latency_s(self) -> float:
        """Mean handler seconds per turn."""
        return self.handler_s / self.turns if self.turns else 0.0

    def __add__(self, other: GroupWindow) -> GroupWindow:
        return GroupWindow(self.turns + other.turns, self.errors + other.errors,
                           self.handler_s + other.handler_s)


def worker_window(rows: Sequence[Row], now: float, window_s: float) -> GroupWindow:
    """One worker's counts over the last ``window_s`` (its rows oldest first)."""
    inside = [r for r in rows if now - window_s <= r.ts <= now]
    if len(inside) < 2:
        return GroupWindow()
    first, last = inside[0], inside[-1]
    if last.turns < first.turns:  # counters went back: not the same process
        return GroupWindow()
    return GroupWindow(float(last.turns - first.turns), float(last.errors - first.errors),
                       max(0.0, last.handler_seconds - first.handler_seconds))


def pool_window(workers: Iterable[Sequence[Row]], now: float, window_s: float) -> GroupWindow:
    """The sum of :func:`worker_window` over a pool's workers."""
    total = GroupWindow()
    for rows in workers:
        total = total + worker_window(rows, now, window_s)
    return total


def judge_canary(canary: GroupWindow, baseline: GroupWindow, guard: RolloutGuard) -> str | None:
    """Why the canary must be aborted, or None (keep it). No verdict before both sides served
    ``min_turns`` turns in the window."""
    if canary.turns < guard.min_turns or baseline.turns < guard.min_turns:
        return None
    margin = guard.error_rate_margin
    if margin is not None and canary.error_rate > baseline.error_rate + margin:
        return (f"error rate {canary.error_rate:.1%} of handler calls over {canary.turns:.0f} turns vs "
                f"{baseline.error_rate:.1%} over {baseline.turns:.0f} on the other groups "
                f"(margin {margin:.1%}, window {guard.window_s:.0f}s)")
    slower = guard.latency_margin
    if slower is not None and baseline.latency_s > 0 and \
            canary.latency_s > baseline.latency_s * (1 + slower):
        return (f"handler latency {canary.latency_s * 1000:.0f} ms per turn vs "
                f"{baseline.latency_s * 1000:.0f} ms on the other groups (margin {slower:.0%}, "
                f"window {guard.window_s:.0f}s)")
    return None
