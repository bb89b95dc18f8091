"""Act on a plan through the runtime, each change in the ledger.

Retirements are ledgered first, then carried out (fenced by the ledger append); a scale-up is
fenced by a lease renewal, carried out, then ledgered with the ids of the workers the runtime
started. Spawns stop at the fleet-wide cap ``max_total_workers``; a change of the plan's hold
reason (why a wanted scale-in did not happen) is ledgered once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from commander.decide import Plan
from commander.leadership import Leadership
from commander.ledger_writer import LedgerWriter
from commander.metrics import Direction, Metrics
from commander.runtime import Lifecycle, Runtime, UnknownWorker
from protocol.models import Control
from protocol.policy import ScaleRules
from stores.control import send_control

log = logging.getLogger("fleet.commander")


class Actor:
    """Carries out plans on one runtime."""

    def __init__(self, r: redis.Redis, runtime: Runtime, leadership: Leadership, ledger: LedgerWriter, *,
                 max_total_workers: int, metrics: Metrics | None, clock: Callable[[], float]) -> None:
        self._r, self._runtime, self._leadership, self._ledger = r, runtime, leadership, ledger
        self._max_total = max_total_workers
        self._metrics, self._clock = metrics, clock
        self._held: dict[str, str | None] = {}  # tier -> the hold reason last ledgered

    def apply(self, plan: Plan, policy: ScaleRules) -> None:
        """Spawn, retire and note the hold as ``plan`` says (``policy``: its drain timeout)."""
        self._spawn(plan)
        self._retire_all(plan, policy)
        if plan.held != self._held.get(plan.tier):
            if plan.held:
                self._ledger.record(plan.tier, "hold", plan, to=plan.current)
            self._held[plan.tier] = plan.held

    def retire(self, worker_id: str, reason: str, drain_timeout_s: float) -> None:
        """Drain one worker: through the runtime, or over Redis when the runtime does not run it
        (a worker started on another host)."""
        try:
            self._runtime.retire(worker_id, reason, drain_timeout_s)
        except UnknownWorker:
            send_control(self._r, worker_id, Control(kind="drain", ts=self._clock(), reason=reason[:200]),
                         maxlen=100)

    def _spawn(self, plan: Plan) -> None:
        spawn = min(plan.spawn, self._room())
        if spawn < plan.spawn:
            log.warning("tier %s wants %d more workers; the fleet-wide cap max_total_workers=%d "
                        "leaves room for %d", plan.tier, plan.spawn, self._max_total, spawn)
        if spawn <= 0:
            return
        self._leadership.confirm()  # the ids exist once spawned: the fence comes before, the entry after
        ids = self._runtime.spawn(plan.tier, spawn)
        self._ledger.record(plan.tier, "scale-up", plan, to=plan.current + spawn, spawned=ids)
        log.info("tier %s: %d -> %d (%s): spawned %s", plan.tier, plan.current, plan.current + spawn,
                 plan.reason, ", ".join(ids))
        self._count(plan.tier, "up")

    def _retire_all(self, plan: Plan, policy: ScaleRules) -> None:
        left = plan.current
        for action in dict.fromkeys(r.action for r in plan.retire):  # recycle, reclaim-idle, consolidate
            victims = [r.worker for r in plan.retire if r.action == action]
            self._ledger.record(plan.tier, action, plan, to=left - len(victims), victims=victims)
            for victim in victims:
                self.retire(victim, f"{action}: {plan.reason}", policy.controls.drain_timeout_s)
            log.info("tier %s: %d -> %d (%s): draining %s", plan.tier, left, left - len(victims),
                     plan.reason, ", ".join(victims))
            left -= len(victims)
            if action != "recycle":
                self._count(plan.tier, "down")

    def _room(self) -> int:
        """Workers this commander may still start under the fleet-wide cap (all tiers)."""
        running = sum(1 for h in self._runtime.list() if h.state is not Lifecycle.EXITED)
        return max(0, self._max_total - running)

    def _count(self, tier: str, direction: Direction) -> None:
        if self._metrics is not None:
            self._metrics.scale_event(tier, direction)
