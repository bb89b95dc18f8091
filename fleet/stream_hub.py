"""One blocking ``XREAD`` for every reply stream an ``AsyncFleet`` reads at once.

A web front end streams many turns through one client. Read each on its own and every flush a
worker writes costs Redis a wake-up and a round trip per stream, and every stream holds a
connection of the pool while it blocks. The hub reads them all with one ``XREAD BLOCK`` over
every stream's key (on one node: a Cluster refuses a multi-key read across slots, and there
each stream reads on its own), so a worker's flush of twenty turns wakes one reader, not twenty.

A stream joins at once but is *covered* only once the hub has sent a read that holds its key:
until then (the hub is blocked in a read sent before it joined, for at most ``HUB_BLOCK_MS``)
the stream reads on its own, as it would without the hub. A read that fails uncovers every
stream it held: they read on their own until the hub's next read, after a backoff. Entries are
handed over by id: what a stream's own read already took is not handed to it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from stores.replies import Row, entry_id
from stores.retry import TRANSIENT, Backoff
from stores.submit import read_streams

log = logging.getLogger("fleet.client")

# the hub's read blocks at most this long, then reads again with the streams that joined
# meanwhile (they read on their own until then): a read that times out costs Redis far less
# than a stream read on its own for longer
HUB_BLOCK_MS = 100
_BACKOFF = Backoff(base=0.05, cap=1.0)


@dataclass(eq=False)
class Subscription:
    """One stream read through the hub: ``after`` is the last entry its reader took (the hub
    reads from there and hands over only what is newer)."""

    after: str
    covered: bool = False  # a read holding this stream is out: its reader may wait for the hub
    rows: list[Row] = field(default_factory=list)  # read by the hub, not taken yet
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    async def take(self, timeout: float) -> list[Row]:
        """The rows the hub read for this stream, waiting up to ``timeout`` s for some while it
        is covered (a read failing uncovers it, and wakes it)."""
        if not self.rows and self.covered:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout)
        self.wake.clear()
        got, self.rows = self.rows, []
        return got

    def read_to(self, after: str) -> None:
        """The stream's reader took the entries up to ``after`` on its own: the hub reads on from
        there, and drops what it holds of them."""
        if entry_id(after) > entry_id(self.after):
            self.after = after
        self.rows = [row for row in self.rows if entry_id(row[0]) > entry_id(after)]


class StreamHub:
    """The streams an ``AsyncFleet`` reads, by key, and the task that reads them all."""

    def __init__(self, r: Any) -> None:
        self.r = r
        self.subs: dict[str, Subscription] = {}
        self._task: asyncio.Task[None] | None = None
        self.reads = 0  # the hub's reads so far (tests, benchmarks)
        self.failures = 0  # ... and those that failed

    def join(self, key: str, after: str) -> Subscription:
        sub = self.subs[key] = Subscription(after)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="fleet-stream-hub")
        return sub

    def leave(self, key: str) -> None:
        self.subs.pop(key, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        failures = 0
        while self.subs:
            held = dict(self.subs)
            for sub in held.values():
                sub.covered = True
            try:
                self.reads += 1
                got = await read_streams(self.r, {key: sub.after for key, sub in held.items()}, HUB_BLOCK_MS)
            except TRANSIENT as exc:
                failures += 1
                self.failures += 1
                log.warning("reading %d reply streams failed (%s: %s); each reads on its own for now",
                            len(held), type(exc).__name__, exc)
                for sub in held.values():
                    sub.covered = False
                    sub.wake.set()
                await asyncio.sleep(_BACKOFF.compute(failures))
                continue
            failures = 0
            for key, entries in got.items():
                reader = self.subs.get(key)
                if reader is None:  # (it left meanwhile)
                    continue
                new = [row for row in entries if entry_id(row[0]) > entry_id(reader.after)]
                if new:
                    reader.rows += new
                    reader.after = new[-1][0]
                    reader.wake.set()
