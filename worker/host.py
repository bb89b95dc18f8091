"""The worker's side of its jobs: the jobs in flight (``InFlight``), and what each job gets from
the worker (``Host``, the ``worker.job.JobHost``): acks, hand-overs, dead letters, the sync
handlers' threads, the handler trace and the turn counts."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis

from protocol.groups import split_pool
from protocol.policy import TurnsPolicy
from stores import worker_ops
from stores.deadletters import DeadKind, dead_letter_async
from stores.policies import tier_defined_async
from stores.redis_errors import RedisErrors
from stores.retry import TRANSIENT
from stores.turns import UserStore
from worker import handlers
from worker.intake import Fields
from worker.job import UserJob
from worker.settings import WorkerSettings
from worker.streams import StreamFlusher
from worker.tally import TurnTally
from worker.tier_policy import TierPolicy

log = logging.getLogger("fleet.worker")


class InFlight:
    """The users a worker serves now, one job each, and the tasks it runs for them."""

    def __init__(self, on_done: Callable[[str], None]) -> None:
        self.by_user: dict[str, UserJob] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.draining = False  # no user is taken on: their notifications are handed back
        self.slot_freed = asyncio.Event()
        self._on_done = on_done  # told of each user whose job ended

    def __len__(self) -> int:
        return len(self.by_user)

    def __iter__(self) -> Iterator[UserJob]:
        return iter(list(self.by_user.values()))

    def get(self, user: str) -> UserJob | None:
        return self.by_user.get(user)

    def add(self, job: UserJob) -> None:
        self.by_user[job.user] = job

    def free(self, concurrency: int) -> int:
        """Slots free for new users: none while draining."""
        return 0 if self.draining else concurrency - len(self.by_user)

    def done(self, job: UserJob) -> None:
        """Forget a finished job (idempotent) and free its slot."""
        if self.by_user.get(job.user) is job:
            del self.by_user[job.user]
            self._on_done(job.user)
            self.slot_freed.set()

    def spawn(self, aw: Awaitable[None]) -> None:
        task = asyncio.ensure_future(aw)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def finish(self) -> None:
        """Wait until every job and task spawned (and spawned meanwhile) has ended."""
        while self.tasks:
            await asyncio.wait(list(self.tasks))


class Host:
    """What a worker gives each of its jobs (``worker.job.JobHost``)."""

    def __init__(self, r: aioredis.Redis, settings: WorkerSettings, store: UserStore, tier_policy: TierPolicy,
                 jobs: InFlight, tally: TurnTally, protect: Callable[[float], float],
                 redis_errors: RedisErrors) -> None:
        self.r = r
        self.settings = settings
        self.worker_id, self.tier, self.pool = settings.worker_id, settings.tier, settings.pool
        self.store = store
        self.streams = StreamFlusher(store, settings.stream_flush_ms / 1000,  # streamed turns' flushes
                                     settings.stream_flush_max_ms / 1000)
        self.tier_policy = tier_policy
        self.jobs = jobs
        self.tally = tally
        self.redis_errors = redis_errors
        self._protect = protect
        self._executor: ThreadPoolExecutor | None = None  # sync handlers' threads, one per slot
        self._executor_size = 0
        # line-buffered: a SIGKILLed worker's last entry is on disk (its exit never is)
        self._trace = open(settings.handler_trace, "a", buffering=1) if settings.handler_trace else None  # noqa: SIM115

    @property
    def draining(self) -> bool:
        return self.jobs.draining

    @property
    def policy(self) -> TurnsPolicy:
        return self.tier_policy.policy

    @property
    def handler(self) -> handlers.Handler:
        return self.tier_policy.handler

    def job_done(self, job: UserJob) -> None:
        self.jobs.done(job)

    def protect(self, seconds: float) -> float:
        """Protect this worker from scale-in (``TurnContext.protect``; ``worker.sensor.Reports``)."""
        return self._protect(seconds)

    # --- the ready stream ----------------------------------------------------------------
    async def ack(self, nids: list[str]) -> None:
        """Ack notifications of the tier's ready stream that are still ours: one another worker
        reclaimed meanwhile carries a duty for it now, and stays."""
        if nids:
            await worker_ops.ack_notifications(self.store.scripts, self.pool, self.worker_id, nids,
                                               self.store.batcher)

    async def ack_covered(self, holder: str, user: str, nids: list[str]) -> None:
        """Ack notifications for ``user`` whose turns the lane's ``holder`` ("<worker>|<token>")
        will see, if the holder has one of the user's notifications pending (its carrier of the
        duty, should it die); else keep them pending: they are reclaimed once idle."""
        if not nids:
            return
        acked = await worker_ops.ack_covered(self.store.scripts, self.pool, self.worker_id,
                                             holder.rpartition("|")[0], user, nids)
        if acked < 0:
            log.info("lane of %s is held by %s with none of its notifications pending: ours stay "
                     "pending", user, holder)

    async def notify(self, user: str, pool: str) -> None:
        """Post a fresh notification for ``user`` on ``pool``'s ready stream (a hand-over)."""
        # the user's shard of this tier (its groups share the count); another tier's count is not
        # known here: its shard 0, which every worker of that tier reads
        same = split_pool(pool)[0] == self.tier
        await worker_ops.notify_ready(self.r, pool, user, self.policy.ready_shards if same else 1)

    async def pool_of(self, user: str, tier: str) -> str:
        """The pool that serves ``user``'s next turn of ``tier`` (``TierPolicy.pool_of``)."""
        return await self.tier_policy.pool_of(user, tier)

    async def tier_defined(self, tier: str) -> bool:
        """Whether a policy defines ``tier``: a turn for one that does not is dead-lettered."""
        return await tier_defined_async(self.r, tier)

    async def dead_letter(self, user: str, entry: str, turn_id: str, reason: str, fields: Fields,
                          kind: DeadKind) -> None:
        """Record a turn that could not be served, with the reason, on the tier's dead letters."""
        await dead_letter_async(self.r, self.tier, user=user, entry=entry, turn_id=turn_id, reason=reason,
                                worker=self.worker_id, fields=fields, kind=kind,
                                max_bytes=self.policy.durability.dead_letter_max_bytes)
        self.tally.dead_letters += 1
        log.warning("dead-lettered turn %s of %s: %s", turn_id, user, reason)

    async def give_up(self, user: str, deliveries: dict[str, int], error: str) -> None:
        """Notifications of ``user`` at the delivery limit whose job failed again (``deliveries``:
        id -> times delivered): dead-letter each with the ``error``, then ack them, so a poison
        notification does not pin the ready stream. Redis away: they stay pending, and come back."""
        limit = self.policy.max_deliveries
        try:
            for nid, n in deliveries.items():
                reason = (f"notification {nid} delivered {n} times (max_deliveries {limit}); "
                          f"last error: {error}")
                await self.dead_letter(user, "", "", reason, {b"user": user.encode()}, "delivery_limit")
            await self.ack(list(deliveries))
            self.tally.delivery_limit += len(deliveries)
            self.redis_errors.answered("give up")
        except TRANSIENT as exc:
            self.redis_errors.failed("give up", exc)

    async def hand_back(self, nid: str, user: str) -> None:
        """A draining worker returns a notification: a fresh one for others, then the ack."""
        try:
            await self.notify(user, await self.pool_of(user, self.tier))  # (its group's, if it moved)
            await self.ack([nid])
            self.redis_errors.answered("hand back")
        except TRANSIENT as exc:  # it stays pending: reclaimed once idle
            self.redis_errors.failed("hand back", exc)

    async def reject_notification(self, nid: str, fields: Fields, reason: str) -> None:
        """A notification that names no valid user: dead-letter it (nobody to reply to), ack it."""
        raw_user = fields.get(b"user", b"")[:100].decode(errors="replace")
        try:
            await self.dead_letter(raw_user, "", "", f"bad notification {nid}: {reason}", fields,
                                   "bad_notification")
            await self.ack([nid])
            self.redis_errors.answered("reject notification")
        except TRANSIENT as exc:  # it stays pending: reclaimed once idle, and rejected again
            self.redis_errors.failed("reject notification", exc)

    # --- the handler's surroundings ---------------------------------------------------------
    @property
    def executor(self) -> ThreadPoolExecutor:
        """The threads of sync handlers: as many as the tier's concurrency, so a turn never
        queues for a thread behind other turns (and the default executor stays free)."""
        want = self.policy.concurrency
        if self._executor is None or self._executor_size != want:
            if self._executor is not None:
                self._executor.shutdown(wait=False)  # its running threads finish their turns
            self._executor = ThreadPoolExecutor(max_workers=want, thread_name_prefix="handler")
            self._executor_size = want
        return self._executor

    def trace_handler(self, event: str, ctx: handlers.TurnContext) -> None:
        """With ``handler_trace`` set, record a handler entry or exit with its lease (I3 checks)."""
        if self._trace is None:
            return
        self._trace.write(json.dumps({"ev": event, "t": time.time(), "worker": self.worker_id,
                                      "lease": ctx.lease, "user": ctx.turn.user,
                                      "turn": ctx.turn.turn_id}) + "\n")

    def close(self) -> None:
        """Let the handler threads go and close the trace (the worker exits)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        if self._trace is not None:
            self._trace.close()
