"""The worker process: pull notifications, run user jobs, report, renew, reclaim, drain.

``Worker`` is a short loop over collaborators that each own their state: the tier's policy
(``TierPolicy``), the jobs in flight and what each gets from the worker (``InFlight``,
``Host``), the renewal of their lanes (``Renewal``), the reclaim of idle notifications
(``Reclaim``), the occupancy reports (``Reports``) and the control stream (``ControlStream``).
Every loop catches its errors per pass, logs them and backs off (capped, jittered), so a Redis
restart or pause costs latency, never the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import CodecError
from protocol.models import WorkerInfo, WorkerState
from protocol.policy import TurnsPolicy
from stores import functions, worker_ops
from stores.connection import connect_async
from stores.redis_errors import RedisErrors
from stores.replicas import ReplicaWait
from stores.retry import TRANSIENT, until_ok
from stores.turns import StoreConfig, UserStore
from worker import handlers
from worker.aio import BACKOFF, Abandoned, cancel_within, dump_tasks, every, unless_stuck, within
from worker.control import ControlStream
from worker.host import Host, InFlight
from worker.intake import Fields, notification_user
from worker.job import UserJob
from worker.reclaim import Reclaim
from worker.renewal import Heartbeat, Renewal
from worker.sensor import Reports, Sensor
from worker.settings import WorkerSettings
from worker.tally import TurnTally
from worker.tier_policy import TierPolicy

log = logging.getLogger("fleet.worker")
DEREGISTER_S = 5.0  # at most this long to leave the registry on the way out
DEREGISTER_UNSTARTED_S = 1.0  # a worker drained before it served leaves the registry within this
DEREGISTER_AWAY_S = 1.0  # ... when the last read found Redis gone (the commander clears it)
DRAIN_READ_GRACE_S = 0.5  # a drain waits this much past a read's block time before abandoning it
START_CANCEL_S = 0.1  # a drain waits this much for a start it cancelled before leaving it behind
STOP_SIGNALS = ("SIGTERM", "SIGINT")  # the drain reasons of a stop signal (run's handlers)


def freeze_startup_heap() -> None:
    """Move every object alive now, once the worker has joined (modules, pydantic's schemas,
    the handler and its imports: some 54,000), to the collector's permanent generation, after
    one last collection. A full collection scanned them all every second or two under load,
    some 64 ms of CPU in which the loop served nothing (7 ms once frozen: ``bench_peers
    --gc-probe``), the tail of a turn's latency. The fork server's
    template does the same for the workers it forks. For a process of its own: objects frozen
    are never collected as cycles, so a process that runs many workers in turn (the tests, the
    simulator) would keep every one's."""
    gc.collect()
    gc.freeze()


class Worker:
    """One worker process of one tier (or of one group of it)."""

    def __init__(self, settings: WorkerSettings, r: aioredis.Redis | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
        """``on_ready``: called once the worker has joined, before it serves (the worker
        process's :func:`freeze_startup_heap`; not for workers that share a process)."""
        self.settings = settings
        self.on_ready = on_ready
        self.worker_id = settings.worker_id
        self.pool = settings.pool  # whose ready streams, registry entry and reports
        self.r = r or connect_async(settings.redis_url)
        self.store = UserStore(self.r, self.worker_id, StoreConfig(
            lane_ttl_ms=settings.lane_ttl_ms, session_max=settings.session_max,
            context_turns=settings.context_turns, memory_k=settings.memory_k,
            reply_ttl_ms=settings.reply_ttl_s * 1000), tier=settings.tier)
        self.state: WorkerState = "starting"
        self.redis_away = False  # the last read of the ready stream failed or was abandoned
        self.terminated = asyncio.Event()  # a stop signal came (a pod's linger ends on it)
        self._stopping = asyncio.Event()  # set once the jobs are done: the loops end
        self._drained = asyncio.Event()  # set by drain(): ends a start still retrying
        self._started = 0.0
        self._unavailable: dict[str, str] = {}  # handlers that failed to load, as last logged
        self._read_turn = 0  # on a Cluster, the shard whose read blocks next (worker_ops.read_ready)
        self.tier_policy = TierPolicy(self.r, settings, register=self._register, applied=self._applied)
        self.redis_errors = RedisErrors(log)  # every loop's: each kind logged once, counted in the reports
        self.tally = TurnTally(self.redis_errors.counts)
        sensor = Sensor()
        self.jobs = InFlight(on_done=sensor.saw)
        self.reports = Reports(self.r, settings, self.tier_policy, self.jobs, self.tally, sensor,
                               state=lambda: self.state, stop=self._stopping, errors=self.redis_errors)
        self.host = Host(self.r, settings, self.store, self.tier_policy, self.jobs, self.tally,
                         protect=self.reports.protect, redis_errors=self.redis_errors)
        self.heartbeat = Heartbeat()
        self.renewal = Renewal(self.r, settings, self.store, self.jobs, self.heartbeat, self._stopping,
                               self.redis_errors)
        self.reclaim = Reclaim(self.r, settings, free=lambda: self.jobs.free(self.policy.concurrency),
                               dispatch=self.dispatch, ack=self.host.ack)
        self.control = ControlStream(self.r, self.worker_id, drain=lambda reason: self.drain(reason),
                                     stop=self._stopping, errors=self.redis_errors, cancel=self.cancel_turn)

    @property
    def policy(self) -> TurnsPolicy:
        """What this worker runs: its group's policy when it serves a group."""
        return self.tier_policy.policy

    @property
    def draining(self) -> bool:
        return self.jobs.draining

    @property
    def stopping(self) -> bool:
        """Its jobs are done and its loops are ending."""
        return self._stopping.is_set()

    # --- lifecycle -------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until drained; return the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.drain, sig.name)
        loop.add_signal_handler(signal.SIGUSR1, dump_tasks)  # `kill -USR1 <pid>`: what is it waiting on
        if not await self._join_unless_drained():
            await self._close()
            log.info("worker %s stopped before it started serving", self.worker_id)
            return 0
        if self.on_ready is not None:
            self.on_ready()
        self.state = "draining" if self.draining else "ready"
        self.reports.wake()
        s, errors = self.settings, self.redis_errors
        background = [asyncio.create_task(coro) for coro in (
            every("reclaim", s.reclaim_interval_s, self._reclaim, self._stopping, errors),
            self.renewal.run(),
            every("policy", s.policy_refresh_s, self.tier_policy.refresh, self._stopping, errors),
            every("housekeeping", s.housekeeping_interval_s, self._housekeeping, self._stopping, errors),
            self.reports.run(), self.control.run())]
        log.info("worker %s serving tier %s (handler=%s, concurrency=%d)", self.worker_id,
                 self.pool, self.policy.handler, self.policy.concurrency)
        await self._pull_loop()
        await self.jobs.finish()
        await self._stop_background(background)
        with contextlib.suppress(Abandoned):  # Redis away: the commander clears the entry
            await within(self._until_ok("deregister", self._deregister, attempts=5),
                         DEREGISTER_AWAY_S if self.redis_away else DEREGISTER_S)
        await self._close()
        log.info("worker %s drained and stopped", self.worker_id)
        return 0

    def cancel_turn(self, user: str, turn_id: str, entry: str) -> None:
        """A cancel on the control stream: the job serving ``user`` here, if any, stops the turn
        (``UserJob.cancel``); else nothing (the turn's record decides when it is reached)."""
        job = self.jobs.get(user)
        if job is not None:
            job.cancel(turn_id, entry)

    def drain(self, reason: str = "") -> None:
        """Stop pulling, finish the users in flight, then exit."""
        if reason in STOP_SIGNALS:
            self.terminated.set()
        if not self.draining:
            log.info("worker %s draining (%s)", self.worker_id, reason)
            self.jobs.draining = True
            self._drained.set()
            if self.state != "starting":
                self.state = "draining"
            self.jobs.slot_freed.set()
            self.reports.wake()

    async def join(self) -> None:
        """Join the tier, once: wait for this version's functions library, apply its policy,
        join its ready group, register (and beat)."""
        self.heartbeat.trying()
        await functions.wait_for_library_async(self.r)
        await self.tier_policy.refresh()
        await worker_ops.join_ready_group(self.r, self.pool, self.tier_policy.shards)
        self._started = time.time()
        await self._register()
        self.heartbeat.arrived()

    async def _join_unless_drained(self) -> bool:
        """Join, retrying while Redis is away, unless a drain comes first: a worker that serves
        nothing yet has nothing to finish, so SIGTERM stops it at once. False if it was drained
        before it joined."""
        start = asyncio.ensure_future(self._until_ok("start", self.join, unless=self._drained))
        drained = asyncio.ensure_future(self._drained.wait())
        await asyncio.wait({start, drained}, return_when=asyncio.FIRST_COMPLETED)
        drained.cancel()
        if start.done() and not self.draining:  # (both at once, e.g. SIGTERM while stopped
            start.result()                       # by SIGSTOP: it never served, so it stops)
            return True
        # (a moment only: a redis-py call that drops the cancellation goes on with its own
        # retries for seconds before it fails and until_ok sees the drain)
        await cancel_within(start, START_CANCEL_S)
        with contextlib.suppress(Abandoned, *TRANSIENT):  # it may have registered
            await within(self._deregister(), DEREGISTER_UNSTARTED_S)
        return False

    async def _register(self) -> None:
        unavailable = handlers.unavailable()
        for name, error in unavailable.items():
            if self._unavailable.get(name) != error:  # once per handler and error
                log.warning("handler %r cannot be loaded: %s; it is unavailable on this worker", name, error)
        self._unavailable = unavailable
        info = WorkerInfo(worker=self.worker_id, tier=self.pool, pid=os.getpid(),
                          host=self.settings.host, started=self._started,
                          handlers=handlers.registered_names(), handler_errors=unavailable,
                          renew_interval_s=self.settings.renew_interval_s, **self.settings.placement)
        await worker_ops.register_worker(self.r, info, self.settings.heartbeat_ttl_ms)

    async def _deregister(self) -> None:
        await worker_ops.deregister_worker(self.r, self.pool, self.worker_id, self.tier_policy.shards)

    def _applied(self, policy: TurnsPolicy) -> None:
        """A new policy runs here: the replicas a write waits for, maybe more slots."""
        self.store.replica_wait = ReplicaWait.of(policy)  # WAIT after acquire and commit
        self.store.retention_ms = policy.durability.retention_ms  # the user's keys expire after
        self.jobs.slot_freed.set()

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

    async def _close(self) -> None:
        await self.r.aclose()
        self.host.close()

    async def _until_ok(self, what: str, fn: Callable[[], Awaitable[None]], attempts: int = 0,
                        unless: asyncio.Event | None = None) -> None:
        """``stores.retry.until_ok`` with the worker's backoff and logger."""
        await until_ok(what, fn, backoff=BACKOFF, log=log, attempts=attempts, unless=unless,
                       errors=self.redis_errors)

    # --- the notifications -----------------------------------------------------------
    async def _pull_loop(self) -> None:
        """Read the ready stream and dispatch, until drained. Any Redis error (BUSY, NOPERM,
        READONLY, LOADING, ...) is backed off and retried: what was not read stays in the stream."""
        failures = 0
        while not self.draining:
            free = self.jobs.free(self.policy.concurrency)
            if free <= 0:
                self.jobs.slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.jobs.slot_freed.wait(), 1.0)
                continue
            try:
                resp = await self._read_ready(min(free, self.settings.batch))
                failures = 0
                self.redis_errors.answered("read")
            except ResponseError as exc:
                if "NOGROUP" in str(exc):  # the stream was deleted under us: recreate
                    await self._until_ok("recreate group", self.join, unless=self._drained)
                    continue
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
                                     self.tier_policy.shards, self._read_turn)
        try:
            rows = await unless_stuck(read, self._drained, self.settings.block_ms / 1000 + DRAIN_READ_GRACE_S,
                                      DRAIN_READ_GRACE_S)
        except Abandoned:
            self.redis_away = True
            log.warning("reading %s abandoned on drain: Redis is not answering", keys.ready(self.pool))
            return None
        self.redis_away = False
        return rows

    async def _read_failed(self, failures: int, exc: Exception) -> int:
        """A failed read of the ready stream: Redis is away, failing over or erring; back off."""
        self.redis_away = True
        self.redis_errors.failed("read", exc)
        await asyncio.sleep(BACKOFF.compute(failures + 1))
        return failures + 1

    def dispatch(self, nid: str, fields: Fields | None, reclaimed: bool, deliveries: int = 1) -> None:
        """Hand a notification to its user's job, starting one if needed; ``deliveries``: the
        times it was delivered, this one included (the job's delivery limit)."""
        try:
            user = notification_user(fields or {})
        except CodecError as exc:
            self.jobs.spawn(self.host.reject_notification(nid, fields or {}, str(exc)))
            return
        job = self.jobs.get(user)
        if job is None and self.draining:
            # delivered by a read that was in flight when the drain began: give it back
            self.jobs.spawn(self.host.hand_back(nid, user))
            return
        if job is None:
            job = UserJob(self.host, user)
            self.jobs.add(job)
            job.attach(nid, reclaimed, deliveries)
            self.jobs.spawn(job.run())
        else:
            job.attach(nid, reclaimed, deliveries)

    async def _reclaim(self) -> None:
        await self.reclaim.pass_once(self.tier_policy.shards)

    async def _housekeeping(self) -> None:
        """Trim the ready stream below what is pending or undelivered; forget stale users."""
        await worker_ops.trim_ready(self.r, self.pool, 10 * self.policy.scaling.active_window_s,
                                    self.tier_policy.shards)
