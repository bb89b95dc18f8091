"""A worker's control stream (``fleet:control:<worker>``): the commands sent to this worker, of
which it obeys ``drain``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from protocol.codec import CodecError, as_str, decode
from protocol.models import Control
from stores.control import read_control_async
from stores.redis_errors import RedisErrors
from stores.retry import TRANSIENT
from worker.aio import BACKOFF, pause
from worker.intake import Fields

log = logging.getLogger("fleet.worker")


class ControlStream:
    """Reads the worker's control stream from its start until ``stop`` is set; a drain command
    calls ``drain`` with its reason."""

    def __init__(self, r: aioredis.Redis, worker_id: str, drain: Callable[[str], None],
                 stop: asyncio.Event, errors: RedisErrors) -> None:
        self.r = r
        self.errors = errors
        self.worker_id = worker_id
        self.drain = drain
        self.stop = stop

    async def run(self) -> None:
        last, failures = "0-0", 0
        while not self.stop.is_set():
            try:
                rows = await read_control_async(self.r, self.worker_id, last, count=10, block_ms=1000)
                failures = 0
                self.errors.answered("control")
            except asyncio.CancelledError:
                raise
            except TRANSIENT as exc:
                failures += 1
                self.errors.failed("control", exc)
                await pause(BACKOFF.compute(failures), self.stop)
                continue
            for cid, fields in rows:
                last = as_str(cid)
                self.obey(fields)

    def obey(self, fields: Fields) -> None:
        """Act on one control message (a bad one is logged and ignored)."""
        try:
            msg = decode(Control, fields.get(b"m", b""), max_bytes=4096)
        except CodecError as exc:
            log.warning("ignored a bad control message: %s", exc)
            return
        if msg.kind == "drain":
            self.drain(msg.reason or "drain command")
