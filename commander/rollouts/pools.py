"""Which pools a pass judges, and the policy each one runs.

A grouped tier is judged as its groups' pools, plus the pools it had and no group names any
more (until nothing is queued on them: ``removed``), plus its own pool while workers of it live
(the tier's workers from before it had groups: they are drained).
"""

from __future__ import annotations

from dataclasses import replace

import redis
from redis.exceptions import ResponseError

from commander.rollouts.weights import Weights
from protocol import keys
from protocol.groups import pool_name, split_pool
from protocol.ids import InvalidId
from protocol.policy import TurnsPolicy
from stores.bad_state import DEFAULT, BadState, reject_wrong_type
from stores.group_assignment import known_pools, remember_pools
from stores.policies import PolicyRead, read_policy


def pool_policy(pool: str, read: PolicyRead) -> tuple[PolicyRead, bool]:
    """The policy of ``pool`` from its tier's ``read``, and whether the pool is *removed*: no
    group of the policy names it (or it is the tier's own pool and the tier has groups)."""
    group, policy = split_pool(pool)[1], read.policy
    groups = policy.rollout.groups
    if not group:
        return read, bool(groups)
    if isinstance(policy, TurnsPolicy) and any(g.name == group for g in groups):
        return replace(read, tier=pool, policy=policy.for_group(group)), False
    return replace(read, tier=pool), True


class Pools:
    """Expands the tiers to judge into their pools, and shows each grouped tier's weights to
    ``weights`` (a change is a rollout)."""

    def __init__(self, r: redis.Redis, weights: Weights, bad: BadState = DEFAULT) -> None:
        self._r, self._weights, self._bad = r, weights, bad

    def to_judge(self, names: set[str], live: set[str]) -> set[str]:
        """``names`` with each grouped tier replaced by its pools (``live``: the tiers and pools
        with live workers). A name that is no tier or pool is told to ``bad``, and left out."""
        out: set[str] = set()
        for name in names:
            try:
                tier, group = split_pool(name)
            except InvalidId as exc:
                self._bad.note("tier", name, "", exc)
                continue
            if group:
                out.add(name)
                continue
            pools = self._pools(tier)
            out |= pools
            if tier in live:
                out.add(tier)
        return out

    def _pools(self, tier: str) -> set[str]:
        """The tier's pools to judge: its groups' (or itself), and those it had."""
        policy = read_policy(self._r, tier).policy  # (structure only: the handlers are the pools')
        self._weights.note(tier, policy)
        pools = {pool_name(tier, g.name) for g in policy.rollout.groups} or {tier}
        known = known_pools(self._r, tier, self._bad)
        if not pools <= known:
            try:
                remember_pools(self._r, tier, pools - known)
            except ResponseError as exc:  # the set is of another type: judged, not remembered
                self._bad.note("pool", keys.pools(tier), "", reject_wrong_type(exc))
        return pools | known  # a removed pool stays until nothing queued on it is left
