"""How fast a tier may change: per-direction rate limits (the HPA's ``behavior``) and the
disruption budget (Karpenter's): pure functions of the policy, the fleet and past changes.

**Rate limits.** ``TierState.changes`` keeps ``(ts, delta)`` of the scale events of the longest
period (recycling is not counted: it replaces, it does not scale). For a rule over
``period_s``, the count at the period's start is the current count minus the workers added
(up) or plus those removed (down) within the period, and the rule allows up to that count
plus ``value`` workers or ``value`` % of it (up, rounded up), or down to that count minus
``value`` workers or ``value`` % of it (down, rounded down), as ``horizontal.go`` computes
them. ``select: max`` takes the rule that allows the most change, ``min`` the least,
``disabled`` forbids that direction.

**Disruption budget.** At most ``workers`` (or ``percent`` of the tier's live workers,
rounded up) draining at once; workers already draining use it up first.
"""

from __future__ import annotations

import math

from commander.snapshot import TierWorkers
from protocol.policy_controls import DisruptionBudget, ScaleBehavior

Changes = tuple[tuple[float, int], ...]


def _moved(changes: Changes, now: float, period_s: float, up: bool) -> int:
    return sum(abs(d) for ts, d in changes if ts > now - period_s and (d > 0) is up)


def up_limit(behavior: ScaleBehavior, current: int, changes: Changes, now: float) -> int | None:
    """The most workers the scale-up rules allow now (None: no rule)."""
    if behavior.select == "disabled":
        return current
    limits = []
    for rule in behavior.rules:
        start = current - _moved(changes, now, rule.period_s, up=True)
        if rule.type == "workers":
            limits.append(start + rule.value)
        else:
            limits.append(math.ceil(start * (1 + rule.value / 100.0) - 1e-9))
    if not limits:
        return None
    return max(limits) if behavior.select == "max" else min(limits)


def down_limit(behavior: ScaleBehavior, current: int, changes: Changes, now: float) -> int | None:
    """The fewest workers the scale-down rules allow now (None: no rule)."""
    if behavior.select == "disabled":
        return current
    limits = []
    for rule in behavior.rules:
        start = current + _moved(changes, now, rule.period_s, up=False)
        if rule.type == "workers":
            limits.append(start - rule.value)
        else:
            limits.append(math.floor(start * (1 - rule.value / 100.0) + 1e-9))
    if not limits:
        return None
    # "max" is the rule that allows the most change: down, that is the lowest limit
    return max(0, min(limits) if behavior.select == "max" else max(limits))


def longest_period(*behaviors: ScaleBehavior) -> float:
    """How far back the rules look (0 without rules)."""
    return max((r.period_s for b in behaviors for r in b.rules), default=0.0)


def record_changes(changes: Changes, now: float, delta_up: int, delta_down: int, keep_s: float) -> Changes:
    """Past changes within ``keep_s``, with this pass's (a clock that went back forgets the future)."""
    kept = [(ts, d) for ts, d in changes if now - keep_s < ts <= now]
    if delta_up:
        kept.append((now, delta_up))
    if delta_down:
        kept.append((now, -delta_down))
    return tuple(kept) if keep_s > 0 else ()


def budget_room(budget: DisruptionBudget | None, fleet: TierWorkers) -> int | None:
    """How many more workers may start draining now (None: no budget)."""
    if budget is None:
        return None
    if budget.workers is not None:
        allowed = budget.workers
    else:
        total = fleet.current + len(fleet.draining)
        allowed = math.ceil((budget.percent or 0.0) * total / 100.0 - 1e-9)
    return max(0, allowed - len(fleet.draining))
