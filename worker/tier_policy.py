"""The tier's policy as one worker applies it: what it runs, the groups its users are assigned
to, the handler, and the ready shards it reads; read again by ``refresh``."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from protocol.groups import pool_name, settle
from protocol.policy import TurnsPolicy, as_turns
from stores import worker_ops
from stores.group_assignment import read_pin_and_record, record_group, rejected_groups
from stores.policies import PolicyRead, read_policy
from worker import handlers
from worker.settings import WorkerSettings

log = logging.getLogger("fleet.worker")


class TierPolicy:
    """What a worker runs of its tier's policy, and where the tier's users go."""

    def __init__(self, r: aioredis.Redis, settings: WorkerSettings,
                 register: Callable[[], Awaitable[None]], applied: Callable[[TurnsPolicy], None]) -> None:
        self.r = r
        self.settings = settings
        self.policy = TurnsPolicy()  # what this worker runs: its group's policy when it serves a group
        self.whole: TurnsPolicy | None = None  # the tier's whole policy: its groups (None: not read yet)
        self.rejected: frozenset[str] = frozenset()  # the tier's groups the commander rejected
        self.handler: handlers.Handler = handlers.get(self.policy.handler)
        self.shards = 1  # ready shards read: the policy's, or more while higher ones exist
        self._register = register  # the worker's registry entry again (it names the handlers)
        self._applied = applied  # told of each new policy it runs
        self._refused: str | None = None  # why the key is not applied here (logged once)
        self._rescanned: dict[str, float] = {}  # missing handler -> when entry points were re-read

    async def refresh(self) -> None:
        """Apply the tier's policy. One naming a handler this worker cannot load is refused here
        (after looking for newly installed handlers): the worker keeps what it runs."""
        read = await self._read()
        keep = read.missing_handler is not None and read.source == "default"
        if read.missing_handler is not None and read.error != self._refused:
            log.error("policy of %s not applied on this worker: %s; running the %s policy",
                      self.settings.tier, read.error, "current" if keep else read.source)
        self._refused = read.error if read.missing_handler is not None else None
        if keep:
            return  # the last good copy is not loadable here either: keep ours, not the default
        await self._apply(read)
        self.shards = await worker_ops.more_shards(self.r, self.settings.pool, self.policy.ready_shards,
                                                   self.shards)

    async def _apply(self, read: PolicyRead) -> None:
        tier = self.settings.tier
        policy = as_turns(read.policy)
        rejected = frozenset(await rejected_groups(self.r, tier) if policy.rollout.groups else ())
        seen = None if self.whole is None else (self.whole.rollout.weights(), self.rejected)
        if (policy.rollout.weights(), rejected) != seen:  # users move between turns from here on
            log.info("groups of %s now %s%s", tier,
                     ", ".join(f"{n} {w:g}" for n, w in policy.rollout.weights()) or "none",
                     f" (rejected: {', '.join(sorted(rejected))})" if rejected else "")
        self.whole, self.rejected = policy, rejected
        mine = self._own(policy)
        if mine != self.policy:
            if mine.handler != self.policy.handler:
                self.handler = handlers.get(mine.handler)
            self.policy = mine
            self._applied(mine)
            log.info("policy of %s now from %s (handler=%s, concurrency=%d)%s", self.settings.pool,
                     read.source, mine.handler, mine.concurrency,
                     f"; key rejected: {read.error}" if read.error else "")

    def _own(self, policy: TurnsPolicy) -> TurnsPolicy:
        """What this worker runs of the tier's ``policy``: its group's, when it serves a group the
        policy names; the tier's when it serves none; its current one when its group was removed
        (it serves nobody then: every user it meets is handed to their group)."""
        group = self.settings.group
        if not group:
            return policy
        if any(g.name == group for g in policy.rollout.groups):
            return policy.for_group(group)
        return self.policy

    async def _read(self) -> PolicyRead:
        """The tier's policy, read for this worker's handlers; when it names one missing here,
        the installed handlers are looked for again (at most every ``handler_rescan_s``)."""
        s = self.settings
        read = await read_policy(self.r, s.tier, handlers.known(), record=True,
                                       reader=f"worker {s.worker_id}", group=s.group or None)
        name = read.missing_handler
        every = s.handler_rescan_s
        if name is None or time.monotonic() - self._rescanned.get(name, -every) < every:
            return read
        self._rescanned[name] = time.monotonic()
        if name not in handlers.rescan():
            return read
        log.info("handler %r found (installed since this worker started)", name)
        await self._register()  # the registry says which handlers this worker has
        return await read_policy(self.r, s.tier, handlers.known(), record=True,
                                       reader=f"worker {s.worker_id}", group=s.group or None)

    async def pool_of(self, user: str, tier: str) -> str:
        """The pool that serves ``user``'s next turn of ``tier``: the tier's own, or the group
        the user is pinned to, or recorded in for the weights' epoch (``protocol.groups.settle``:
        chosen once per epoch, so a change of the weights seen at other moments by other workers
        moves a user once). This worker's tier is judged by the policy it refreshes; another
        tier's policy is read now."""
        if tier == self.settings.tier:
            if self.whole is None:  # (no policy applied here yet: never hand users to nowhere)
                return self.settings.pool
            policy, rejected = self.whole, self.rejected
        else:
            policy = as_turns((await read_policy(self.r, tier)).policy)
            groups = policy.rollout.groups
            rejected = frozenset(await rejected_groups(self.r, tier)) if groups else frozenset()
        if not policy.rollout.groups:
            return tier
        pin, record, raw = await read_pin_and_record(self.r, user, tier)
        group, settled = settle(user, policy.rollout.weights(), policy.rollout.epoch, pin, rejected, record)
        if settled is not None and settled != record:  # chosen again: by newer weights, or none yet
            group = (await record_group(self.r, user, tier, raw, settled))[0]  # (another's, if it won)
        return pool_name(tier, group)
