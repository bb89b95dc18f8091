"""Streamed replies on the worker's side: what a handler emits, on its way to the turn's reply stream.

A streamed turn (``Turn.stream``) gets a :class:`StreamWriter` per attempt; the handler's
``ctx.emit`` (or the chunks an async generator handler yields) lands in its buffer. The
worker's :class:`StreamFlusher` sends every buffer that holds text once per ``flush_s``
(``FLEET_WORKER_STREAM_FLUSH_MS``), all turns' flushes in one loop pass, so on one node they
ride one round trip (``stores.batch``). A flush is fenced (``stream_append.lua``): a worker that
lost the lane writes nothing. What is still buffered when the handler returns goes into the
turn's commit itself (:meth:`StreamWriter.tail`), with the ``end`` entry and the reply: a turn
shorter than one flush interval costs no extra round trip.

The reader's contract (docs/guide/protocol.md): an attempt after the first starts with a
``restart`` entry, and so does a resend of an attempt's whole text after a flush whose outcome
is unknown (a connection lost with it in flight): the reader drops what it holds and reads on.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from stores.turns import Lease, StreamTail, UserStore

log = logging.getLogger("fleet.worker")


class StreamFlusher:
    """One timer for every streamed turn of a worker: every ``flush_s``, while some buffer holds
    text, each one is flushed, in the same loop pass."""

    def __init__(self, store: UserStore, flush_s: float) -> None:
        self.store = store
        self.flush_s = flush_s
        self._due: set[StreamWriter] = set()
        self._timer: asyncio.TimerHandle | None = None

    def writer(self, lease: Lease, entry: str, turn_id: str, attempt: int, max_bytes: int,
               restart: bool) -> StreamWriter:
        """A new writer for one attempt of a streamed turn (made on the worker's loop); with
        ``restart``, its first write starts with a 'restart' entry (text of an earlier run may be
        in the stream)."""
        return StreamWriter(self, lease, entry, turn_id, attempt, max_bytes, restart)

    def due(self, writer: StreamWriter) -> None:
        self._due.add(writer)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_s, self._tick)

    def forget(self, writer: StreamWriter) -> None:
        self._due.discard(writer)

    def _tick(self) -> None:
        self._timer = None
        due, self._due = self._due, set()
        for writer in due:
            writer.flush()


class StreamWriter:
    """One attempt's streamed text: buffered, flushed by the :class:`StreamFlusher`, the rest
    handed to the commit by :meth:`tail`. ``emit`` is safe from any thread."""

    def __init__(self, flusher: StreamFlusher, lease: Lease, entry: str, turn_id: str, attempt: int,
                 max_bytes: int, restart: bool) -> None:
        self.flusher, self.lease, self.entry, self.turn_id = flusher, lease, entry, turn_id
        self.attempt = attempt
        self.max_bytes = max_bytes  # the attempt's text beyond this is not streamed (the reply's limit)
        self.restart = restart  # the attempt's first write starts with 'restart'
        self.pending: list[str] = []  # emitted, not sent yet
        self.sent: list[str] = []  # written since the last 'restart' (or the stream's start)
        self.size = 0
        self.closed = False  # the attempt is over: nothing more is flushed
        self.stopped = ""  # why flushes stopped ('fenced', 'done', 'wrongtype', 'too long')
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._inflight: asyncio.Task[None] | None = None

    def emit(self, text: str) -> None:
        """Buffer ``text`` (the handler's ``ctx.emitter``): from the loop's thread at once, from
        a sync handler's thread through the loop (in the order emitted)."""
        if threading.get_ident() == self._thread:
            self._add(text)
        else:
            self._loop.call_soon_threadsafe(self._add, text)

    def _add(self, text: str) -> None:
        if self.closed or self.stopped:
            return
        self.size += len(text.encode())
        if self.size > self.max_bytes:
            self._stop("too long")
            return
        self.pending.append(text)
        if self._inflight is None:
            self.flusher.due(self)

    def flush(self) -> None:
        """Send what is buffered (the flusher's tick)."""
        if self.closed or self.stopped or not self.pending or self._inflight is not None:
            return
        text, restart = "".join(self.pending), self.restart
        self.pending = []
        self._inflight = asyncio.ensure_future(self._send(text, restart))

    async def _send(self, text: str, restart: bool) -> None:
        try:
            res = await self.flusher.store.append_stream(self.lease, self.entry, self.turn_id, self.attempt,
                                                         text, restart)
        except Exception as exc:  # noqa: BLE001 - written or not, unknown: resend it all after a restart
            log.warning("a flush of turn %s's stream failed (%s: %s); its text is sent again after a restart",
                        self.turn_id, type(exc).__name__, str(exc)[:200])
            self.pending = [*self.sent, text, *self.pending]
            self.sent, self.restart = [], True
        else:
            if res == "ok":
                self.sent.append(text)
                self.restart = False
            else:
                self._stop(res)
        finally:
            self._inflight = None
        if self.pending and not self.closed and not self.stopped:
            self.flusher.due(self)

    def _stop(self, why: str) -> None:
        if not self.stopped:
            log.info("turn %s, attempt %d: its text is no longer streamed (%s)", self.turn_id, self.attempt,
                     why)
        self.stopped = why
        self.pending = []
        self.flusher.forget(self)

    def abandon(self) -> None:
        """End the attempt without waiting: nothing more is flushed (its turn was stopped)."""
        self.closed = True
        self.flusher.forget(self)

    async def close(self) -> None:
        """End the attempt (it failed): nothing more is written, once a flush in flight is done
        (the next attempt's 'restart' must come after it)."""
        self.abandon()
        if self._inflight is not None:
            await asyncio.shield(self._inflight)

    async def tail(self) -> StreamTail:
        """End the attempt: what its commit writes to the stream (the text not flushed yet, before
        the ``end`` entry), once a flush in flight is done (the commit's entries come after it)."""
        await self.close()
        if self.stopped:  # (a lost lane fences the commit too; a key of the wrong type fails it)
            return StreamTail(self.attempt, "", self.restart)
        return StreamTail(self.attempt, "".join(self.pending), self.restart)
