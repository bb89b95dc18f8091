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
from stores.roundtrips import run_all


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
        tiers = []
        for name in names:
            try:
                tier, group = split_pool(name)
            except InvalidId as exc:
                self._bad.note("tier", name, "", exc)
                continue
            if group:
                out.add(name)
                continue
            tiers.append(tier)
            if tier in live:
                out.add(tier)
        for pools in self._pools(tiers):
            out |= pools
        return out

    def _pools(self, tiers: list[str]) -> list[set[str]]:
        """Each tier's pools to judge: its groups' (or itself), and those it had. Every tier's
        policy and pools are read side by side, in one round trip."""
        ops = [op for tier in tiers for op in (read_policy.steps(tier), known_pools.steps(tier, self._bad))]
        got = run_all(self._r, ops)  # (structure only: the handlers are the pools')
        failed = next((x for x in got if isinstance(x, Exception)), None)
        if failed is not None:
            raise failed
        out = []
        for tier, read, known in zip(tiers, got[::2], got[1::2], strict=True):
            self._weights.note(tier, read.policy)
            pools = {pool_name(tier, g.name) for g in read.policy.rollout.groups} or {tier}
            if not pools <= known:
                try:
                    remember_pools(self._r, tier, pools - known)
                except ResponseError as exc:  # the set is of another type: judged, not remembered
                    self._bad.note("pool", keys.pools(tier), "", reject_wrong_type(exc))
            out.append(pools | known)  # a removed pool stays until nothing queued on it is left
        return out
