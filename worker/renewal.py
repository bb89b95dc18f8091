"""The renewal of a worker's lanes, every ``renew_interval_s``: each lease held is extended, the
notifications of its user kept ours (so nobody reclaims a live holder's), and the heartbeat
beaten, in one pass."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Protocol

import redis.asyncio as aioredis

from stores import worker_ops
from stores.redis_errors import RedisErrors
from stores.retry import TRANSIENT
from stores.turns import Lease, UserStore
from worker.aio import pause, within
from worker.settings import WorkerSettings

log = logging.getLogger("fleet.worker")


class Renewable(Protocol):
    """A job, as its renewal sees it (``worker.job.UserJob``)."""

    lease: Lease | None  # the lane it holds, if any

    @property
    def nids(self) -> list[str]: ...  # its notifications
    def renewed_at(self, lease: Lease, sent: float) -> None: ...
    def renew_failed(self) -> None: ...


class Heartbeat:
    """When a beat (a start's registration, or a renewal pass) was last attempted, and when one
    last reached Redis: a pod's liveness (``worker.pod``)."""

    def __init__(self) -> None:
        self.tried = time.monotonic()  # (the first attempt: the start)
        self.reached: float | None = None

    def trying(self) -> None:
        self.tried = time.monotonic()

    def arrived(self) -> None:
        self.reached = time.monotonic()


class Renewal:
    """Renews the lanes of ``jobs`` and beats the heartbeat, until ``stop`` is set."""

    def __init__(self, r: aioredis.Redis, settings: WorkerSettings, store: UserStore,
                 jobs: Iterable[Renewable], heartbeat: Heartbeat, stop: asyncio.Event,
                 errors: RedisErrors) -> None:
        self.r = r
        self.errors = errors
        self.settings = settings
        self.store = store
        self.jobs = jobs
        self.heartbeat = heartbeat
        self.stop = stop

    async def run(self) -> None:
        """A renewal pass every ``renew_interval_s``, whatever the last one met.

        A pass has until the next one is due: one still waiting then is abandoned, and the next
        sends afresh with the lanes held by then; and a failed pass is not followed by a longer
        wait (it costs a connection attempt per interval). Otherwise a pass begun while Redis was
        away, waiting in the client's own reconnect retries (their waits grow to 2 s), would hold
        up the renewal of the lanes taken once Redis was back, and with it the news that one was
        lost. So a round trip to Redis must take less than the renew interval."""
        interval = self.settings.renew_interval_s
        loop = asyncio.get_running_loop()
        failing = 0
        while not self.stop.is_set():
            due = loop.time() + interval
            try:
                await within(self.renew_once(), interval)
                if failing:
                    log.info("renewed again after %d failed passes", failing)
                failing = 0
                self.errors.answered("renew")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop never dies: log the first failure, go on
                if isinstance(exc, TRANSIENT):  # (a Redis error: logged once per kind there)
                    self.errors.failed("renew", exc)
                elif not failing:
                    log.warning("renew pass failed (%s: %s); renewing every %gs until one succeeds",
                                type(exc).__name__, str(exc) or f"not done within {interval:g}s", interval)
                failing += 1
            await pause(max(0.0, due - loop.time()), self.stop)

    async def renew_once(self) -> None:
        """Extend the leases held and keep their notifications ours; beat the heartbeat."""
        self.heartbeat.trying()
        now = time.monotonic()  # (a lane not renewed within its TTL: the job's LaneDeadline)
        held = [job for job in self.jobs if job.lease is not None]
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
        await worker_ops.touch_and_beat(self.r, self.store.scripts, self.settings.pool,
                                        self.settings.worker_id, nids, self.settings.heartbeat_ttl_ms)
        self.heartbeat.arrived()
