"""Redis connections with capped, jittered reconnects (redis-py's own Retry machinery).

Every process builds its client from a URL (explicit, else ``REDIS_URL``, else the local
``fleet up`` one). Credentials and TLS ride in that URL, which redis-py parses itself:
``redis://user:password@host:port/0`` for an ACL user, and
``rediss://user:password@host:port/0?ssl_ca_certs=/path/ca.pem`` for TLS (also
``ssl_certfile``, ``ssl_keyfile`` for a client certificate, ``ssl_cert_reqs``). See SECURITY.md.
"""

from __future__ import annotations

import os
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

DEFAULT_URL = "redis://127.0.0.1:6379/0"
RETRY_ERRORS = [RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionResetError]


def resolve_url(url: str | None = None) -> str:
    """The Redis URL to use: explicit, else ``REDIS_URL``, else the local ``fleet up`` one."""
    if url:
        return url
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    from fleet.local import recorded_url  # late: fleet/ depends on stores/, not the reverse

    return recorded_url() or DEFAULT_URL


class _Retry(Retry):
    """Retries connection errors, but not refused credentials: a wrong password stays wrong.

    (``AuthenticationError`` is a ``ConnectionError`` to redis-py, so without this a CLI with
    a bad password would spend seconds backing off before it says so.)
    """

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                        with_failure_count: bool = False) -> Any:
        def retryable(error: Exception) -> bool:
            if isinstance(error, AuthenticationError):
                return False
            return is_retryable is None or bool(is_retryable(error))

        return super().call_with_retry(do, fail, retryable, with_failure_count)


class _AsyncRetry(AsyncRetry):
    """The asyncio twin of ``_Retry`` (redis-py's asyncio client needs its own Retry class:
    given the blocking one it silently never retries)."""

    async def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                              with_failure_count: bool = False) -> Any:
        def retryable(error: Exception) -> bool:
            if isinstance(error, AuthenticationError):
                return False
            return is_retryable is None or bool(is_retryable(error))

        return await super().call_with_retry(do, fail, retryable, with_failure_count)


def _backoff() -> ExponentialWithJitterBackoff:
    # 50 ms doubling to 2 s, full jitter: a restart of Redis is ridden out in a few seconds
    return ExponentialWithJitterBackoff(cap=2.0, base=0.05)


def _retry(retries: int) -> Retry:
    return _Retry(_backoff(), retries)


def async_retry_options(retries: int = 8) -> dict[str, Any]:
    """How every asyncio client rides out a lost connection: capped, jittered retries of
    connection errors; refused credentials are final. (The simulator's clients use it too.)"""
    return {"retry": _AsyncRetry(_backoff(), retries), "retry_on_error": RETRY_ERRORS}


def connect_async(url: str | None = None, *, retries: int = 8, max_connections: int = 10_000,
                  socket_timeout: float | None = None, **kwargs: object) -> aioredis.Redis:
    """An asyncio client that retries connection errors with capped, jittered backoff.

    Every concurrent blocking call (BLPOP of a waiting reply, XREADGROUP) holds a connection,
    so the pool's cap is set far above redis-py's default of 100. ``socket_timeout`` is None by
    default (redis-py's is 5 s), or a ``BLPOP`` for a reply would fail after 5 s whatever its
    own timeout; a process that must not hang on a paused Redis passes its own.
    """
    return aioredis.Redis.from_url(
        resolve_url(url),
        max_connections=max_connections,
        socket_timeout=socket_timeout,
        **async_retry_options(retries),
        health_check_interval=15,
        socket_connect_timeout=5,
        socket_keepalive=True,
        **kwargs,
    )


def connect_sync(url: str | None = None, *, retries: int = 8, socket_timeout: float | None = None,
                 **kwargs: object) -> redis.Redis:
    """A blocking client with the same retry behaviour (CLI, supervisor)."""
    return redis.Redis.from_url(
        resolve_url(url),
        socket_timeout=socket_timeout,
        retry=_retry(retries),
        retry_on_error=RETRY_ERRORS,
        socket_connect_timeout=5,
        socket_keepalive=True,
        **kwargs,
    )
