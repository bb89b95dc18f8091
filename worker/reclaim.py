"""The reclaim of notifications idle past ``reclaim_idle_ms``: their consumer is gone (a worker
that died, or was paused past its lanes), and this worker takes them over."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from stores import worker_ops
from worker.intake import Fields
from worker.settings import WorkerSettings

log = logging.getLogger("fleet.worker")


class Reclaim:
    """One ``XAUTOCLAIM`` per ready shard a pass, as many as there are free slots.

    Each shard's scan resumes where the last pass stopped: a scan is bounded (10 x COUNT
    entries), and from 0-0 every pass would meet the same notifications at the head of the
    pending list (those of jobs in progress, and reclaimed ones whose lane is busy, which stay)
    and never reach an idle one further on. Its cursor "0-0" back means it wrapped."""

    def __init__(self, r: aioredis.Redis, settings: WorkerSettings, free: Callable[[], int],
                 dispatch: Callable[[str, Fields, bool, int], None],
                 ack: Callable[[list[str]], Awaitable[None]]) -> None:
        self.r = r
        self.settings = settings
        self.free = free  # the slots free for new users now (none while draining)
        self.dispatch = dispatch  # a claimed notification to its user's job
        self.ack = ack
        self._from: dict[int, str] = {}  # ready shard -> XAUTOCLAIM's cursor over its pending list

    async def pass_once(self, shards: int) -> None:
        """Claim idle notifications of ``shards`` ready shards and dispatch them."""
        for shard in range(shards):
            free = self.free()
            if free <= 0:
                return
            self._from[shard], claimed = await worker_ops.reclaim_idle(
                self.r, self.settings.pool, self.settings.worker_id, self.settings.reclaim_idle_ms,
                start_id=self._from.get(shard, "0-0"), count=free, shard=shard)
            for nid, fields, deliveries in claimed:
                if fields:
                    log.info("reclaimed notification %s (%s), delivery %d", nid, fields.get(b"user"),
                             deliveries)
                    self.dispatch(nid, fields, True, deliveries)
                else:  # trimmed away under its consumer: nothing left to do
                    await self.ack([nid])
