"""The job registry: what ``ctx.defer`` may name and what Fleet's RQ workers may run.

A job is a function registered under a name in code (``@job("name", queue=...)`` or the
``fleet.jobs`` entry-point group, installed code only). A deferral carries the name and plain
arguments; the RQ job the relay enqueues always calls :func:`run` (``worker.jobs.run``), which
looks the name up here: nothing in Redis can name an import path (``worker.rq.rq_worker`` refuses
a job whose function is anything else).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import Any

import redis

from protocol.deferral import JOB_ENTRY, Deferral, validate_job_name, validate_queue
from stores import jobctx
from stores.turns import ContextPack

log = logging.getLogger("fleet.jobs")
ENTRY = JOB_ENTRY  # the one function an RQ job of Fleet's may name: this module's run
DEFAULT_QUEUE = "default"


@dataclass(frozen=True)
class JobContext:
    """What a job function gets besides its arguments: who and what deferred it, and a way to
    the user's context (pulled when asked, like a turn's pack)."""

    deferral: Deferral
    job_id: str
    r: redis.Redis
    attempt: int = 1

    @property
    def user(self) -> str:
        return self.deferral.user

    def pack(self, session_turns: int = 20, memories: int = 5) -> ContextPack:
        """The user's context pack, read now in one round trip (session, profile, memories)."""
        return jobctx.pull(self.r, self.user, session_turns, memories)


JobFn = Callable[..., Any]


@dataclass(frozen=True)
class JobSpec:
    """A registered job: its function, the queue it goes to unless the deferral names one, and
    RQ's retries (``Retry(max, interval)``) for a job that raises."""

    name: str
    fn: JobFn
    queue: str = DEFAULT_QUEUE
    retry_max: int = 0
    retry_interval_s: list[int] = field(default_factory=list)


_REGISTRY: dict[str, JobSpec] = {}
_UNAVAILABLE: dict[str, str] = {}  # entry points that failed to load: name -> the error
_FLEET: list[redis.Redis] = []  # Fleet's own Redis when RQ has a node of its own (use_fleet_redis)


def use_fleet_redis(r: redis.Redis) -> None:
    """Give jobs Fleet's Redis (``JobContext.r``: the user's context and write-backs) when RQ's
    is another (``--rq-url``, ``$FLEET_RQ_URL``; Fleet's may be a Cluster); else they use RQ's."""
    _FLEET[:] = [r]


def job(name: str, queue: str = DEFAULT_QUEUE, retry_max: int = 0,
        retry_interval_s: list[int] | None = None) -> Callable[[JobFn], JobFn]:
    """Decorator: make ``fn(jctx, *args, **kwargs)`` deferrable as ``name``."""
    validate_job_name(name)
    validate_queue(queue)
    if retry_max < 0 or any(i < 0 for i in retry_interval_s or []):
        raise ValueError("retries and their intervals must not be negative")

    def deco(fn: JobFn) -> JobFn:
        _REGISTRY[name] = JobSpec(name, fn, queue, retry_max, list(retry_interval_s or []))
        return fn

    return deco


@cache
def _load_entry_points() -> None:
    """Import each ``fleet.jobs`` entry point (``name = "pkg.module:function"``) on its own: a
    function decorated with :func:`job` registers itself with its options; a plain one is
    registered under the entry point's name with the defaults. One that fails to import (or
    names no valid job) makes that job unavailable, with its error, and never stops the others."""
    for ep in entry_points(group="fleet.jobs"):
        try:
            fn = ep.load()
            if ep.name not in _REGISTRY:
                _REGISTRY[validate_job_name(ep.name)] = JobSpec(ep.name, fn)
        except Exception as exc:  # noqa: BLE001 - any failure of third-party code at import
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]} (entry point {ep.value})"
            if _UNAVAILABLE.get(ep.name) != error:
                log.warning("job %r cannot be loaded: %s; it is unavailable here", ep.name, error)
            _UNAVAILABLE[ep.name] = error
        else:
            _UNAVAILABLE.pop(ep.name, None)


def names() -> list[str]:
    """Every job name a handler may defer."""
    _load_entry_points()
    return sorted(_REGISTRY)


def unavailable() -> dict[str, str]:
    """The jobs whose entry point failed to load here: name -> the error (one line)."""
    _load_entry_points()
    return {name: error for name, error in sorted(_UNAVAILABLE.items()) if name not in _REGISTRY}


def get(name: str) -> JobSpec:
    """The job registered as ``name`` (KeyError with the known names, or its load error, if none)."""
    _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        if name in _UNAVAILABLE:
            raise KeyError(f"job {name!r} could not be loaded: {_UNAVAILABLE[name]}") from None
        raise KeyError(f"no job registered as {name!r} (known: {', '.join(sorted(_REGISTRY)) or 'none'})") \
            from None


def run(payload: dict[str, Any]) -> Any:
    """The RQ job function of every deferral: validate it, look its name up, run it.

    Called by Fleet's RQ worker (``worker.rq.rq_worker``) with the deferral as the relay wrote it."""
    from rq import get_current_job  # the rq extra: only an RQ worker gets here

    deferral = Deferral.model_validate(payload)
    spec = get(deferral.name)
    current = get_current_job()
    if current is None:
        raise RuntimeError("worker.jobs.run called outside an RQ job")
    # the deferral's retries: its job's registration's, or its rq tier's policy's (the relay's)
    left = current.retries_left if current.retries_left is not None else deferral.retry_max
    attempt = 1 + deferral.retry_max - left
    jctx = JobContext(deferral, current.id, _FLEET[0] if _FLEET else current.connection, attempt)
    return spec.fn(jctx, *deferral.args, **deferral.kwargs)


# --- built-in jobs -----------------------------------------------------------------------------
@job("noop")
def _noop(jctx: JobContext, *args: Any, **kwargs: Any) -> None:
    """Does nothing (tests, benchmarks)."""


@job("count", queue="writeback", retry_max=2)
def _count(jctx: JobContext, counter: str = "jobs_run", by: int = 1, sleep_s: float = 0.0) -> int:
    """After ``sleep_s`` (a stand-in for slow work), add ``by`` to the user's usage ``counter``:
    no idempotency of its own, so a job run twice shows (the exactly-once tests read it)."""
    if sleep_s > 0:
        time.sleep(sleep_s)
    return jobctx.incr_usage(jctx.r, jctx.user, counter, by)


@job("fail_first", queue="writeback")
def _fail_first(jctx: JobContext, times: int = 1, counter: str = "fail_first_runs") -> int:
    """Count the run in the user's usage ``counter``, and raise for the first ``times`` runs
    (the failure path: RQ's failed registry, ``fleet jobs requeue``)."""
    runs = jobctx.incr_usage(jctx.r, jctx.user, counter, 1)
    if runs <= times:
        raise RuntimeError(f"fail_first: run {runs} of {jctx.job_id} fails on purpose (times={times})")
    return runs


@job("memory_summary", queue="writeback", retry_max=3, retry_interval_s=[1, 2, 5])
def _memory_summary(jctx: JobContext, turns: int = 5) -> str:
    """Summarise the user's last ``turns`` session entries into one memory (importance 0.5),
    and count the run in the user's usage ``summaries``."""
    pack = jctx.pack(session_turns=turns, memories=0)
    texts = [f"{e.text} -> {e.reply}" for e in pack.session]
    summary = f"summary of {len(texts)} turns: " + " | ".join(t[:40] for t in texts)
    jobctx.add_memory(jctx.r, jctx.user, summary[:500], 0.5, count="summaries")
    return summary
