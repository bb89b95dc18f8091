"""Group commit: the script calls a worker's jobs make at the same moment go out together.

Jobs of different users that are ready at the same moment (a batch of notifications read at
once, or the replies of one round trip waking several jobs) each call a script: a lane
acquire, a turn commit, an ack. Sent one by one, each costs a round trip and a pass through
redis-py. :class:`ScriptBatcher` queues the calls made in one pass of the event loop and sends
them as one pipeline (``FCALL`` each, on one connection, one round trip), at the end of that
pass: a call made alone waits for nothing but the rest of the pass it was made in, so latency
at low load does not grow. A pipeline holds at most ``max_batch`` calls; more wait for the next.

Calls of one script on the same keys whose arguments only append ids (the acks of one ready
shard: ``notification_ack.lua``) are merged into one call.

Each call is the script's own atomic step, as if sent alone; a pipeline is no transaction. A
call whose caller was cancelled before the pipeline left is not sent. A connection error fails
every call of its pipeline (redis-py retries the pipeline first, as it retries one command).
Calls that found no function (no library, or another version's: nothing ran) wait for the
library (``stores.functions``) and are sent again.

On a Cluster the pipeline is redis-py's cluster pipeline: it sends each call to the master of
its first key's slot, the calls for one master together (one round trip per master a pass
reaches), and follows a ``MOVED`` as it does for one command. The scripts' keys are each in one
slot (a user's, or a ready shard's), so every call runs whole on one master.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from stores import functions

MAX_BATCH = 128  # script calls in one pipeline


@dataclass
class _Call:
    script: functions.Function
    keys: list[str]
    args: list[Any]
    futures: list[asyncio.Future[Any]]
    merge_from: int | None = None  # args from here on are ids that merge with another call's


@dataclass
class BatchStats:
    """How many calls went out per round trip (the group commit's reach)."""

    pipelines: int = 0
    calls: int = 0  # script calls sent (merged ones count once)
    requests: int = 0  # calls made by jobs (merged ones each)
    sizes: dict[int, int] = field(default_factory=dict)  # calls in a pipeline -> pipelines

    def summary(self) -> str:
        """One line: how many calls each round trip carried."""
        if not self.pipelines:
            return "group commit: no script calls batched"
        top = max(self.sizes)
        return (f"group commit: {self.pipelines} round trips carried {self.calls} script calls "
                f"({self.requests} jobs' calls, acks merged): mean {self.calls / self.pipelines:.2f} "
                f"per round trip, max {top}; calls per round trip -> round trips: "
                f"{dict(sorted(self.sizes.items()))}")

    def note(self, size: int, requests: int) -> None:
        self.pipelines += 1
        self.calls += size
        self.requests += requests
        self.sizes[size] = self.sizes.get(size, 0) + 1


class ScriptBatcher:
    """Script calls of one event-loop pass, sent as one pipeline (see the module docstring)."""

    def __init__(self, r: aioredis.Redis, max_batch: int = MAX_BATCH) -> None:
        self.r = r
        self.max_batch = max_batch
        self.stats = BatchStats()
        self._queue: list[_Call] = []
        self._scheduled = False
        self._sending: set[asyncio.Task[None]] = set()

    def call(self, script: functions.Function, keys: list[str], args: list[Any],
             merge_from: int | None = None) -> asyncio.Future[Any]:
        """Queue one script call; the future gets its reply (or its error)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if merge_from is not None:
            for queued in self._queue:
                if (queued.merge_from == merge_from and queued.script is script and queued.keys == keys
                        and queued.args[:merge_from] == args[:merge_from]):
                    queued.args += args[merge_from:]
                    queued.futures.append(fut)
                    return fut
        self._queue.append(_Call(script, keys, list(args), [fut], merge_from))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._scheduled = False
        live = [c for c in self._queue if not all(f.done() for f in c.futures)]  # cancelled: not sent
        self._queue = []
        while live:
            batch, live = live[: self.max_batch], live[self.max_batch:]
            task = asyncio.ensure_future(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[_Call]) -> None:
        self.stats.note(len(batch), sum(len(c.futures) for c in batch))
        try:
            replies = await self._replies(batch)
        except BaseException as exc:  # noqa: BLE001 - every caller gets the error of its pipeline
            for c in batch:
                for f in c.futures:
                    if not f.done():
                        f.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            if not isinstance(exc, Exception):
                raise
            return
        for c, res in zip(batch, replies, strict=True):
            for f in c.futures:
                if f.done():
                    continue
                if isinstance(res, Exception):
                    f.set_exception(res)
                else:
                    f.set_result(res)

    async def _replies(self, batch: list[_Call]) -> list[Any]:
        """One pipeline's replies; the calls that found no function are sent again once the
        library is there."""
        return await functions.resend_missing(await self._pipeline(batch), self.r,
                                              lambda missing: self._pipeline([batch[i] for i in missing]))

    async def _pipeline(self, batch: list[_Call]) -> list[Any]:
        async with self.r.pipeline(transaction=False) as pipe:
            for c in batch:
                c.script(c.keys, c.args, client=pipe)
            return list(await pipe.execute(raise_on_error=False))
