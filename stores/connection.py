"""Redis connections with capped, jittered reconnects (redis-py's own Retry machinery).

Every process builds its client from a URL (explicit, else ``REDIS_URL``, else the local
``fleet up`` one). Credentials and TLS ride in that URL, which redis-py parses itself:
``redis://user:password@host:port/0`` for an ACL user, and
``rediss://user:password@host:port/0?ssl_ca_certs=/path/ca.pem`` for TLS (also
``ssl_certfile``, ``ssl_keyfile`` for a client certificate, ``ssl_cert_reqs``);
``unix://user:password@/path/redis.sock?db=0`` for a Redis reached by its Unix socket.
See docs/operations/security.md.

**Redis Cluster.** The URL of any node of a cluster will do: at connect, one short-lived plain
connection (same TLS, ACL and connect timeout) asks the node whether it runs in cluster mode
(``_probe``), and a cluster node gets redis-py's cluster client (``redis.RedisCluster``, or the
asyncio one), with the same retry, TLS, ACL and timeout options. ``FLEET_REDIS_CLUSTER`` forces
the mode: ``auto`` (the default: ask the node), ``yes`` (a cluster: an error if the node says it
is not one) or ``no`` (a single node, never asked). In ``auto``, a node that cannot be asked
(down, refused) is taken for a single node (logged at INFO): a cluster whose node may be away
when a process starts wants ``FLEET_REDIS_CLUSTER=yes``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any, Literal, cast

import hiredis
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from stores import local_fleet
from stores.retry import TRANSIENT, Backoff

log = logging.getLogger(__name__)

RETRY_ERRORS = [RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionResetError]
CONNECT_TIMEOUT_S = 5.0  # TCP connect, and the TLS handshake of a rediss:// URL
CLUSTER_ENV = "FLEET_REDIS_CLUSTER"
ClusterMode = Literal["auto", "yes", "no"]
CLUSTER_MODES: tuple[ClusterMode, ...] = ("auto", "yes", "no")


class NoFleetFound(RedisConnectionError):
    """No URL was given and no running ``fleet up`` was found: nothing to connect to.

    Fleet never falls back to ``127.0.0.1:6379``: a Redis there is usually not Fleet's.
    """


class ClusterModeError(ValueError):
    """``FLEET_REDIS_CLUSTER`` is not one of its values, or says ``yes`` of a node that is not
    a cluster node, or a cluster URL names a database other than 0 (a usage error, final)."""


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
    found = local_fleet.recorded_url()
    if found is None:
        raise NoFleetFound("no Redis to use: no --redis-url, no REDIS_URL, and "
                           f"{local_fleet.no_fleet_reason()}; run `fleet up`, or set REDIS_URL")
    local_fleet.note_found_home()
    return found


def redact_url(url: str) -> str:
    """The URL without its credentials (``scheme://***@host…``), fit for logs, errors and
    ``fleet status``."""
    head, at, tail = url.rpartition("@")
    return f"{head.split('//')[0]}//***@{tail}" if at else url


class HiredisPacker:
    """Packs each command with ``hiredis.pack_command`` alone: the packer of Fleet's connections.

    redis-py's own packer first encodes every argument in Python (``Encoder.encode``), which
    cost more than the rest of a worker's Redis work: 26 µs to pack one turn commit's 44
    arguments against 4 µs for hiredis alone. hiredis encodes str (UTF-8, strict), bytes, int
    and float as redis-py's default encoder does (checked byte for byte in
    tests/unit/test_connection_packing.py). Anything else goes to ``fallback``, redis-py's
    packer, with its errors: an argument hiredis refuses (a bytearray, a bool, None) and a
    command name of several words (``"CONFIG GET"``, which redis-py splits).
    """

    def __init__(self, fallback: Callable[..., list[bytes]]) -> None:
        self._fallback = fallback

    def pack(self, *args: Any) -> list[bytes]:
        if type(args[0]) is str and args[0].isidentifier():
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                pass  # redis-py's packer takes it, or raises its own DataError
        return self._fallback(*args)


def _hiredis_packing(base: type[Any], **methods: Any) -> type[Any]:
    """``base``, a redis-py connection class, packing with :class:`HiredisPacker` (and with
    ``methods`` of its own). redis-py packs every command, a pipeline's too, through the
    connection's ``_command_packer``: the one place to put it. A client with another encoding
    than UTF-8 (strict) keeps redis-py's."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        if self.encoder.encoding == "utf-8" and self.encoder.encoding_errors == "strict":
            stock = self._command_packer  # None: redis-py's asyncio connection without hiredis
            fallback = stock.pack if stock is not None else self._pack_command_python
            self._command_packer = HiredisPacker(fallback)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__,
                                        "__doc__": base.__doc__, **methods})


def _bounded_handshake(self: Any, sock: socket.socket) -> Any:
    """redis-py's TLS handshake, bounded by the connect timeout.

    redis-py runs the handshake under ``socket_timeout``, which is None here (a BLPOP for a
    reply must not be cut short), so a ``rediss://`` URL naming a plain port waited forever
    for a server hello that never comes (the plain server waits for a newline).
    """
    sock.settimeout(self.socket_connect_timeout)
    try:
        tls = redis.SSLConnection._wrap_socket_with_ssl(self, sock)  # type: ignore[no-untyped-call]  # unannotated in redis-py
    except TimeoutError:
        raise HandshakeTimeout(
            f"no TLS handshake from {self.host}:{self.port} within {self.socket_connect_timeout:g} s "
            "(is it a TLS port? a rediss:// URL needs one)") from None
    tls.settimeout(self.socket_timeout)
    return tls


_SSLConnection = _hiredis_packing(redis.SSLConnection, _wrap_socket_with_ssl=_bounded_handshake)
_CONNECTIONS = {
    (False, "redis"): _hiredis_packing(redis.Connection),
    (False, "rediss"): _SSLConnection,
    (False, "unix"): _hiredis_packing(redis.UnixDomainSocketConnection),
    (True, "redis"): _hiredis_packing(aioredis.Connection),
    (True, "rediss"): _hiredis_packing(aioredis.SSLConnection),
    (True, "unix"): _hiredis_packing(aioredis.UnixDomainSocketConnection),
}


def _connection_class(url: str, is_async: bool) -> type[Any]:
    """The connection class for a single node's ``url``: redis-py's of the URL's kind (TCP, TLS,
    Unix socket), packing with hiredis (``_hiredis_packing``)."""
    kind = "rediss" if url.startswith("rediss://") else "unix" if url.startswith("unix://") else "redis"
    return _CONNECTIONS[is_async, kind]


def _final(error: Exception) -> bool:
    """Errors no retry can mend: refused credentials, a peer that does not speak TLS."""
    return isinstance(error, (AuthenticationError, HandshakeTimeout))


def _not_final(error: Exception) -> bool:
    """Whether redis-py may retry ``error``: not a final one. (``AuthenticationError`` is a
    ``ConnectionError`` to redis-py, so a CLI with a bad password would spend seconds backing
    off before it says so; and the retries nest, command over connect, so a handshake timeout
    retried would take minutes.)"""
    return not _final(error)


def _backoff() -> Backoff:
    # 50 ms doubling to 2 s, full jitter: a restart of Redis is ridden out in a few seconds
    return Backoff(base=0.05, cap=2.0)


def _retry(retries: int) -> Retry:
    return Retry(_backoff(), retries, is_retryable=_not_final)


def async_retry_options(retries: int = 8) -> dict[str, Any]:
    """How every asyncio client rides out a lost connection: capped, jittered retries of
    connection errors; refused credentials are final. (The simulator's clients use it too.)"""
    return {"retry": AsyncRetry(_backoff(), retries, is_retryable=_not_final), "retry_on_error": RETRY_ERRORS}


def cluster_mode(value: str | None = None) -> ClusterMode:
    """The cluster mode asked for: ``value``, else ``$FLEET_REDIS_CLUSTER``, else ``auto``.

    Case and surrounding blanks do not matter; anything but auto/yes/no is a ``ClusterModeError``.
    """
    raw = os.environ.get(CLUSTER_ENV, "") if value is None else value
    mode = raw.strip().lower() or "auto"
    for known in CLUSTER_MODES:
        if mode == known:
            return known
    raise ClusterModeError(f"{CLUSTER_ENV}={raw!r}: must be one of {', '.join(CLUSTER_MODES)} "
                           "(auto: ask the node at connect)")


def _probe(url: str) -> bool | None:
    """Whether the node of ``url`` is a cluster node, None if it cannot say (away, refused).

    One plain connection with the URL's own TLS and ACL options and the usual connect timeout,
    no retries, closed at once. It asks ``SELECT 1`` first, which a cluster node refuses "in
    cluster mode" and the least-privilege ACL of docs/operations/security.md allows; only if the
    ACL refuses that, ``INFO cluster`` (``cluster_enabled:1``), which that ACL does not grant (a
    refusal lands in ``ACL LOG``). A ``rediss://`` URL naming a plain port raises ``HandshakeTimeout`` here.
    """
    kwargs: dict[str, Any] = {}
    if url.startswith("rediss://"):
        kwargs["connection_class"] = _SSLConnection
    probe = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                 socket_timeout=CONNECT_TIMEOUT_S, retry=Retry(NoBackoff(), 0), **kwargs)
    # database 0 whatever the URL says: a cluster node refuses SELECT of another at connect
    probe.connection_pool.connection_kwargs["db"] = 0
    try:
        try:
            probe.select(1)
            return False
        except NoPermissionError:
            return str(probe.info("cluster").get("cluster_enabled", "0")) == "1"
        except ResponseError as exc:
            return "cluster mode" in str(exc)  # else: a single node with fewer databases
    except HandshakeTimeout:
        raise  # final, and the client built next would wait as long again for it
    except TRANSIENT as exc:
        # the client built next meets the same error, and says so; a CLI prints one line
        log.info("could not ask %s whether it is a cluster node (%s: %s)",
                 redact_url(url), type(exc).__name__, exc)
        return None
    finally:
        probe.close()


def _use_cluster(url: str, cluster: str | None) -> bool:
    """Whether to build a cluster client for ``url`` (see the module's doc)."""
    mode = cluster_mode(cluster)
    if mode == "no":
        return False
    enabled = _probe(url)
    if mode == "yes" and enabled is False:
        raise ClusterModeError(f"{CLUSTER_ENV}=yes, but {redact_url(url)} is not a cluster node "
                               "(it accepts SELECT 1); for a single Redis, set it to auto or no")
    if mode == "auto" and enabled is None:
        log.info("taking %s for a single node (%s=yes forces cluster mode)", redact_url(url), CLUSTER_ENV)
    use = mode == "yes" or bool(enabled)
    if use:
        db = redis.connection.parse_url(url).get("db", 0)  # type: ignore[no-untyped-call]  # unannotated in redis-py
        if db not in (0, None):
            raise ClusterModeError(f"{redact_url(url)} names database {db}: "
                                   "a Redis Cluster has only database 0")
    return use


def _keepalive(url: str) -> dict[str, Any]:
    """TCP keepalive for a TCP URL; a ``unix://`` socket's connection takes no such option."""
    return {} if url.startswith("unix://") else {"socket_keepalive": True}


def connect_async(url: str | None = None, *, retries: int = 8, max_connections: int = 10_000,
                  socket_timeout: float | None = None, cluster: str | None = None,
                  **kwargs: Any) -> aioredis.Redis:
    """An asyncio client that retries connection errors with capped, jittered backoff.

    Every concurrent blocking call (BLPOP of a waiting reply, XREADGROUP) holds a connection,
    so the pool's cap is set far above redis-py's default of 100. ``socket_timeout`` is None by
    default (redis-py's is 5 s), or a ``BLPOP`` for a reply would fail after 5 s whatever its
    own timeout; a process that must not hang on a paused Redis passes its own.

    A cluster node's URL gets redis-py's asyncio ``RedisCluster`` (``cluster`` overrides
    ``$FLEET_REDIS_CLUSTER``; see the module's doc). The probe is a blocking round trip, once;
    unless the mode is ``no``, a ``rediss://`` URL naming a plain port raises
    ``HandshakeTimeout`` from it.
    """
    url = resolve_url(url)
    options = dict(max_connections=max_connections, socket_timeout=socket_timeout,
                   **async_retry_options(retries), health_check_interval=15,
                   socket_connect_timeout=CONNECT_TIMEOUT_S, **_keepalive(url), **kwargs)
    if _use_cluster(url, cluster):
        # redis-py's asyncio cluster client: its ``max_connections`` is per node; it builds its
        # own TLS connection class from ``ssl`` (no ``connection_class``), and uses the retry
        # for the count of its own retries (MOVED, a lost node: the slots table is refreshed)
        client = aioredis.RedisCluster.from_url(url, **options)
        # RedisCluster is no subclass of Redis, but has the command API the stores use; the
        # callers keep their one type, and ``stores.cluster.is_cluster`` tells the two apart
        return cast(aioredis.Redis, client)
    options.setdefault("connection_class", _connection_class(url, is_async=True))
    return aioredis.Redis.from_url(url, **options)


def connect_sync(url: str | None = None, *, retries: int = 8, socket_timeout: float | None = None,
                 cluster: str | None = None, **kwargs: object) -> redis.Redis:
    """A blocking client with the same retry behaviour (CLI, commander).

    A ``rediss://`` URL gets a TLS connection whose handshake is bounded like its connect.
    A cluster node's URL gets redis-py's ``RedisCluster`` (``cluster`` overrides
    ``$FLEET_REDIS_CLUSTER``; see the module's doc), which connects at once to learn the slots:
    a cluster none of whose nodes answers raises ``RedisClusterException`` here. Unless the mode
    is ``no``, a ``rediss://`` URL naming a plain port raises ``HandshakeTimeout`` here too.
    """
    url = resolve_url(url)
    if _use_cluster(url, cluster):
        if url.startswith("rediss://"):
            # redis-py's cluster client lets the URL's scheme pick the connection class over
            # ours: given a redis:// URL (its TLS options ride in the query) it keeps ours
            url = "redis://" + url.removeprefix("rediss://")
            kwargs.setdefault("connection_class", _SSLConnection)
        client = redis.RedisCluster.from_url(
            url,
            socket_timeout=socket_timeout,
            # used for its retry count: redis-py retries a lost node or a CLUSTERDOWN that many
            # times, refreshing the slots table; each node's own connection does not retry
            retry=_retry(retries),
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_keepalive=True,
            **kwargs,
        )
        # RedisCluster is no subclass of Redis, but has the command API the stores use; the
        # callers keep their one type, and ``stores.cluster.is_cluster`` tells the two apart
        return cast(redis.Redis, client)
    kwargs.setdefault("connection_class", _connection_class(url, is_async=False))
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        retry=_retry(retries),
        retry_on_error=RETRY_ERRORS,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        **_keepalive(url),
        **kwargs,
    )


def ping(r: redis.Redis) -> bool:
    """``PING``: whether the server answers (a connection error is raised, as by any command)."""
    return bool(r.ping())



def connect_rq(url: str, *, retries: int = 2, socket_timeout: float | None = 5.0) -> redis.Redis:
    """A client of RQ's Redis (``--rq-url``, ``$FLEET_RQ_URL``): one node's client, never a
    cluster client (RQ keeps its keys without hash tags, so it needs one node)."""
    return connect_sync(url, retries=retries, socket_timeout=socket_timeout, cluster="no")
