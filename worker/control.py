"""A worker's control stream (``fleet:w:{<worker>}:control``: ``drain``, from the commander) and
its cancels stream (``fleet:w:{<worker>}:cancels``: a client's ``Fleet.cancel`` of a turn of a
user whose lane it holds), read together with one blocking ``XREAD``: a command is seen as
soon as it is written. Each stream is obeyed for its own kind only: a client, which may write
cancels, cannot drain a worker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from protocol.codec import CodecError, as_str, decode, validate
from protocol.models import Control
from stores.control import read_control_async
from stores.redis_errors import RedisErrors
from stores.retry import TRANSIENT
from worker.aio import BACKOFF, pause
from worker.intake import Fields

log = logging.getLogger("fleet.worker")


class ControlStream:
    """Reads the worker's control and cancels streams from their start until ``stop`` is set; a
    drain command calls ``drain`` with its reason, a cancel ``cancel(user, turn_id, entry)``."""

    def __init__(self, r: aioredis.Redis, worker_id: str, drain: Callable[[str], None],
                 stop: asyncio.Event, errors: RedisErrors,
                 cancel: Callable[[str, str, str], None] | None = None) -> None:
        self.r = r
        self.errors = errors
        self.worker_id = worker_id
        self.drain = drain
        self.cancel = cancel
        self.stop = stop

    async def run(self) -> None:
        last, last_cancel, failures = "0-0", "0-0", 0
        while not self.stop.is_set():
            try:
                rows, cancels = await read_control_async(self.r, self.worker_id, last, count=10,
                                                         block_ms=1000, last_cancel=last_cancel)
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
            for cid, fields in cancels:
                last_cancel = as_str(cid)
                self.obey_cancel(fields)

    def obey(self, fields: Fields) -> None:
        """Act on one control message (a bad one, or one that is no drain, is logged and ignored)."""
        try:
            msg = decode(Control, fields.get(b"m", b""), max_bytes=4096)
        except CodecError as exc:
            log.warning("ignored a bad control message: %s", exc)
            return
        if msg.kind == "drain":
            self.drain(msg.reason or "drain command")
        else:
            log.warning("ignored a %s command on the control stream", msg.kind)

    def obey_cancel(self, fields: Fields) -> None:
        """Act on one cancel: field ``m``, a msgpack ``Control``, or the plain form any Redis
        client can write (fields ``kind`` = cancel, ``user``, ``turn_id``, ``entry``). A bad one,
        or one that is no cancel, is logged and ignored."""
        try:
            msg = decode(Control, fields[b"m"], max_bytes=4096) if b"m" in fields else _plain(fields)
        except CodecError as exc:
            log.warning("ignored a bad cancel: %s", exc)
            return
        if msg.kind != "cancel":
            log.warning("ignored a %s command on the cancels stream", msg.kind)
        elif self.cancel is not None:
            self.cancel(msg.user, msg.turn_id, msg.entry)


def _plain(fields: Fields) -> Control:
    """A control message in plain fields (CodecError if it is not a valid one)."""
    body = {k.decode(errors="replace"): v.decode(errors="replace")[:200] for k, v in list(fields.items())[:8]}
    return validate(Control, {**body, "ts": 0.0})
