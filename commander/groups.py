"""``Groups``, a mixin of ``Commander``: a tier's groups as pools of their own (protocol.groups).

Each group's pool ``<tier>.<group>`` is observed, decided and acted on like a tier, with the
group's policy (``Policy.for_group``). Around that: the pools a tier's policy names; the
ledger's ``rollout`` event when the weights change; the rollout guard that sets a failing
canary's weight to 0; a group whose interpreter cannot run its handler rejected (weight 0 for
assignment, ledgered, shown as the pool's error) and accepted again once it can; and the
workers of a pool no group names any more (a removed group, or the tier's own workers from
before it had groups) drained, their users handed to their groups as they meet them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import redis

from commander.rollout import judge_canary, pool_window
from commander.runtime import Runtime, WorkerHandle, WorkerState
from protocol.groups import assign, pool_name, rollout_weights, split_pool, with_weights
from protocol.keys import ready_shard
from protocol.models import LedgerEvent
from protocol.policy import Policy, PolicyError, parse_policy
from stores.group_assignment import (
    accept_group,
    forget_pool,
    known_pools,
    read_pins,
    reject_group,
    rejected_groups,
    remember_pools,
)
from stores.policies import PolicyRead, read_policy, write_policy
from stores.renotify import active_since, active_users, notify_on, unserved_newest

log = logging.getLogger("fleet.commander")
MOVE_EVERY_S = 5.0  # a removed pool with no worker left is looked at this often
FORGET_AFTER_S = 60.0  # ... and forgotten once nothing is queued on it and nobody submitted for this long


def weights_text(weights: tuple[tuple[str, float], ...]) -> str:
    return ", ".join(f"{n} {w:g}" for n, w in weights)


class Groups:
    """The commander's side of groups; ``Commander`` owns the state declared below."""

    r: redis.Redis
    runtime: Runtime
    observer: Any
    _seen_weights: dict[str, tuple[tuple[str, float], ...]]  # tier -> its groups' weights last seen
    _group_verdicts: dict[str, str | None]  # pool -> why it is rejected (None: accepted)
    _removed: set[str]  # workers of removed pools already told to drain
    _moved: dict[str, dict[str, str]]  # removed pool -> user -> the newest turn notified elsewhere
    _moved_at: dict[str, float]  # removed pool -> monotonic time of its last move
    monotonic: Callable[[], float]

    _append: Callable[[LedgerEvent], None]
    _event: Callable[..., LedgerEvent]
    _retire: Callable[[str, str, float], None]

    def _with_pools(self, names: set[str], live: set[str]) -> set[str]:
        """``names`` with each grouped tier replaced by its groups' pools (and kept itself only
        while workers of its own pool live: they are drained). Notes weight changes."""
        out: set[str] = set()
        for name in names:
            tier, group = split_pool(name)
            if group:
                out.add(name)
                continue
            policy = read_policy(self.r, tier).policy  # (structure only: the handlers are the pools')
            self._note_weights(tier, policy)
            pools = {pool_name(tier, g.name) for g in policy.groups} or {tier}
            known = known_pools(self.r, tier)
            if not pools <= known:
                remember_pools(self.r, tier, pools - known)
            out |= pools | known  # a removed pool until nothing queued on it is left (_move_users)
            if tier in live:
                out.add(tier)
        return out

    def _note_weights(self, tier: str, policy: Policy) -> None:
        weights = policy.weights()
        before = self._seen_weights.get(tier)
        self._seen_weights[tier] = weights
        if before is None or before == weights:
            return
        canary = f" (canary {policy.canary})" if policy.canary else ""
        reason = f"weights {weights_text(before) or 'none'} -> {weights_text(weights) or 'none'}{canary}"
        log.info("tier %s: %s", tier, reason)
        self._append(self._event(tier, "rollout", reason=reason,
                                 why={"rollout": {"before": dict(before), "after": dict(weights),
                                                  "canary": policy.canary}}))

    def _pool_read(self, pool: str, read: PolicyRead) -> tuple[PolicyRead, bool]:
        """The policy of ``pool`` from its tier's ``read``, and whether the pool is *removed*:
        no group of the policy names it (or it is the tier's own pool and the tier has groups)."""
        group = split_pool(pool)[1]
        groups = read.policy.groups
        if not group:
            return read, bool(groups)
        if any(g.name == group for g in groups):
            return replace(read, tier=pool, policy=read.policy.for_group(group)), False
        return replace(read, tier=pool), True

    def _drain_removed(self, pool: str, handles: list[WorkerHandle], registry: dict[str, Any],
                       policy: Policy) -> bool:
        """Drain every live worker of a removed pool (once each); whether any is left."""
        ours = {h.worker_id for h in handles if h.tier == pool and h.state is not WorkerState.EXITED}
        theirs = {wid for wid, (info, alive) in registry.items() if alive and info.tier == pool}
        for wid in sorted((ours | theirs) - self._removed):
            reason = f"pool {pool} is no group of its tier's policy: its users are served by their groups"
            self._append(self._event(pool, "group-removed", victims=[wid], reason=reason))
            self._retire(wid, reason, policy.drain_timeout_s)
            self._removed.add(wid)
        self._removed &= ours | theirs
        return bool(ours | theirs)

    def _move_users(self, pool: str, live: bool, now: float) -> None:
        """Once a removed pool has no live worker, notify each user with a turn still queued on
        it on the pool it belongs to now (nobody reads the removed pool's notifications any
        more: without this the turn waits for the user's next submit). Each queued turn once;
        the pool is forgotten when none is left and nobody has submitted on it for a while."""
        mono = self.monotonic()
        if live or mono - self._moved_at.get(pool, float("-inf")) < MOVE_EVERY_S:
            return
        self._moved_at[pool] = mono
        tier = split_pool(pool)[0]
        policy = read_policy(self.r, tier).policy
        rejected = frozenset(rejected_groups(self.r, tier)) if policy.groups else frozenset()
        done, moved, left = self._moved.setdefault(pool, {}), dict[str, str](), 0
        for users in active_users(self.r, pool):
            newest = unserved_newest(self.r, users)
            left += len(newest)
            fresh = [u for u, entry in newest.items() if done.get(u) != entry]
            pins = read_pins(self.r, fresh, tier) if policy.groups else {}
            placed = {u: (pool_name(tier, assign(u, policy.weights(), pins.get(u), rejected))
                          if policy.groups else tier, ready_shard(u, policy.ready_shards)) for u in fresh}
            notify_on(self.r, placed, now)
            moved |= {u: to for u, (to, _shard) in placed.items()}
            done.update({u: newest[u] for u in fresh})
        if moved:
            shown = ", ".join(f"{u} -> {to}" for u, to in sorted(moved.items())[:10])
            more = f" and {len(moved) - 10} more" if len(moved) > 10 else ""
            reason = (f"pool {pool} is no group of its tier's policy and has no worker left: "
                      f"{len(moved)} users with a turn queued on it notified on their group ({shown}{more})")
            log.info("%s", reason)
            self._append(self._event(pool, "renotified", reason=reason))
        if not left and not active_since(self.r, pool, now - FORGET_AFTER_S):
            forget_pool(self.r, tier, pool)
            self.runtime.pool_forgotten(pool)  # (kubernetes: the Deployment it made for the group)
            self._moved.pop(pool, None)
            self._moved_at.pop(pool, None)

    def _group_rejected(self, pool: str) -> str | None:
        """Why ``pool``'s group cannot start workers (recorded for assignment and the ledger when
        it changes), or None."""
        tier, group = split_pool(pool)
        if not group:
            return None
        why = self.runtime.check_group(pool)
        if pool not in self._group_verdicts:  # a new leader: what the last one recorded
            self._group_verdicts[pool] = rejected_groups(self.r, tier).get(group)
        was = self._group_verdicts[pool]
        if why is not None and why != was:
            reject_group(self.r, tier, group, why)
            self._append(self._event(pool, "group-rejected", reason=f"group {group} of tier {tier} "
                                     f"rejected: {why}; its users are served by the other groups"))
        elif why is None and was is not None:
            accept_group(self.r, tier, group)
            self._append(self._event(pool, "group-accepted", reason=f"group {group} of tier {tier} "
                                     "can start workers again: its users come back to it"))
        self._group_verdicts[pool] = why
        return why

    def _guard_rollouts(self, tiers: set[str], now: float) -> None:
        """Abort each canary its tier's rollout guard finds failing: its weight to 0."""
        for tier in sorted(tiers):
            try:
                self._guard_one(tier, now)
            except (PolicyError, ValueError) as exc:
                log.warning("tier %s: rollout guard could not act (%s)", tier, exc)

    def _guard_one(self, tier: str, now: float) -> None:
        read = read_policy(self.r, tier)
        policy, canary = read.policy, read.policy.canary
        guard = policy.rollout_guard
        if read.source != "key" or guard is None or canary is None or dict(policy.weights())[canary] <= 0:
            return
        ev = self.observer.evaluator

        def window(group: str) -> Any:
            pool = pool_name(tier, group)
            return pool_window((ev.window(w) for w in ev.workers(pool)), now, guard.window_s)
        others = [g.name for g in policy.groups if g.name != canary and g.weight > 0]
        if not others:
            return
        baseline = window(others[0])
        for name in others[1:]:
            baseline = baseline + window(name)
        why = judge_canary(window(canary), baseline, guard)
        if why is None:
            return
        weights = rollout_weights(policy.weights(), canary, 0.0, frozenset(rejected_groups(self.r, tier)))
        new = parse_policy(with_weights(policy.model_dump(mode="json"), weights))
        self._append(self._event(tier, "rollout-abort", reason=f"canary {canary} aborted: {why}; "
                                 f"weights now {weights_text(weights)}",
                                 why={"rollout": {"before": dict(policy.weights()), "after": dict(weights),
                                                  "canary": canary}}))
        write_policy(self.r, tier, new)
        self._seen_weights[tier] = weights  # (the abort is its own ledger event)
        log.warning("tier %s: canary %s aborted: %s", tier, canary, why)
