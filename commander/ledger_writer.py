"""The commander's ledger entries: each ``LedgerEvent`` built from a plan (or a reason) and
appended to ``fleet:events`` through the leadership, so a deposed commander's append is fenced
(``Deposed``) and it records nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from commander.decide import Plan
from commander.leadership import Leadership
from protocol.models import LedgerEvent


class LedgerWriter:
    """Writes one commander's ledger entries, stamped with its id, its epoch and the time."""

    def __init__(self, leadership: Leadership, clock: Callable[[], float]) -> None:
        self._leadership = leadership
        self._clock = clock

    def record(self, tier: str, action: str, plan: Plan | None = None, *, to: int | None = None,
               victims: Sequence[str] = (), spawned: Sequence[str] = (), reason: str = "",
               why: dict[str, Any] | None = None) -> None:
        """Append one entry: ``from`` is the plan's current count (0 without a plan), ``to``
        defaults to it; the reason and the why default to the plan's. Raises ``Deposed``."""
        current = plan.current if plan else 0
        self._leadership.append(LedgerEvent(
            ts=self._clock(), tier=tier, epoch=self._leadership.epoch or 0,
            commander=self._leadership.commander_id, action=action,
            from_count=current, to_count=current if to is None else to, victims=list(victims),
            spawned=list(spawned), reason=reason or (plan.reason if plan else ""),
            why=why if why is not None else (plan.why() if plan else {})))
