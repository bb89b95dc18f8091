"""The commander's records (a mixin of ``Commander``): ledger events, the decide state kept in
Redis between leaders, its entry in ``fleet:commanders``, the clean shutdown, and metrics."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import redis

from commander.decide import Plan, TierState
from commander.leader import Leadership
from commander.observe import Observer
from commander.runtime import Runtime
from commander.settings import CommanderSettings
from protocol.models import CommanderInfo, LedgerEvent
from stores.commanders import deregister_commander, forget_commanders, register_commander
from stores.decide_state import read_decide_state, write_decide_state
from stores.retry import TRANSIENT

log = logging.getLogger("fleet.commander")  # the commander's logger, as before the split
STATE_TTL_S = 86_400
FORGET_COMMANDER_S = 3600.0  # the leader removes entries of commanders not seen for this long


class Records:
    """Ledger, decide state, registry entry, shutdown and metrics for ``Commander``, which
    provides the state below."""

    r: redis.Redis
    runtime: Runtime
    settings: CommanderSettings
    metrics: Any | None
    clock: Callable[[], float]
    leader: Leadership
    observer: Observer
    started: float
    _pressure_total: dict[str, int]


    # --- ledger, state, registry ----------------------------------------------------------
    def _event(self, tier: str, action: str, plan: Plan | None = None, to: int | None = None,
               victims: list[str] | None = None, reason: str = "",
               why: dict[str, Any] | None = None, spawned: list[str] | None = None) -> LedgerEvent:
        current = plan.current if plan else 0
        return LedgerEvent(ts=self.clock(), tier=tier, epoch=self.leader.epoch or 0,
                           commander=self.settings.commander_id, action=action,
                           from_count=current, to_count=current if to is None else to,
                           victims=victims or [], spawned=spawned or [],
                           reason=reason or (plan.reason if plan else ""),
                           why=why if why is not None else (plan.why() if plan else {}))

    def _append(self, event: LedgerEvent) -> None:
        self.leader.append(event)

    def _load_state(self, tier: str) -> TierState:
        try:
            body = read_decide_state(self.r, tier)
            if body is None:
                return TierState()
            return TierState.from_body(body)
        except (ValueError, KeyError, TypeError):
            log.warning("tier %s: unreadable saved decide state, starting afresh", tier)
            return TierState()

    def _save_state(self, tier: str, state: TierState) -> None:
        write_decide_state(self.r, tier, state.to_body(), STATE_TTL_S)

    def _register(self) -> None:
        info = CommanderInfo(commander=self.settings.commander_id, pid=os.getpid(),
                             host=socket.gethostname(), started=self.started,
                             role="leader" if self.leader.leading else "standby",
                             epoch=self.leader.epoch or 0,
                             metrics=getattr(self.metrics, "address", ""), seen=self.clock())
        register_commander(self.r, info)
        if self.leader.leading:
            forget_commanders(self.r, self.clock() - FORGET_COMMANDER_S)

    def _shutdown(self, redis_away: bool = False) -> None:
        """Stop the workers if asked (fleet down), give up the lease, leave the registry. With
        Redis unreachable at the last try, only the workers: each Redis call would spend the
        client's reconnect attempts, the lease expires on its own and the entry shows as gone."""
        if redis_away and not (self.leader.leading and self.settings.stop_workers_on_exit):
            log.warning("Redis unreachable: exiting without giving up the lease (it expires on its own)")
            return
        try:
            if self.leader.leading and self.settings.stop_workers_on_exit:
                log.info("stopping every worker before exit (fleet down)")
                self.runtime.stop_all()
            self.leader.step_down()
            deregister_commander(self.r, self.settings.commander_id)
        except TRANSIENT as exc:
            log.warning("clean shutdown incomplete (%s); the lease expires on its own", exc)

    # --- metrics -------------------------------------------------------------------------
    def _observe_metrics(self, tier: str, snap: Any, plan: Plan, views: Any, starting: int,
                         elapsed: float) -> None:
        self._pressure_total[tier] = self._pressure_total.get(tier, 0) + snap.pressure_events
        if self.metrics is None:
            return
        running = sum(1 for v in views if v.state == "ready")
        self.metrics.observe_tier(tier, snap, plan, running, starting, self._pressure_total[tier])
        self.metrics.observe_workers(tier, list(views))
        self.metrics.observe_turns(tier, self.observer.turns.tier(tier))
        self.metrics.decide_seconds(elapsed)
        self.metrics.is_leader(self.leader.leading)

    def _count_scale(self, tier: str, direction: str) -> None:
        if self.metrics is not None:
            self.metrics.scale_event(tier, direction)
