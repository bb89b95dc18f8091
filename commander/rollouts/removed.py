"""The pools no group of their tier's policy names any more (a removed group, or the tier's own
pool once it has groups): their workers are drained, and once none is left, each user with a
turn still queued there is notified on the pool it belongs to now (nobody reads the removed
pool's notifications: without this the turn waits for the user's next submit). A pool is
forgotten (and its metrics' series removed) once nothing is queued on it and nobody has
submitted on it for a while."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import redis

from commander.actor import Actor
from commander.ledger_writer import LedgerWriter
from commander.metrics import Metrics
from commander.runtime import Lifecycle, Runtime, WorkerHandle
from protocol.groups import assign, pool_name, split_pool
from protocol.keys import ready_shard
from protocol.models import WorkerInfo
from protocol.policy import Policy, TurnsPolicy
from stores.bad_state import DEFAULT, BadState
from stores.group_assignment import forget_pool, read_pins, rejected_groups
from stores.policies import read_policy
from stores.renotify import active_since, active_users, notify_on, unserved_newest

log = logging.getLogger("fleet.commander")
MOVE_EVERY_S = 5.0  # a removed pool with no worker left is looked at this often
FORGET_AFTER_S = 60.0  # ... and forgotten once nothing is queued on it and nobody submitted for this long


class RemovedPools:
    """Drains the removed pools and moves their queued users, each once."""

    def __init__(self, r: redis.Redis, runtime: Runtime, ledger: LedgerWriter, actor: Actor,
                 metrics: Metrics | None, monotonic: Callable[[], float], bad: BadState = DEFAULT) -> None:
        self._r, self._runtime, self._ledger, self._actor, self._bad = r, runtime, ledger, actor, bad
        self._metrics, self._monotonic = metrics, monotonic
        self._drained: set[str] = set()  # workers of removed pools already told to drain
        self._moved: dict[str, dict[str, str]] = {}  # pool -> user -> the newest turn notified elsewhere
        self._moved_at: dict[str, float] = {}  # pool -> monotonic time of its last move

    def empty(self, pool: str, handles: list[WorkerHandle],
              registry: Mapping[str, tuple[WorkerInfo, bool]], policy: Policy, now: float) -> None:
        """One pass over a removed pool: drain its workers, then move its queued users."""
        self._move_users(pool, self._drain(pool, handles, registry, policy), now)

    def _drain(self, pool: str, handles: list[WorkerHandle],
               registry: Mapping[str, tuple[WorkerInfo, bool]], policy: Policy) -> bool:
        """Drain every live worker of the pool (once each); whether any is left."""
        ours = {h.worker_id for h in handles if h.tier == pool and h.state is not Lifecycle.EXITED}
        theirs = {wid for wid, (info, alive) in registry.items() if alive and info.tier == pool}
        for wid in sorted((ours | theirs) - self._drained):
            reason = f"pool {pool} is no group of its tier's policy: its users are served by their groups"
            self._ledger.record(pool, "group-removed", victims=[wid], reason=reason)
            self._actor.retire(wid, reason, policy.controls.drain_timeout_s)
            self._drained.add(wid)
        self._drained &= ours | theirs
        return bool(ours | theirs)

    def _move_users(self, pool: str, live: bool, now: float) -> None:
        """Once the pool has no live worker: notify each user with a turn queued on it on the
        pool it belongs to now, each queued turn once; forget the pool when it is empty."""
        mono = self._monotonic()
        if live or mono - self._moved_at.get(pool, float("-inf")) < MOVE_EVERY_S:
            return
        self._moved_at[pool] = mono
        tier = split_pool(pool)[0]
        policy = read_policy(self._r, tier).policy
        groups = policy.rollout.groups
        shards = policy.ready_shards if isinstance(policy, TurnsPolicy) else 1
        rejected = frozenset(rejected_groups(self._r, tier)) if groups else frozenset()
        done, moved, left = self._moved.setdefault(pool, {}), dict[str, str](), 0
        for users in active_users(self._r, pool):
            newest = unserved_newest(self._r, users)
            left += len(newest)
            fresh = [u for u, entry in newest.items() if done.get(u) != entry]
            pins = read_pins(self._r, fresh, tier, self._bad) if groups else {}
            placed = {u: (pool_name(tier, assign(u, policy.rollout.weights(), pins.get(u), rejected))
                          if groups else tier, ready_shard(u, shards)) for u in fresh}
            notify_on(self._r, placed, now)
            moved |= {u: to for u, (to, _shard) in placed.items()}
            done.update({u: newest[u] for u in fresh})
        if moved:
            shown = ", ".join(f"{u} -> {to}" for u, to in sorted(moved.items())[:10])
            more = f" and {len(moved) - 10} more" if len(moved) > 10 else ""
            reason = (f"pool {pool} is no group of its tier's policy and has no worker left: "
                      f"{len(moved)} users with a turn queued on it notified on their group ({shown}{more})")
            log.info("%s", reason)
            self._ledger.record(pool, "renotified", reason=reason)
        if not left and not active_since(self._r, pool, now - FORGET_AFTER_S):
            forget_pool(self._r, tier, pool)
            self._runtime.pool_forgotten(pool)  # (kubernetes: the Deployment it made for the group)
            if self._metrics is not None:
                self._metrics.forget_tier(pool)
            self._moved.pop(pool, None)
            self._moved_at.pop(pool, None)
