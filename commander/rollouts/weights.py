"""The groups' weights: a change is a ``rollout`` in the ledger, and the rollout guard sets a
failing canary's weight to 0 (``rollout-abort``), judged over the workers' reports."""

from __future__ import annotations

import logging

import redis

from commander.evaluator import Evaluator
from commander.ledger_writer import LedgerWriter
from commander.rollouts.canary import GroupWindow, judge_canary, pool_window
from protocol.groups import pool_name, rollout_weights
from protocol.policy import Policy, PolicyError, TurnsPolicy
from stores.group_assignment import rejected_groups
from stores.policies import read_policy, write_policy

log = logging.getLogger("fleet.commander")
Weighed = tuple[tuple[str, float], ...]  # (group, weight) pairs, as ``Rollout.weights`` gives them


def weights_text(weights: Weighed) -> str:
    return ", ".join(f"{n} {w:g}" for n, w in weights)


class Weights:
    """The weights last seen per grouped tier, and the rollout guard that may change them."""

    def __init__(self, r: redis.Redis, ledger: LedgerWriter, evaluator: Evaluator) -> None:
        self._r, self._ledger, self._evaluator = r, ledger, evaluator
        self._seen: dict[str, Weighed] = {}  # tier -> its groups' weights last seen

    def note(self, tier: str, policy: Policy) -> None:
        """Ledger a change of the tier's weights since the last look (the first look is none)."""
        weights = policy.rollout.weights()
        before = self._seen.get(tier)
        self._seen[tier] = weights
        if before is None or before == weights:
            return
        canary = f" (canary {policy.rollout.canary})" if policy.rollout.canary else ""
        reason = f"weights {weights_text(before) or 'none'} -> {weights_text(weights) or 'none'}{canary}"
        log.info("tier %s: %s", tier, reason)
        self._ledger.record(tier, "rollout", reason=reason,
                            why={"rollout": {"before": dict(before), "after": dict(weights),
                                             "canary": policy.rollout.canary}})

    def guard(self, tiers: set[str], now: float) -> None:
        """Abort each canary its tier's rollout guard finds failing: its weight to 0."""
        for tier in sorted(tiers):
            try:
                self._guard_one(tier, now)
            except (PolicyError, ValueError) as exc:
                log.warning("tier %s: rollout guard could not act (%s)", tier, exc)

    def _guard_one(self, tier: str, now: float) -> None:
        read = read_policy(self._r, tier)
        policy = read.policy
        canary, guard = policy.rollout.canary, policy.rollout.guard
        if not isinstance(policy, TurnsPolicy) or read.source != "key" or guard is None or canary is None \
                or dict(policy.rollout.weights())[canary] <= 0:
            return
        ev = self._evaluator

        def window(group: str) -> GroupWindow:
            pool = pool_name(tier, group)
            return pool_window((ev.window(w) for w in ev.workers(pool)), now, guard.window_s)
        others = [g.name for g in policy.rollout.groups if g.name != canary and g.weight > 0]
        if not others:
            return
        baseline = window(others[0])
        for name in others[1:]:
            baseline = baseline + window(name)
        why = judge_canary(window(canary), baseline, guard)
        if why is None:
            return
        rejected = frozenset(rejected_groups(self._r, tier))
        weights = rollout_weights(policy.rollout.weights(), canary, 0.0, rejected)
        new = policy.with_weights(weights)
        self._ledger.record(tier, "rollout-abort", reason=f"canary {canary} aborted: {why}; "
                            f"weights now {weights_text(weights)}",
                            why={"rollout": {"before": dict(policy.rollout.weights()), "after": dict(weights),
                                             "canary": canary}})
        write_policy(self._r, tier, new)
        self._seen[tier] = weights  # (the abort is its own ledger event, not a rollout too)
        log.warning("tier %s: canary %s aborted: %s", tier, canary, why)
