"""Redis connections with capped, jittered reconnects (redis-py's own Retry machinery).

Every process builds its client from a URL (explicit, else ``REDIS_URL``, else the local
``fleet up`` one). Credentials and TLS ride in that URL, which redis-py parses itself:
``redis://user:password@host:port/0`` for an ACL user, and
``rediss://user:password@host:port/0?ssl_ca_certs=/path/ca.pem`` for TLS (also
``ssl_certfile``, ``ssl_keyfile`` for a client certificate, ``ssl_cert_reqs``). See SECURITY.md.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.exceptions import AuthenticationError, BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from stores import home
from stores.retry import Backoff

RETRY_ERRORS = [RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionResetError]
CONNECT_TIMEOUT_S = 5.0  # TCP connect, and the TLS handshake of a rediss:// URL


class NoFleetFound(RedisConnectionError):
    """No URL was given and no running ``fleet up`` was found: nothing to connect to.

    Fleet never falls back to ``127.0.0.1:6379``: a Redis there is usually not Fleet's.
    """


class HandshakeTimeout(RedisConnectionError):
    """A TCP connection was accepted but no TLS handshake came back: not a TLS port (final)."""


def resolve_url(url: str | None = None) -> str:
    """The Redis URL to use: explicit, else ``REDIS_URL``, else the local ``fleet up`` one.

    Raises ``NoFleetFound`` (with the places it looked) when there is none of them.
    """
    if url:
        return url
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    found = home.recorded_url()
    if found is None:
        raise NoFleetFound(f"no Redis to use: no --redis-url, no REDIS_URL, and {home.no_fleet_reason()}"
                           "; run `fleet up`, or set REDIS_URL")
    home.note_found_home()
    return found


def redact_url(url: str) -> str:
    """The URL without its credentials (``scheme://***@host…``), fit for logs, errors and
    ``fleet status``."""
    head, at, tail = url.rpartition("@")
    return f"{head.split('//')[0]}//***@{tail}" if at else url


class _SSLConnection(redis.SSLConnection):
    """redis-py's TLS connection, with its handshake bounded by the connect timeout.

    redis-py runs the handshake under ``socket_timeout``, which is None here (a BLPOP for a
    reply must not be cut short), so a ``rediss://`` URL naming a plain port waited forever
    for a server hello that never comes (the plain server waits for a newline).
    """

    def _wrap_socket_with_ssl(self, sock: socket.socket) -> Any:
        sock.settimeout(self.socket_connect_timeout)
        try:
            tls = super()._wrap_socket_with_ssl(sock)  # type: ignore[no-untyped-call]  # unannotated in redis-py
        except TimeoutError:
            raise HandshakeTimeout(
                f"no TLS handshake from {self.host}:{self.port} within {self.socket_connect_timeout:g} s "
                "(is it a TLS port? a rediss:// URL needs one)") from None
        tls.settimeout(self.socket_timeout)
        return tls


def _final(error: Exception) -> bool:
    """Errors no retry can mend: refused credentials, a peer that does not speak TLS."""
    return isinstance(error, (AuthenticationError, HandshakeTimeout))


class _Retry(Retry):
    """Retries connection errors, but not final ones: a wrong password stays wrong.

    (``AuthenticationError`` is a ``ConnectionError`` to redis-py, so without this a CLI with
    a bad password would spend seconds backing off before it says so; and the retries nest,
    command over connect, so a handshake timeout retried would take minutes.)
    """

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                        with_failure_count: bool = False) -> Any:
        def retryable(error: Exception) -> bool:
            if _final(error):
                return False
            return is_retryable is None or bool(is_retryable(error))

        return super().call_with_retry(do, fail, retryable, with_failure_count)


class _AsyncRetry(AsyncRetry):
    """The asyncio twin of ``_Retry`` (redis-py's asyncio client needs its own Retry class:
    given the blocking one it silently never retries)."""

    async def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                              with_failure_count: bool = False) -> Any:
        def retryable(error: Exception) -> bool:
            if _final(error):
                return False
            return is_retryable is None or bool(is_retryable(error))

        return await super().call_with_retry(do, fail, retryable, with_failure_count)


def _backoff() -> Backoff:
    # 50 ms doubling to 2 s, full jitter: a restart of Redis is ridden out in a few seconds
    return Backoff(base=0.05, cap=2.0)


def _retry(retries: int) -> Retry:
    return _Retry(_backoff(), retries)


def async_retry_options(retries: int = 8) -> dict[str, Any]:
    """How every asyncio client rides out a lost connection: capped, jittered retries of
    connection errors; refused credentials are final. (The simulator's clients use it too.)"""
    return {"retry": _AsyncRetry(_backoff(), retries), "retry_on_error": RETRY_ERRORS}


def connect_async(url: str | None = None, *, retries: int = 8, max_connections: int = 10_000,
                  socket_timeout: float | None = None, **kwargs: Any) -> aioredis.Redis:
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
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        **kwargs,
    )


def connect_sync(url: str | None = None, *, retries: int = 8, socket_timeout: float | None = None,
                 **kwargs: object) -> redis.Redis:
    """A blocking client with the same retry behaviour (CLI, commander).

    A ``rediss://`` URL gets a TLS connection whose handshake is bounded like its connect.
    """
    url = resolve_url(url)
    if url.startswith("rediss://"):
        kwargs.setdefault("connection_class", _SSLConnection)
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        retry=_retry(retries),
        retry_on_error=RETRY_ERRORS,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        **kwargs,
    )
