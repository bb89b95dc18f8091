"""The handler registry: a policy names a handler, and may only pick a registered name.

A handler receives a ``TurnContext`` and returns a ``HandlerResult`` (or a plain string),
directly or as an awaitable; or it is an async generator of text chunks, each streamed as it
comes (``ctx.emit``), whose reply is their concatenation. Sync handlers run in a thread so
they never stall the worker's lease renewals. Third-party handlers register through the
``fleet.handlers`` entry-point group (``name = "package.module:function"``), installed code
only: nothing in Redis can name an import path.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from protocol.codec import encode
from protocol.deferral import MAX_DEFERRAL_BYTES, MAX_DEFERRALS, Deferral
from protocol.models import HandlerResult, Turn
from protocol.policy import KnownHandlers
from stores.turns import ContextPack
from worker import jobs

Handler = Callable[["TurnContext"],
                   "HandlerResult | str | Awaitable[HandlerResult | str] | AsyncIterator[str]"]
_REGISTRY: dict[str, Handler] = {}
_UNAVAILABLE: dict[str, str] = {}  # entry points that failed to load: name -> the error
_NOT_INSTALLED: dict[str, str] = {}  # optional handlers whose extra is missing: name -> what to install
log = logging.getLogger("fleet.worker")


class HandlerError(Exception):
    """Raised by a handler to fail a turn with a message fit for the user."""


class NotInstalled(ImportError):
    """Raised at import by an optional handler's module whose extra is not installed (e.g.
    ``openai_chat`` without ``fleet[openai]``): the handler is listed as not installed, with the
    message, and not warned about as a broken one."""


@dataclass(frozen=True)
class TurnContext:
    """What a handler gets: the turn, the user's context pack, the tier's handler options."""

    turn: Turn
    pack: ContextPack
    options: dict[str, Any] = field(default_factory=dict)
    worker: str = ""
    attempt: int = 1
    lease: str = ""  # "<worker>|<fencing token>" of the lane the turn runs under
    protector: Callable[[float], float] | None = None  # the worker's, behind ``protect``
    # what ``defer`` asked for in this attempt, encoded: committed with the turn's reply
    deferred: list[tuple[str, bytes]] = field(default_factory=list)
    deadline: float | None = None  # unix seconds after which nobody waits for the reply (None: no limit)
    # the worker's transport of streamed text (None: emitted text is only kept in ``emitted``)
    emitter: Callable[[str], None] | None = None
    emitted: list[str] = field(default_factory=list)  # the text emitted in this attempt, in order
    cancel_flag: threading.Event = field(default_factory=threading.Event)  # set once the turn is cancelled

    def defer(self, name: str, *args: Any, queue: str | None = None, delay: float | None = None,
              **kwargs: Any) -> str:
        """Ask for background job ``name`` (registered in ``worker.jobs``) with plain-data
        arguments, on ``queue`` (else the job's own) after ``delay`` seconds. It is written in
        the same atomic commit as the turn's reply (nothing if the turn fails or was answered
        before) and reaches RQ exactly once, under the job id returned. Raises ValueError or
        KeyError on a bad deferral: the turn fails like any handler error."""
        spec = jobs.get(name)
        if len(self.deferred) >= MAX_DEFERRALS:
            raise ValueError(f"a turn may defer at most {MAX_DEFERRALS} jobs")
        d = Deferral(name=name, args=list(args), kwargs=kwargs, queue=queue or spec.queue,
                     delay_s=delay or 0.0, user=self.turn.user, turn_id=self.turn.turn_id,
                     index=len(self.deferred), retry_max=spec.retry_max,
                     retry_interval_s=spec.retry_interval_s, ts=time.time())
        payload = encode(d)
        if len(payload) > MAX_DEFERRAL_BYTES:
            raise ValueError(f"deferral {name!r} is {len(payload)} bytes, over {MAX_DEFERRAL_BYTES}")
        self.deferred.append((d.job_id, payload))
        return d.job_id

    def emit(self, text: str) -> None:
        """Stream ``text`` to the turn's readers now, ahead of the reply (which the handler still
        returns). Safe from a sync handler's thread."""
        if text:
            self.emitted.append(text)
            if self.emitter is not None:
                self.emitter(text)

    @property
    def cancelled(self) -> bool:
        """The turn was cancelled (stopped by its user): a sync handler should return soon; an
        async one is cancelled outright (``asyncio.CancelledError`` inside it)."""
        return self.cancel_flag.is_set()

    def protect(self, seconds: float) -> float:
        """Ask that this worker not be retired by scale-in for ``seconds`` (capped by the policy's
        ``max_protection_s``), e.g. while it does something long that outlives the turn; 0
        releases it. Returns the unix time the protection holds until (0 when none). A drain
        asked for by an operator (or SIGTERM) is still obeyed. Safe from a sync handler's thread."""
        return self.protector(seconds) if self.protector is not None else 0.0

    def option(self, name: str, default: Any) -> Any:
        """A per-turn override in ``turn.meta``, else the tier's ``handler_options``, else default."""
        return self.turn.meta.get(name, self.options.get(name, default))


def register(name: str) -> Callable[[Handler], Handler]:
    """Decorator: make ``fn`` available to policies as ``name``."""

    def deco(fn: Handler) -> Handler:
        _REGISTRY[name] = fn
        return fn

    return deco


@cache
def _load_entry_points() -> None:
    """Import each ``fleet.handlers`` entry point on its own: one that fails to import (or to
    resolve) makes that handler unavailable, with its error, and never stops the others."""
    for ep in entry_points(group="fleet.handlers"):
        if ep.name in _REGISTRY:
            continue
        try:
            _REGISTRY[ep.name] = ep.load()
        except NotInstalled as exc:
            _NOT_INSTALLED[ep.name] = " ".join(str(exc).split())[:300]
        except Exception as exc:  # noqa: BLE001 - any failure of third-party code at import
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]} (entry point {ep.value})"
            _UNAVAILABLE[ep.name] = error
        else:
            _UNAVAILABLE.pop(ep.name, None)
            _NOT_INSTALLED.pop(ep.name, None)


def rescan() -> list[str]:
    """Look for ``fleet.handlers`` entry points again: a package installed (or repaired) since
    this process started (``pip install`` into the fleet's environment) becomes usable without
    a restart. Handlers already loaded stay as they are."""
    importlib.invalidate_caches()
    _load_entry_points.cache_clear()
    return registered_names()


def registered_names() -> list[str]:
    """Every handler name a policy may use."""
    _load_entry_points()
    return sorted(_REGISTRY)


def unavailable() -> dict[str, str]:
    """The handlers whose entry point failed to load here: name -> the error (one line)."""
    _load_entry_points()
    return {name: error for name, error in sorted(_UNAVAILABLE.items()) if name not in _REGISTRY}


def not_installed() -> dict[str, str]:
    """The optional handlers whose extra is not installed here: name -> what to install."""
    _load_entry_points()
    return {name: why for name, why in sorted(_NOT_INSTALLED.items()) if name not in _REGISTRY}


def known() -> KnownHandlers:
    """The handlers a policy may name here, and why each other one is not (policy checks)."""
    return KnownHandlers(registered_names(), unavailable(), not_installed())


def get(name: str) -> Handler:
    """The handler registered as ``name`` (KeyError if none)."""
    _load_entry_points()
    return _REGISTRY[name]


async def call(handler: Handler, ctx: TurnContext, timeout_s: float,
               executor: Executor | None = None) -> HandlerResult:
    """Run a sync or async handler with a timeout and normalise its result.

    A sync handler runs on ``executor`` (the worker's own pool, as large as its
    concurrency), and its timeout counts from the moment a thread starts it, not from
    when it was queued for one. An async generator's chunks are emitted as they come, and its
    reply is the text it emitted (all of it, ``ctx.emitted``).
    """
    if inspect.isasyncgenfunction(handler):
        async with asyncio.timeout(timeout_s):
            await _stream(handler(ctx), ctx)
        return HandlerResult(text="".join(ctx.emitted))
    if inspect.iscoroutinefunction(handler):
        async with asyncio.timeout(timeout_s):  # in the caller's task: no task of its own a turn
            result = await handler(ctx)
    else:
        result = await _in_thread(handler, ctx, timeout_s, executor)
        if inspect.isawaitable(result):
            result = await asyncio.wait_for(result, timeout_s)
    if isinstance(result, str):
        return HandlerResult(text=result)
    if not isinstance(result, HandlerResult):
        raise HandlerError(f"handler returned {type(result).__name__}, not HandlerResult or str")
    return result


async def _stream(chunks: AsyncIterator[str], ctx: TurnContext) -> None:
    """Emit each chunk of an async generator handler as it comes."""
    async for chunk in chunks:
        if not isinstance(chunk, str):
            raise HandlerError(f"handler yielded {type(chunk).__name__}, not str")
        ctx.emit(chunk)


async def _in_thread(handler: Handler, ctx: TurnContext, timeout_s: float, executor: Executor | None) -> Any:
    """A sync handler in a thread. A thread cannot be stopped: when the handler times out or
    its turn is abandoned (the lane was lost), this returns only once the thread has ended,
    so a retry of the turn never runs beside it on this worker."""
    loop = asyncio.get_running_loop()
    started = loop.create_future()
    abandoned = threading.Event()

    def run() -> Any:
        if abandoned.is_set():  # given up while it waited for a thread: never start it
            return None
        loop.call_soon_threadsafe(_set_once, started)
        return handler(ctx)

    done = loop.run_in_executor(executor, run)
    try:
        await asyncio.shield(started)
        return await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        abandoned.set()
        if started.done():
            log.warning("sync handler of turn %s stopped being awaited; waiting for its thread to end",
                        ctx.turn.turn_id)
            with contextlib.suppress(Exception):
                await asyncio.shield(done)
        raise


def _set_once(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# --- built-in handlers --------------------------------------------------------------------


@register("echo")
async def echo(ctx: TurnContext) -> HandlerResult:
    """The user's text back, with what the context pack holds (see ``_echo``)."""
    return await _echo(ctx)


async def _echo(ctx: TurnContext) -> HandlerResult:
    """Echo the text and show the context: the previous turn, the top memory, the profile."""
    text = ctx.turn.text
    parts = [f"echo: {text}"]
    if ctx.pack.session:
        parts.append(f"previous: {ctx.pack.session[-1].text}")
    if ctx.pack.memories:
        parts.append(f"memory: {ctx.pack.memories[0].text}")
    if "name" in ctx.pack.profile:
        parts.append(f"hello {ctx.pack.profile['name']}")
    importance = min(1.0, max(0.01, float(ctx.option("importance", 0.5))))
    return HandlerResult(
        text=" | ".join(parts),
        memories=[(f"said: {text[:200]}", importance)],
        profile={"last_text": text[:200]},
    )


@register("echo_stream")
async def echo_stream(ctx: TurnContext) -> AsyncIterator[str]:
    """The user's text back, streamed word by word (each word after the first with the space
    before it), handler option ``delay_ms`` (default 20) between words: for demos and tests.
    ``fail_attempts`` = N makes the first N attempts fail once they have streamed the text (a
    retry restarts the stream); ``stamp`` appends to each word the unix time it was emitted
    (``word@1765000000.123456``: ``scripts/bench_stream`` measures emit -> client with it)."""
    delay_s = float(ctx.option("delay_ms", 20)) / 1000
    stamp = bool(ctx.option("stamp", False))
    for i, word in enumerate(ctx.turn.text.split(" ")):
        if i:
            await asyncio.sleep(delay_s)
        text = f"{word}@{time.time():.6f}" if stamp else word
        yield text if i == 0 else f" {text}"
    if ctx.attempt <= int(ctx.option("fail_attempts", 0)):
        raise HandlerError(f"injected failure on attempt {ctx.attempt}, after its text")


@register("noop")
async def noop(ctx: TurnContext) -> HandlerResult:
    """No model call: an empty reply that still writes what a typical turn writes.

    One memory and one profile field, so the commit is a full write-back (session, memory,
    profile, usage, reply): the benchmarks measure the pipeline around the model, not the model.
    """
    return HandlerResult(text="", memories=[(ctx.turn.text[:200], 0.5)],
                         profile={"last_text": ctx.turn.text[:200]})


@register("sleep")
async def sleep(ctx: TurnContext) -> HandlerResult:
    """A stand-in model call: ``sleep_ms`` of waiting and ``cpu_ms`` of CPU burn.

    ``fail_attempts`` = N makes the first N attempts of a turn raise (to test retries and
    the dead-letter path); ``block_loop_ms`` blocks the worker's event loop that long first (a
    blocking call in an async handler: the worker's watchdog ends a loop stuck past
    ``stuck_after_s``). Like a model call bounded by the turn's deadline (``ctx.deadline``),
    a sleep that would end after it fails at it instead (the turn is then answered ``expired``).
    """
    if ctx.attempt <= int(ctx.option("fail_attempts", 0)):
        raise HandlerError(f"injected failure on attempt {ctx.attempt}")
    time.sleep(float(ctx.option("block_loop_ms", 0.0)) / 1000)
    await _burn(float(ctx.option("cpu_ms", 0.0)) / 1000)
    wait = float(ctx.option("sleep_ms", 100.0)) / 1000
    if ctx.deadline is not None and time.time() + wait > ctx.deadline:
        await asyncio.sleep(max(0.0, ctx.deadline - time.time()))
        raise HandlerError("the sleep ran into the turn's deadline")
    await asyncio.sleep(wait)
    return HandlerResult(text=f"slept: {ctx.turn.text}")


async def _burn(seconds: float) -> None:
    # burn in 5 ms slices, yielding between them so lease renewals and reports go on
    end = time.process_time() + seconds
    while time.process_time() < end:
        stop = min(end, time.process_time() + 0.005)
        while time.process_time() < stop:
            pass
        await asyncio.sleep(0)


@register("echo_defer")
async def echo_defer(ctx: TurnContext) -> HandlerResult:
    """``echo``, and defers one background job per turn: handler option ``job``
    (default ``memory_summary``; ``count`` adds 1 to the user's usage ``jobs_run``, after
    option ``job_sleep_s`` seconds), on option ``queue`` if set. The deferral is committed with
    the reply, so it exists once per turn."""
    result = await _echo(ctx)
    name = str(ctx.option("job", "memory_summary"))
    queue = ctx.option("queue", None)
    sleep_s = float(ctx.option("job_sleep_s", 0.0))
    ctx.defer(name, queue=str(queue) if queue else None, **({"sleep_s": sleep_s} if sleep_s > 0 else {}))
    return result
