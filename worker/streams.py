"""Streamed replies on the worker's side: what a handler emits, on its way to the turn's reply stream.

A streamed turn (``Turn.stream``) gets a :class:`StreamWriter` per attempt; the handler's
``ctx.emit`` (or the chunks an async generator handler yields) lands in its buffer. The worker's
:class:`StreamFlusher` ticks every ``flush_s`` (``FLEET_WORKER_STREAM_FLUSH_MS``) while some
buffer holds text and sends the buffers that are due, all in one loop pass, so on one node they
ride one round trip (``stores.batch``). A turn's first flush is due at the first tick (the first
words show at once); each next one waits twice as long as the one before, up to ``max_s``
(``FLEET_WORKER_STREAM_FLUSH_MAX_MS``): every flush costs Redis a script call and its reader a
read, so a long reply settles at a few flushes a second. A flush is fenced
(``stream_append.lua``): a worker that lost the lane writes nothing. What is still buffered when
the handler returns goes into the turn's commit itself (:meth:`StreamWriter.tail`), with the
``end`` entry and the reply: a turn shorter than one flush interval costs no extra round trip.

The reader's contract (docs/guide/protocol.md): an attempt after the first starts with a
``restart`` entry, and so does a resend of an attempt's whole text after a flush whose outcome
is unknown (a connection lost with it in flight): the reader drops what it holds and reads on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading

from stores.turns import Flush, Lease, StreamTail, UserStore

log = logging.getLogger("fleet.worker")


class StreamFlusher:
    """One timer for every streamed turn of a worker: every ``flush_s``, while some buffer holds
    text, each one that is due is flushed, in the same loop pass."""

    def __init__(self, store: UserStore, flush_s: float, max_s: float | None = None) -> None:
        self.store = store
        self.flush_s = flush_s
        self.max_s = max(flush_s, max_s if max_s is not None else flush_s)  # the longest wait between flushes
        self._due: set[StreamWriter] = set()
        self._timer: asyncio.TimerHandle | None = None

    def writer(self, lease: Lease, turn_id: str, attempt: int, max_bytes: int,
               restart: bool) -> StreamWriter:
        """A new writer for one attempt of a streamed turn (made on the worker's loop); with
        ``restart``, its first write starts with a 'restart' entry (text of an earlier run may be
        in the stream)."""
        return StreamWriter(self, lease, turn_id, attempt, max_bytes, restart)

    def due(self, writer: StreamWriter) -> None:
        self._due.add(writer)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_s, self._tick)

    def forget(self, writer: StreamWriter) -> None:
        self._due.discard(writer)

    def _tick(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time() + self.flush_s / 2  # (a tick may come a little early)
        due, self._due = self._due, set()
        batch: list[tuple[StreamWriter, Flush]] = []
        for writer in due:
            if writer.next_at > now:
                self.due(writer)
            elif (flush := writer.take()) is not None:
                batch.append((writer, flush))
        if batch:
            sent = asyncio.ensure_future(self._send(batch))
            for writer, _ in batch:
                writer.inflight = sent

    async def _send(self, batch: list[tuple[StreamWriter, Flush]]) -> None:
        """The tick's flushes, in one call (``UserStore.append_streams``); each writer told its own."""
        try:
            got = await self.store.append_streams([flush for _, flush in batch])
        except Exception as exc:  # noqa: BLE001 - written or not, unknown: each is sent again
            got = [exc] * len(batch)
        for (writer, flush), res in zip(batch, got, strict=True):
            writer.sent(flush, res)


class StreamWriter:
    """One attempt's streamed text: buffered, flushed by the :class:`StreamFlusher`, the rest
    handed to the commit by :meth:`tail`. ``emit`` is safe from any thread."""

    def __init__(self, flusher: StreamFlusher, lease: Lease, turn_id: str, attempt: int,
                 max_bytes: int, restart: bool) -> None:
        self.flusher, self.lease, self.turn_id = flusher, lease, turn_id
        self.attempt = attempt
        self.max_bytes = max_bytes  # the attempt's text beyond this is not streamed (the reply's limit)
        self.restart = restart  # the attempt's first write starts with 'restart'
        self.pending: list[str] = []  # emitted, not sent yet
        self.sent_text: list[str] = []  # written since the last 'restart' (or the stream's start)
        self.size = 0
        self.closed = False  # the attempt is over: nothing more is flushed
        self.stopped = ""  # why flushes stopped ('fenced', 'done', 'wrongtype', 'too long')
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self.inflight: asyncio.Future[None] | None = None  # the flush of its text on its way
        self.next_at = 0.0  # (loop time) no flush before this
        self._wait = flusher.flush_s  # after the next flush, the next one waits this long

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
        if self.inflight is None:
            self.flusher.due(self)

    def take(self) -> Flush | None:
        """What to send now (the flusher's tick), if anything: the text buffered since the last flush."""
        if self.closed or self.stopped or not self.pending or self.inflight is not None:
            return None
        flush = Flush(self.lease, self.turn_id, self.attempt, "".join(self.pending), self.restart)
        self.pending = []
        self._wait = wait = min(2 * self._wait, self.flusher.max_s)
        # the next multiple of the wait, at least half a wait away: every stream at the same
        # wait flushes in the same ticks (one round trip; one wake-up of the readers)
        now = self._loop.time()
        self.next_at = math.ceil((now + wait / 2) / wait) * wait if wait > 0 else now
        return flush

    def sent(self, flush: Flush, res: str | Exception) -> None:
        """The outcome of ``flush``: written, refused (the stream stops), or unknown (an error:
        its text and what was written before it are sent again after a restart)."""
        self.inflight = None
        if isinstance(res, Exception):
            log.warning("a flush of turn %s's stream failed (%s: %s); its text is sent again after a restart",
                        self.turn_id, type(res).__name__, str(res)[:200])
            self.pending = [*self.sent_text, flush.text, *self.pending]
            self.sent_text, self.restart = [], True
        elif res == "ok":
            self.sent_text.append(flush.text)
            self.restart = False
        else:
            self._stop(res)
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
        if self.inflight is not None:
            await asyncio.shield(self.inflight)

    async def tail(self) -> StreamTail:
        """End the attempt: what its commit writes to the stream (the text not flushed yet, before
        the ``end`` entry), once a flush in flight is done (the commit's entries come after it)."""
        await self.close()
        if self.stopped:  # (a lost lane fences the commit too; a key of the wrong type fails it)
            return StreamTail(self.attempt, "", self.restart)
        return StreamTail(self.attempt, "".join(self.pending), self.restart)
