"""The worker process: pull notifications, run user jobs, report, renew, reclaim, drain.

Every loop catches its errors per pass, logs them and backs off (capped, jittered), so a
Redis restart or pause costs latency, never the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import CodecError, as_str, decode
from protocol.groups import pool_name
from protocol.models import Control, Counters, WorkerInfo, WorkerState
from protocol.policy import Policy
from stores import worker_ops
from stores.connection import connect_async
from stores.control import read_control_async
from stores.group_assignment import rejected_groups
from stores.policies import PolicyRead, read_policy
from stores.replicas import ReplicaWait
from stores.retry import CLUSTER_IN_MOTION, TRANSIENT, until_ok
from stores.turns import StoreConfig, UserStore
from worker import handlers
from worker.aio import Abandoned, cancel_within, dump_tasks, unless_stuck
from worker.intake import Fields, notification_user
from worker.job import UserJob
from worker.sensor import Sensor
from worker.services import BACKOFF, JobServices
from worker.settings import WorkerSettings
from worker.tally import TurnTally

log = logging.getLogger("fleet.worker")
DEREGISTER_S = 5.0  # at most this long to leave the registry on the way out
DEREGISTER_UNSTARTED_S = 1.0  # a worker drained before it served leaves the registry within this
DEREGISTER_AWAY_S = 1.0  # ... when the last read found Redis gone (the commander clears it)
DRAIN_READ_GRACE_S = 0.5  # a drain waits this much past a read's block time before abandoning it
START_CANCEL_S = 0.1  # a drain waits this much for a start it cancelled before leaving it behind


class Worker(JobServices):
    """One worker process of one tier."""

    def __init__(self, settings: WorkerSettings, r: aioredis.Redis | None = None) -> None:
        self.settings = settings
        self.tier = settings.tier
        self.group = settings.group  # "" unless this worker serves one group of the tier
        self.pool = pool_name(self.tier, self.group)  # whose ready streams, registry entry, reports
        self.tier_policy: Policy | None = None  # the tier's whole policy: its groups (None: not read)
        self.rejected: frozenset[str] = frozenset()  # the tier's groups the commander rejected
        self.worker_id = settings.worker_id
        self.r = r or connect_async(settings.redis_url)
        self.store = UserStore(self.r, self.worker_id, StoreConfig(
            lane_ttl_ms=settings.lane_ttl_ms, session_max=settings.session_max,
            context_turns=settings.context_turns, memory_k=settings.memory_k,
            reply_ttl_ms=settings.reply_ttl_s * 1000), tier=settings.tier)
        self.policy = Policy()
        self.handler: handlers.Handler = handlers.get(self.policy.handler)
        self._executor: ThreadPoolExecutor | None = None  # sync handlers' threads, one per slot
        self._executor_size = 0
        self.jobs: dict[str, UserJob] = {}
        self.draining = False
        self.state: WorkerState = "starting"
        self.counters = Counters()
        self.tally = TurnTally()
        self.sensor = Sensor()
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._wake_report = asyncio.Event()
        self._stopping = asyncio.Event()  # set once the jobs are done: the loops end
        self._drained = asyncio.Event()  # set by drain(): ends a start still retrying
        self._reclaim_from: dict[int, str] = {}  # ready shard -> XAUTOCLAIM's cursor over its pending list
        self._shards = 1  # ready shards read: the policy's, or more while higher ones exist
        self._read_turn = 0  # on a Cluster, the shard whose read blocks next (worker_ops.read_ready)
        self._policy_rejected: str | None = None  # why the key is not applied here (logged once)
        self._rescanned: dict[str, float] = {}  # missing handler -> when entry points were re-read
        self._started = 0.0
        self._redis_away = False  # the last read of the ready stream failed or was abandoned
        self._ready_key = keys.ready(self.pool)
        # line-buffered: a SIGKILLed worker's last entry is on disk (its exit never is)
        self._trace = open(settings.handler_trace, "a", buffering=1) if settings.handler_trace else None  # noqa: SIM115

    # --- lifecycle -------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until drained; return the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.drain, sig.name)
        loop.add_signal_handler(signal.SIGUSR1, dump_tasks)  # `kill -USR1 <pid>`: what is it waiting on
        if not await self._start_unless_drained():
            await self._close()
            log.info("worker %s stopped before it started serving", self.worker_id)
            return 0
        self.state = "draining" if self.draining else "ready"
        self._wake_report.set()
        background = [asyncio.create_task(coro) for coro in (
            self._every("reclaim", self.settings.reclaim_interval_s, self._reclaim),
            self._renew_loop(),
            self._every("policy", self.settings.policy_refresh_s, self._refresh_policy),
            self._every("housekeeping", self.settings.housekeeping_interval_s, self._housekeeping),
            self._report_loop(), self._control_loop())]
        log.info("worker %s serving tier %s (handler=%s, concurrency=%d)", self.worker_id,
                 self.pool, self.policy.handler, self.policy.concurrency)
        await self._pull_loop()
        await self._finish_jobs()
        await self._stop_background(background)
        with contextlib.suppress(TimeoutError):  # Redis away: the commander clears the entry
            await asyncio.wait_for(self._until_ok("deregister", self._deregister, attempts=5),
                                   DEREGISTER_AWAY_S if self._redis_away else DEREGISTER_S)
        await self._close()
        log.info("worker %s drained and stopped", self.worker_id)
        return 0

    async def _start_unless_drained(self) -> bool:
        """Register and join the group, retrying while Redis is away, unless a drain comes
        first: a worker that serves nothing yet has nothing to finish, so SIGTERM stops it at
        once (issue 8, hole 6). False if it was drained before it started."""
        start = asyncio.ensure_future(self._until_ok("start", self._start, unless=self._drained))
        drained = asyncio.ensure_future(self._drained.wait())
        await asyncio.wait({start, drained}, return_when=asyncio.FIRST_COMPLETED)
        drained.cancel()
        if start.done() and not self.draining:  # (both at once, e.g. SIGTERM while stopped
            start.result()                       # by SIGSTOP: it never served, so it stops)
            return True
        # (a moment only: a redis-py call that drops the cancellation goes on with its own
        # retries for seconds before it fails and until_ok sees the drain, explorer seed 32878)
        await cancel_within(start, START_CANCEL_S)
        with contextlib.suppress(TimeoutError, *TRANSIENT):  # it may have registered
            await asyncio.wait_for(self._deregister(), DEREGISTER_UNSTARTED_S)
        return False

    async def _close(self) -> None:
        await self.r.aclose()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        if self._trace is not None:
            self._trace.close()

    def drain(self, reason: str = "") -> None:
        """Stop pulling, finish the users in flight, then exit."""
        if not self.draining:
            log.info("worker %s draining (%s)", self.worker_id, reason)
            self.draining = True
            self._drained.set()
            if self.state != "starting":
                self.state = "draining"
            self._slot_freed.set()
            self._wake_report.set()

    async def _stop_background(self, tasks: list[asyncio.Task[None]]) -> None:
        """Stop the loops: each checks ``_stopping``, and is cancelled as well. A library that
        swallows a cancellation mid-command must not keep the process alive, hence the flag
        and a bounded wait."""
        self._stopping.set()
        for task in tasks:
            task.cancel()
        _done, pending = await asyncio.wait(tasks, timeout=5.0)
        if pending:
            log.warning("%d background loops did not stop in time; exiting anyway", len(pending))

    async def _start(self) -> None:
        await self._refresh_policy()
        await worker_ops.join_ready_group(self.r, self.pool, self._shards)
        self._started = time.time()
        await self._register()

    async def _register(self) -> None:
        info = WorkerInfo(worker=self.worker_id, tier=self.pool, pid=os.getpid(),
                          host=self.settings.host, started=self._started,
                          handlers=handlers.registered_names(),
                          renew_interval_s=self.settings.renew_interval_s, **self.settings.placement)
        await worker_ops.register_worker(self.r, info, self.settings.heartbeat_ttl_ms)

    async def _deregister(self) -> None:
        await worker_ops.deregister_worker(self.r, self.pool, self.worker_id, self._shards)

    async def _finish_jobs(self) -> None:
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    # --- the loops -------------------------------------------------------------------
    async def _until_ok(self, what: str, fn: Callable[[], Awaitable[None]], attempts: int = 0,
                        unless: asyncio.Event | None = None) -> None:
        """``stores.retry.until_ok`` with the worker's backoff and logger."""
        await until_ok(what, fn, backoff=BACKOFF, log=log, attempts=attempts, unless=unless)

    async def _every(self, what: str, interval: float, fn: Callable[[], Awaitable[None]]) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                await fn()
                failures = 0
                await self._pause(interval)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a loop never dies: log, back off, go on
                failures += 1
                log.warning("%s pass failed (%s: %s)", what, type(exc).__name__, exc)
                await self._pause(max(interval, BACKOFF.compute(failures)))

    async def _read_failed(self, failures: int, exc: Exception) -> int:
        """A failed read of the ready stream: Redis is away (or failing over); back off."""
        self._redis_away = True
        log.warning("reading %s failed (%s); retrying", self._ready_key, exc)
        await asyncio.sleep(BACKOFF.compute(failures + 1))
        return failures + 1

    async def _pull_loop(self) -> None:
        failures = 0
        while not self.draining:
            free = self.policy.concurrency - len(self.jobs)
            if free <= 0:
                self._slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), 1.0)
                continue
            try:
                resp = await self._read_ready(min(free, self.settings.batch))
                failures = 0
            except ResponseError as exc:
                if "NOGROUP" in str(exc):  # the stream was deleted under us: recreate
                    await self._until_ok("recreate group", self._start, unless=self._drained)
                    continue
                if not isinstance(exc, CLUSTER_IN_MOTION):  # a MOVED past the client's retries: wait
                    raise
                failures = await self._read_failed(failures, exc)
                continue
            except TRANSIENT as exc:
                failures = await self._read_failed(failures, exc)
                continue
            for nid, fields in resp or []:
                self.dispatch(nid, fields, reclaimed=False)

    async def _read_ready(self, count: int) -> worker_ops.Delivered | None:
        """One XREADGROUP. A drain lets it finish within its block time (what it delivers is
        handed back); one still running past that is stuck in the client's reconnect attempts
        (Redis is gone) and is abandoned, so SIGTERM does not wait them out. Anything it may
        have delivered stays pending under this consumer: the commander's sweep hands it on."""
        self._read_turn += 1
        read = worker_ops.read_ready(self.r, self.pool, self.worker_id, count, self.settings.block_ms,
                                     self._shards, self._read_turn)
        try:
            rows = await unless_stuck(read, self._drained, self.settings.block_ms / 1000 + DRAIN_READ_GRACE_S,
                                      DRAIN_READ_GRACE_S)
        except Abandoned:
            self._redis_away = True
            log.warning("reading %s abandoned on drain: Redis is not answering", self._ready_key)
            return None
        self._redis_away = False
        return rows

    def dispatch(self, nid: str, fields: Fields | None, reclaimed: bool) -> None:
        """Hand a notification to its user's job, starting one if needed."""
        try:
            user = notification_user(fields or {})
        except CodecError as exc:
            self._spawn(self.reject_notification(nid, fields or {}, str(exc)))
            return
        job = self.jobs.get(user)
        if job is None and self.draining:
            # delivered by a read that was in flight when the drain began: give it back
            self._spawn(self.hand_back(nid, user))
            return
        if job is None:
            job = self.jobs[user] = UserJob(self, user)
            job.attach(nid, reclaimed)
            self._spawn(job.run())
        else:
            job.attach(nid, reclaimed)

    def job_done(self, job: UserJob) -> None:
        """Forget a finished job (idempotent) and free its slot."""
        if self.jobs.get(job.user) is job:
            del self.jobs[job.user]
            self.sensor.saw(job.user)
            self._slot_freed.set()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reclaim(self) -> None:
        """Take over notifications idle past ``reclaim_idle_ms``: their consumer is gone."""
        free = self.policy.concurrency - len(self.jobs)
        if self.draining or free <= 0:
            return
        # Resume where the last pass stopped: a scan is bounded (10 x COUNT entries), and
        # from 0-0 every pass would meet the same notifications at the head of the pending
        # list (those of jobs in progress, and reclaimed ones whose lane is busy, which stay)
        # and never reach an idle one further on (issue 8, hole 2). "0-0" back = wrapped.
        # Each ready shard has its own pending list and cursor.
        for shard in range(self._shards):
            free = self.policy.concurrency - len(self.jobs)
            if self.draining or free <= 0:
                return
            self._reclaim_from[shard], claimed = await worker_ops.reclaim_idle(
                self.r, self.pool, self.worker_id, self.settings.reclaim_idle_ms,
                start_id=self._reclaim_from.get(shard, "0-0"), count=free, shard=shard)
            for nid, fields in claimed:
                if fields:
                    log.info("reclaimed notification %s (%s)", nid, fields.get(b"user"))
                    self.dispatch(nid, fields, reclaimed=True)
                else:  # trimmed away under its consumer: nothing left to do
                    await self.ack([nid])

    async def _refresh_policy(self) -> None:
        """Apply the tier's policy. One naming a handler this worker cannot load is rejected here
        (after looking for newly installed handlers): the worker keeps what it runs."""
        read = await self._read_policy()
        keep = read.missing_handler is not None and read.source == "default"
        if read.missing_handler is not None and read.error != self._policy_rejected:
            log.error("policy of %s not applied on this worker: %s; running the %s policy", self.tier,
                      read.error, "current" if keep else read.source)
        self._policy_rejected = read.error if read.missing_handler is not None else None
        if keep:
            return  # the last good copy is not loadable here either: keep ours, not the default
        rejected = frozenset(await rejected_groups(self.r, self.tier) if read.policy.groups else ())
        seen = None if self.tier_policy is None else (self.tier_policy.weights(), self.rejected)
        if (read.policy.weights(), rejected) != seen:  # users move between turns from here on
            log.info("groups of %s now %s%s", self.tier,
                     ", ".join(f"{n} {w:g}" for n, w in read.policy.weights()) or "none",
                     f" (rejected: {', '.join(sorted(rejected))})" if rejected else "")
        self.tier_policy, self.rejected = read.policy, rejected
        mine = self._own_policy(read.policy)
        if mine != self.policy:
            if mine.handler != self.policy.handler:
                self.handler = handlers.get(mine.handler)
            self.policy = mine
            self.store.replica_wait = ReplicaWait.of(mine)  # WAIT after acquire and commit
            log.info("policy of %s now from %s (handler=%s, concurrency=%d)%s", self.pool,
                     read.source, mine.handler, mine.concurrency,
                     f"; key rejected: {read.error}" if read.error else "")
            self._slot_freed.set()
        self._shards = await worker_ops.more_shards(self.r, self.pool, self.policy.ready_shards, self._shards)

    def _own_policy(self, policy: Policy) -> Policy:
        """What this worker runs of the tier's ``policy``: its group's, when it serves a group the
        policy names; the tier's when it serves none; its current one when its group was removed
        (it serves nobody then: every user it meets is handed to their group)."""
        if not self.group:
            return policy
        if any(g.name == self.group for g in policy.groups):
            return policy.for_group(self.group)
        return self.policy

    async def _read_policy(self) -> PolicyRead:
        read = await read_policy(self.r, self.tier, handlers.registered_names(), record=True,
                                 reader=f"worker {self.worker_id}", group=self.group or None)
        name = read.missing_handler
        every = self.settings.handler_rescan_s
        if name is None or time.monotonic() - self._rescanned.get(name, -every) < every:
            return read
        self._rescanned[name] = time.monotonic()
        if name not in handlers.rescan():
            return read
        log.info("handler %r found (installed since this worker started)", name)
        await self._register()  # the registry says which handlers this worker has
        return await read_policy(self.r, self.tier, handlers.registered_names(), record=True,
                                 reader=f"worker {self.worker_id}", group=self.group or None)

    async def _housekeeping(self) -> None:
        """Trim the ready stream below what is pending or undelivered; forget stale users."""
        await worker_ops.trim_ready(self.r, self.pool, 10 * self.policy.active_window_s, self._shards)

    async def _control_loop(self) -> None:
        last, failures = "0-0", 0
        while not self._stopping.is_set():
            try:
                rows = await read_control_async(self.r, self.worker_id, last, count=10, block_ms=1000)
                failures = 0
            except asyncio.CancelledError:
                raise
            except TRANSIENT as exc:
                failures += 1
                log.warning("reading control stream failed (%s)", exc)
                await self._pause(BACKOFF.compute(failures))
                continue
            for cid, fields in rows:
                last = as_str(cid)
                self._on_control(fields)

    def _on_control(self, fields: Fields) -> None:
        try:
            msg = decode(Control, fields.get(b"m", b""), max_bytes=4096)
        except CodecError as exc:
            log.warning("ignored a bad control message: %s", exc)
            return
        if msg.kind == "drain":
            self.drain(msg.reason or "drain command")
