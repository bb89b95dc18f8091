"""What a worker offers its jobs (``worker.job.JobHost``): acks, hand-overs, dead letters, the
sync handlers' threads, the handler trace and the counters; and its reports of them to the
commander. A base of ``worker.app.Worker``, which owns the state declared below."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO

import redis.asyncio as aioredis

from protocol.models import Counters, Slots, WorkerState
from protocol.policy import Policy
from stores import worker_ops
from stores.deadletters import dead_letter_async
from stores.policies import tier_defined_async
from stores.reports import post_report_async
from stores.retry import TRANSIENT, Backoff
from stores.turns import UserStore
from worker import handlers
from worker.intake import Fields
from worker.job import UserJob
from worker.sensor import Sensor
from worker.tally import TurnTally

log = logging.getLogger("fleet.worker")  # the worker's logger, as before the split
BACKOFF = Backoff(base=0.05, cap=2.0)  # the loops' waits: 50 ms doubling to 2 s, full jitter
REPORTS_MAXLEN = 100_000


class JobServices:
    """The worker's side of a job's calls, and the bookkeeping of the turns jobs run."""

    r: aioredis.Redis
    tier: str
    worker_id: str
    store: UserStore
    policy: Policy
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

    async def ack(self, nids: list[str]) -> None:
        """Ack notifications of the tier's ready stream that are still ours: one another worker
        reclaimed meanwhile carries a duty for it now, and stays."""
        if nids:
            await worker_ops.ack_notifications(self.store.scripts, self.tier, self.worker_id, nids,
                                               self.store.batcher)

    async def ack_covered(self, holder: str, user: str, nids: list[str]) -> None:
        """Ack notifications for ``user`` whose turns the lane's ``holder`` ("<worker>|<token>")
        will see, if the holder has one of the user's notifications pending (its carrier of the
        duty, should it die); else keep them pending: they are reclaimed once idle."""
        if not nids:
            return
        acked = await worker_ops.ack_covered(self.store.scripts, self.tier, self.worker_id,
                                             holder.rpartition("|")[0], user, nids)
        if acked < 0:
            log.info("lane of %s is held by %s with none of its notifications pending: ours stay "
                     "pending", user, holder)

    async def tier_defined(self, tier: str) -> bool:
        """Whether a policy defines ``tier``: a turn for one that does not is dead-lettered."""
        return await tier_defined_async(self.r, tier)

    async def notify(self, user: str, tier: str) -> None:
        """Post a fresh notification for ``user`` on ``tier``'s ready stream (a hand-over)."""
        # the user's shard of this tier; another tier's count is not known here: its shard 0,
        # which every worker of that tier reads
        await worker_ops.notify_ready(self.r, tier, user,
                                      self.policy.ready_shards if tier == self.tier else 1)

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
            await self.notify(user, self.tier)
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

    async def _report_loop(self) -> None:
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
            worker=self.worker_id, tier=self.tier, state=self.state,
            slots=Slots(busy=busy, total=self.policy.concurrency,
                        queue_depth=len(self.jobs) - busy),
            counters=self.counters_now(), interval=self.policy.report_interval_s,
            turn_stats=self.tally.stats())
        await post_report_async(self.r, report, REPORTS_MAXLEN)
