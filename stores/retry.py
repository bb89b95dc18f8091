"""One way to retry: capped, jittered exponential waits, on tenacity.

tenacity is well kept and composes what a retry is made of (the wait, with its jitter and cap;
the stop conditions; which errors are retried; what is logged before a sleep), so each loop
states its policy instead of re-deriving it. Two pieces:

- ``Backoff``: the wait after the n-th failure in a row, tenacity's ``wait_random_exponential``
  ("full jitter": uniform in ``[0, min(cap, base * 2**n)]``). It is a redis-py backoff as well
  (``compute``), so the connections' own retries (``stores.connection``) wait the same way. A
  loop that must never end, or that wakes early on its own stop signal, keeps its loop and asks
  ``compute`` for the wait.
- ``until_ok``: call an async function until it succeeds (tenacity's ``AsyncRetrying``), with
  a drain-like ``unless`` event that ends the retries.

Both draw from the global ``random`` (one draw per wait), which the simulator seeds; neither
reads the clock, and the sleeps are the event loop's, so they run on the simulator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from redis.backoff import AbstractBackoff
from redis.exceptions import RedisClusterException, RedisError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, stop_never
from tenacity.stop import stop_base
from tenacity.wait import wait_random_exponential

from stores.redis_errors import RedisErrors

# What every loop retries: Redis away, or the network, or a Redis Cluster between two
# topologies, or any error reply (BUSY, NOPERM, READONLY, LOADING, ...: stores.redis_errors).
# redis-py's cluster client raises ``RedisClusterException`` (not a ``RedisError``) when it
# finds no node for a slot or cannot reach any startup node, e.g. while a replica is promoted
# after its master died; MOVED/ASK/TRYAGAIN/CLUSTERDOWN that outlive its own few retries reach
# us as ``ResponseError``s (``RedisError``). All of them mend with a wait, or an operator's hand.
TRANSIENT: tuple[type[Exception], ...] = (RedisError, OSError, RedisClusterException)


class Backoff(AbstractBackoff):
    """Capped exponential backoff with full jitter: ``base`` doubling per failure, at most ``cap``."""

    def __init__(self, base: float, cap: float) -> None:
        self.base, self.cap = base, cap
        # tenacity waits multiplier * 2**(attempt - 1) after the attempt numbered ``attempt``
        # (from 1), the number of failures so far: twice the base makes it base * 2**failures
        self.wait = wait_random_exponential(multiplier=2 * base, max=cap)

    def compute(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row (1 = the first)."""
        return self.wait(_Failures(failures))  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"Backoff(base={self.base}, cap={self.cap})"


class _Failures:
    """The one thing a tenacity wait reads of a retry's state: the attempt number."""

    def __init__(self, failures: int) -> None:
        self.attempt_number = failures


class _event_set(stop_base):
    """Stop at the first failure once ``event`` is set."""

    def __init__(self, event: asyncio.Event) -> None:
        self.event = event

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.event.is_set()


async def until_ok(what: str, fn: Callable[[], Awaitable[None]], *, backoff: Backoff,
                   log: logging.Logger, attempts: int = 0, unless: asyncio.Event | None = None,
                   errors: RedisErrors | None = None) -> None:
    """Call ``fn`` until it succeeds, waiting ``backoff`` between tries; Redis, network and Cluster
    errors (``TRANSIENT``) are retried, any other error (and a cancellation) is raised. Give up
    after ``attempts`` failures (0: never), or at the first failure once ``unless`` is set; a
    wait ends early when ``unless`` is set (with ``asyncio.timeout``: never ``wait_for``, which
    can drop the cancellation that ends the wait, CPython gh-86296). Giving up is logged, not
    raised. With ``errors``, each failure is told to it (each kind logged once), and the success."""

    def before_sleep(state: RetryCallState) -> None:
        error = _error(state)
        if errors is not None and error is not None:
            errors.failed(what, error)
        else:
            log.warning("%s failed (%s); retrying", what, error)

    def gave_up(state: RetryCallState) -> None:
        if unless is not None and unless.is_set():
            log.info("%s failed (%s); not retried: stopping", what, _error(state))
        else:
            log.error("%s failed %d times, giving up: %s", what, state.attempt_number, _error(state))

    async def sleep(seconds: float) -> None:
        if unless is None:
            await asyncio.sleep(seconds)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await unless.wait()

    async def attempt() -> None:
        await fn()
        if errors is not None:
            errors.answered(what)

    stop: stop_base = stop_after_attempt(attempts) if attempts else stop_never
    if unless is not None:
        stop = stop | _event_set(unless)
    # a new AsyncRetrying per call: one keeps its state per thread, not per task
    await AsyncRetrying(sleep=sleep, stop=stop, wait=backoff.wait, retry=retry_if_exception_type(TRANSIENT),
                        before_sleep=before_sleep, retry_error_callback=gave_up)(attempt)


def _error(state: RetryCallState) -> BaseException | None:
    return state.outcome.exception() if state.outcome is not None else None
