"""What a worker offers its jobs (``worker.job.JobHost``): acks, hand-overs, dead letters, the
sync handlers' threads, the handler trace and the counters; the renewal of their lanes; and its
reports of them to the commander. A base of ``worker.app.Worker``, which owns the state declared below."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO

import redis.asyncio as aioredis

from protocol.groups import assign, pool_name, split_pool
from protocol.models import Counters, Slots, WorkerState
from protocol.policy import Policy
from stores import worker_ops
from stores.deadletters import dead_letter_async
from stores.group_assignment import read_pin_async, rejected_groups
from stores.policies import read_policy, tier_defined_async
from stores.reports import post_report_async
from stores.retry import TRANSIENT, Backoff
from stores.turns import UserStore
from worker import handlers
from worker.aio import within
from worker.intake import Fields
from worker.job import UserJob
from worker.sensor import Sensor
from worker.settings import WorkerSettings
from worker.tally import TurnTally

log = logging.getLogger("fleet.worker")  # the worker's logger, as before the split
BACKOFF = Backoff(base=0.05, cap=2.0)  # the loops' waits: 50 ms doubling to 2 s, full jitter
REPORTS_MAXLEN = 100_000


class JobServices:
    """The worker's side of a job's calls, and the bookkeeping of the turns jobs run."""

    r: aioredis.Redis
    settings: WorkerSettings
    tier: str
    group: str
    pool: str  # the tier, or its group's pool <tier>.<group> (protocol.groups)
    worker_id: str
    store: UserStore
    policy: Policy  # what this worker runs: its group's policy when it serves a group
    tier_policy: Policy | None  # the tier's whole policy: its groups and weights (None: not read yet)
    rejected: frozenset[str]
    counters: Counters
    tally: TurnTally  # the turn counts the reports carry (worker.tally)
    jobs: dict[str, UserJob]
    _executor: ThreadPoolExecutor | None
    _executor_size: int
    _trace: IO[str] | None
    state: WorkerState
    sensor: Sensor
    _stopping: asyncio.Event  # set once the jobs are done: the loops end
    _wake_report: asyncio.Event
    protected_until: float = 0.0  # a handler's scale-in protection (TurnContext.protect)
    _loop: asyncio.AbstractEventLoop | None = None

    def protect(self, seconds: float) -> float:
        """Protect this worker from scale-in for ``seconds`` (at most ``max_protection_s``; 0 ends
        it) and report it at once. Called from handlers, possibly on a handler thread."""
        seconds = min(max(0.0, seconds), self.policy.max_protection_s)
        self.protected_until = time.time() + seconds if seconds > 0 else 0.0
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake_report.set)
        return self.protected_until

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

    async def tier_defined(self, tier: str) -> bool:
        """Whether a policy defines ``tier``: a turn for one that does not is dead-lettered."""
        return await tier_defined_async(self.r, tier)

    async def notify(self, user: str, pool: str) -> None:
        """Post a fresh notification for ``user`` on ``pool``'s ready stream (a hand-over)."""
        # the user's shard of this tier (its groups share the count); another tier's count is not
        # known here: its shard 0, which every worker of that tier reads
        same = split_pool(pool)[0] == self.tier
        await worker_ops.notify_ready(self.r, pool, user, self.policy.ready_shards if same else 1)

    async def pool_of(self, user: str, tier: str) -> str:
        """The pool that serves ``user``'s next turn of ``tier``: the tier's own, or the group
        the user is pinned to or hashed into (``protocol.groups.assign``). This worker's tier is
        judged by the policy it refreshes; another tier's policy is read now."""
        if tier == self.tier:
            if self.tier_policy is None:  # (no policy applied here yet: never hand users to nowhere)
                return self.pool
            policy, rejected = self.tier_policy, self.rejected
        else:
            policy = (await read_policy(self.r, tier)).policy
            rejected = frozenset(await rejected_groups(self.r, tier)) if policy.groups else frozenset()
        if not policy.groups:
            return tier
        pin = await read_pin_async(self.r, user, tier)
        return pool_name(tier, assign(user, policy.weights(), pin, rejected))

    def counters_now(self) -> Counters:
        """The counters with the handler time of turns still running: slot-seconds up to now.

        Counting a turn's time only when it ends would put a long turn's seconds all in one
        report interval; counted as it runs, the delta between two reports is the exact
        time-averaged slot use in between.
        """
        now = time.monotonic()
        running = sum(now - job.busy_since for job in self.jobs.values() if job.busy_since is not None)
        c = self.counters
        return Counters(turns=c.turns, errors=c.errors, handler_seconds=c.handler_seconds + running)

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

    def counters_add(self, turns: int = 0, errors: int = 0, handler_seconds: float = 0.0) -> None:
        c = self.counters
        self.counters = Counters(turns=c.turns + turns, errors=c.errors + errors,
                                 handler_seconds=c.handler_seconds + handler_seconds)

    async def dead_letter(self, user: str, entry: str, turn_id: str, reason: str, fields: Fields) -> None:
        """Record a turn that could not be served, with the reason, on the tier's dead letters."""
        await dead_letter_async(self.r, self.tier, user=user, entry=entry, turn_id=turn_id, reason=reason,
                                worker=self.worker_id, fields=fields)
        self.tally.dead_letters += 1
        log.warning("dead-lettered turn %s of %s: %s", turn_id, user, reason)

    async def hand_back(self, nid: str, user: str) -> None:
        """A draining worker returns a notification: a fresh one for others, then the ack."""
        try:
            await self.notify(user, await self.pool_of(user, self.tier))  # (its group's, if it moved)
            await self.ack([nid])
        except TRANSIENT as exc:
            log.warning("could not hand back notification %s (%s); it stays pending", nid, exc)

    async def reject_notification(self, nid: str, fields: Fields, reason: str) -> None:
        """A notification that names no valid user: dead-letter it (nobody to reply to), ack it."""
        raw_user = fields.get(b"user", b"")[:100].decode(errors="replace")
        try:
            await self.dead_letter(raw_user, "", "", f"bad notification {nid}: {reason}", fields)
            await self.ack([nid])
        except TRANSIENT as exc:
            log.warning("could not dead-letter notification %s (%s); it stays pending", nid, exc)

    # --- reports ---------------------------------------------------------------------
    async def _pause(self, seconds: float) -> None:
        """Sleep, waking early when the worker stops."""
        with contextlib.suppress(TimeoutError):  # (not wait_for: it can drop a cancellation, gh-86296)
            async with asyncio.timeout(seconds):
                await self._stopping.wait()

    # --- renewals -------------------------------------------------------------------
    async def _renew_loop(self) -> None:
        """A renewal pass every ``renew_interval_s``, whatever the last one met.

        A pass has until the next one is due: one still waiting then is abandoned, and the next
        sends afresh with the lanes held by then; and a failed pass is not followed by a longer
        wait (it costs a connection attempt per interval). Otherwise a pass begun while Redis was
        away, waiting in the client's own reconnect retries (their waits grow to 2 s), held up
        the renewal of the lanes taken once Redis was back, and with it the news that one was
        lost: the handler ran on 1.4 s past its lane's end (explorer seed 28924). So a round trip
        to Redis must take less than the renew interval."""
        interval = self.settings.renew_interval_s
        loop = asyncio.get_running_loop()
        failing = 0
        while not self._stopping.is_set():
            due = loop.time() + interval
            try:
                await within(self._renew(), interval)
                if failing:
                    log.info("renewed again after %d failed passes", failing)
                failing = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop never dies: log the first failure, go on
                if not failing:
                    log.warning("renew pass failed (%s: %s); renewing every %gs until one succeeds",
                                type(exc).__name__, str(exc) or f"not done within {interval:g}s", interval)
                failing += 1
            await self._pause(max(0.0, due - loop.time()))

    async def _renew(self) -> None:
        """Extend our lanes and keep their notifications ours; beat the heartbeat."""
        now = time.monotonic()  # (a lane not renewed within its TTL: UserJob.renewed_at's timer)
        held = [job for job in self.jobs.values() if job.lease is not None]
        leases = [job.lease for job in held if job.lease is not None]
        nids: list[str] = []
        for job, lease, ok in zip(held, leases, await self.store.renew(leases), strict=True):
            if job.lease is not lease:
                continue  # released (or lost) meanwhile
            if ok:
                job.renewed_at(lease, now)
                nids += job.nids
            else:
                job.renew_failed()
        # touching resets their idle time, so no one reclaims a live holder's: only the ones
        # still pending under us (one another worker reclaimed is its duty)
        await worker_ops.touch_and_beat(self.r, self.store.scripts, self.pool, self.worker_id, nids,
                                        self.settings.heartbeat_ttl_ms)

    # --- reports ---------------------------------------------------------------------
    async def _report_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        failures = 0
        while not self._stopping.is_set():
            try:
                await self._report()
                failures = 0
                self._wake_report.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake_report.wait(), self.policy.report_interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                log.warning("report failed (%s); retrying", exc)
                await self._pause(BACKOFF.compute(failures))

    async def _report(self) -> None:
        busy = sum(1 for job in self.jobs.values() if job.lease is not None)
        report = self.sensor.sample(
            worker=self.worker_id, tier=self.pool, state=self.state,
            slots=Slots(busy=busy, total=self.policy.concurrency,
                        queue_depth=len(self.jobs) - busy),
            counters=self.counters_now(), interval=self.policy.report_interval_s,
            turn_stats=self.tally.stats(),
            protected_until=self.protected_until if self.protected_until > time.time() else None)
        await post_report_async(self.r, report, REPORTS_MAXLEN)
