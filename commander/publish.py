"""What each judged tier publishes: the starting workers' slots for the request edge
(``stores.backlog.write_starting``), the metrics, and its row on the monitor's board."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from commander.decide import Plan
from commander.leadership import Leadership
from commander.metrics import Metrics
from commander.monitor.board import Board, TierSeen
from commander.observe import Observer
from commander.snapshot import TierSnapshot, WorkerView
from stores.backlog import write_starting
from stores.policies import PolicyRead


class Publisher:
    """Publishes each tier's pass; keeps the pressure events' running total per tier."""

    def __init__(self, r: redis.Redis, board: Board, observer: Observer, leadership: Leadership,
                 metrics: Metrics | None, interval_s: float) -> None:
        self._r, self._board, self._observer, self._leadership = r, board, observer, leadership
        self._metrics = metrics
        self._starting_ttl_ms = int(3 * interval_s * 1000) + 1000  # outlives two missed passes
        self._pressure_total: dict[str, int] = {}
        self._starting: dict[str, int] = {}  # tier -> slots starting, this pass's, until sent

    def send(self) -> None:
        """Send what the pass's tiers publish in Redis (their starting slots), in one round trip."""
        if self._starting:
            write_starting(self._r, self._starting, ttl_ms=self._starting_ttl_ms)
            self._starting = {}

    def tier(self, read: PolicyRead, snap: TierSnapshot, plan: Plan, views: Sequence[WorkerView], *,
             now: float, decide_s: float, error: str | None, group_rejected: str | None) -> None:
        """One tier judged at ``now`` (``decide_s``: how long ``decide`` took; ``error``: why its
        policy key or group is rejected)."""
        tier = snap.tier
        starting = sum(1 for v in views if v.state == "starting")
        slots = read.policy.scale_rules().concurrency
        self._starting[tier] = starting * slots
        self._observe(tier, snap, plan, views, starting, decide_s)
        self._board.tier(TierSeen(tier=tier, ts=now, policy=read.policy, source=read.source, error=error,
                                  snapshot=snap, plan=plan, starting=starting, group_rejected=group_rejected))

    def _observe(self, tier: str, snap: TierSnapshot, plan: Plan, views: Sequence[WorkerView],
                 starting: int, decide_s: float) -> None:
        self._pressure_total[tier] = self._pressure_total.get(tier, 0) + snap.pressure_events
        if self._metrics is None:
            return
        running = sum(1 for v in views if v.state == "ready")
        self._metrics.observe_tier(tier, snap, plan, running, starting, self._pressure_total[tier])
        self._metrics.observe_workers(tier, list(views))
        self._metrics.observe_turns(tier, self._observer.turns.tier(tier))
        self._metrics.decide_seconds(decide_s)
        self._metrics.is_leader(self._leadership.leading)
