"""The worker as a sensor: every ``report_interval`` it posts raw occupancy quantities to
``fleet:reports``, with no judgement (``Sensor`` samples the process, ``Reports`` posts)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

import psutil
import redis.asyncio as aioredis

from protocol.models import Counters, OccupancyReport, Slots, TurnStats, WorkerState
from stores.redis_errors import RedisErrors
from stores.reports import post_report_async
from stores.retry import TRANSIENT
from worker.aio import BACKOFF, pause
from worker.host import InFlight
from worker.settings import WorkerSettings
from worker.tally import TurnTally
from worker.tier_policy import TierPolicy

log = logging.getLogger("fleet.worker")
REPORTS_MAXLEN = 100_000


class Sensor:
    """Samples this process: cpu since the last sample, rss, users seen, load."""

    def __init__(self, users_window_s: float = 60.0) -> None:
        self.proc = psutil.Process()
        self.users_window_s = users_window_s
        self.last_seen: dict[str, float] = {}  # user -> last time a turn of theirs was served
        self._last_cpu: tuple[float, float] | None = None  # (cpu seconds, wall seconds)

    def saw(self, user: str) -> None:
        """Note that a turn of ``user`` was served."""
        self.last_seen[user] = time.time()

    def _cpu_fraction(self) -> float | None:
        times = self.proc.cpu_times()
        sample = (times.user + times.system, time.monotonic())
        prev, self._last_cpu = self._last_cpu, sample
        if prev is None or sample[1] <= prev[1]:
            return None
        fraction: float = max(0.0, (sample[0] - prev[0]) / (sample[1] - prev[1]))  # psutil: untyped
        return fraction

    def _users(self, now: float, interval: float) -> tuple[int, int]:
        horizon = now - self.users_window_s
        self.last_seen = {u: t for u, t in self.last_seen.items() if t >= horizon}
        recent = sum(1 for t in self.last_seen.values() if t >= now - interval)
        return len(self.last_seen), recent

    def sample(self, *, worker: str, tier: str, state: WorkerState,
               slots: Slots, counters: Counters, interval: float,
               turn_stats: TurnStats | None = None,
               protected_until: float | None = None) -> OccupancyReport:
        """One report row."""
        now = time.time()
        users, active = self._users(now, interval)
        load = os.getloadavg()
        return OccupancyReport(worker=worker, tier=tier, ts=now, state=state, users=users,
                               active_users=active, slots=slots, cpu=self._cpu_fraction(),
                               rss=self.proc.memory_info().rss, counters=counters,
                               load=(load[0], load[1], load[2]), turn_stats=turn_stats or TurnStats(),
                               protected_until=protected_until)


class Reports:
    """Posts the worker's occupancy reports: every ``report_interval_s`` of its policy, and at
    once when woken (it started or drains, a handler asked for protection)."""

    def __init__(self, r: aioredis.Redis, settings: WorkerSettings, tier_policy: TierPolicy,
                 jobs: InFlight, tally: TurnTally, sensor: Sensor, state: Callable[[], WorkerState],
                 stop: asyncio.Event, errors: RedisErrors) -> None:
        self.r = r
        self.errors = errors
        self.settings = settings
        self.tier_policy = tier_policy
        self.jobs = jobs
        self.tally = tally
        self.sensor = sensor
        self.state = state
        self.stop = stop
        self.protected_until = 0.0  # a handler's scale-in protection (TurnContext.protect)
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        """Report now."""
        self._wake.set()

    def protect(self, seconds: float) -> float:
        """Protect this worker from scale-in for ``seconds`` (at most ``max_protection_s``; 0 ends
        it) and report it at once. Called from handlers, possibly on a handler thread."""
        seconds = min(max(0.0, seconds), self.tier_policy.policy.controls.max_protection_s)
        self.protected_until = time.time() + seconds if seconds > 0 else 0.0
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)
        return self.protected_until

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        failures = 0
        while not self.stop.is_set():
            try:
                await self.report_once()
                failures = 0
                self.errors.answered("report")
                self._wake.clear()
                interval = self.tier_policy.policy.scaling.report_interval_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), interval)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                if isinstance(exc, TRANSIENT):
                    self.errors.failed("report", exc)
                else:
                    log.warning("report failed (%s: %s); retrying", type(exc).__name__, exc)
                await pause(BACKOFF.compute(failures), self.stop)

    async def report_once(self) -> None:
        policy = self.tier_policy.policy
        jobs = list(self.jobs)
        busy = sum(1 for job in jobs if job.lease is not None)
        now = time.monotonic()  # handler time of the turns still running counts up to now
        running = sum(now - job.busy_since for job in jobs if job.busy_since is not None)
        report = self.sensor.sample(
            worker=self.settings.worker_id, tier=self.settings.pool, state=self.state(),
            slots=Slots(busy=busy, total=policy.concurrency, queue_depth=len(jobs) - busy),
            counters=self.tally.counters(running), interval=policy.scaling.report_interval_s,
            turn_stats=self.tally.stats(),
            protected_until=self.protected_until if self.protected_until > time.time() else None)
        await post_report_async(self.r, report, REPORTS_MAXLEN)
