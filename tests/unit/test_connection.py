"""Client construction: retries of the right kind, no socket timeout under a long BLPOP, and the
cluster mode (``FLEET_REDIS_CLUSTER``) parsed and applied."""

from __future__ import annotations

import asyncio
import logging

import pytest
from redis.asyncio.retry import Retry as AsyncRetry
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MasterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

from stores import connection
from stores.cluster import is_cluster
from stores.connection import ClusterModeError, cluster_mode, connect_async, connect_sync
from stores.redis_errors import error_kind
from stores.retry import TRANSIENT, Backoff, until_ok

URL = "redis://127.0.0.1:1/0"  # never contacted: clients connect lazily


def test_sync_client_has_no_socket_timeout_and_a_blocking_retry():
    r = connect_sync(URL)
    # redis-py's default socket timeout (5 s) would cut a BLPOP for a reply short
    assert r.connection_pool.connection_kwargs["socket_timeout"] is None
    assert isinstance(r.get_retry(), Retry)


def test_async_client_gets_the_asyncio_retry_class():
    r = connect_async(URL)
    kwargs = r.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] is None
    assert isinstance(kwargs["retry"], AsyncRetry)  # the blocking Retry is silently ignored there


def test_a_process_can_still_ask_for_a_socket_timeout():
    assert connect_sync(URL, socket_timeout=10).connection_pool.connection_kwargs["socket_timeout"] == 10


# --- cluster mode ---------------------------------------------------------------------------
def test_cluster_mode_reads_the_env_and_defaults_to_auto(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FLEET_REDIS_CLUSTER", raising=False)
    assert cluster_mode() == "auto"
    for raw, mode in [("yes", "yes"), (" NO ", "no"), ("Auto", "auto"), ("", "auto")]:
        monkeypatch.setenv("FLEET_REDIS_CLUSTER", raw)
        assert cluster_mode() == mode
    assert cluster_mode("no") == "no"  # an explicit value wins over the env


@pytest.mark.parametrize("raw", ["maybe", "1", "true", "cluster", "y"])
def test_a_bad_cluster_mode_is_a_clear_usage_error(raw: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLEET_REDIS_CLUSTER", raw)
    with pytest.raises(ClusterModeError, match=rf"FLEET_REDIS_CLUSTER={raw!r}: must be one of auto, yes, no"):
        cluster_mode()
    with pytest.raises(ValueError):  # a usage error, like a URL redis-py cannot parse
        connect_sync(URL)


def test_no_never_asks_the_node(monkeypatch: pytest.MonkeyPatch):
    def probe(url: str) -> bool:
        raise AssertionError("asked")

    monkeypatch.setattr(connection, "_probe", probe)
    monkeypatch.setenv("FLEET_REDIS_CLUSTER", "no")
    assert not is_cluster(connect_sync(URL)) and not is_cluster(connect_async(URL))


def test_auto_takes_a_node_that_cannot_be_asked_for_a_single_node(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture):
    monkeypatch.delenv("FLEET_REDIS_CLUSTER", raising=False)
    caplog.set_level(logging.INFO, logger="stores.connection")
    r = connect_sync(URL)  # nothing listens on port 1
    assert not is_cluster(r)
    assert "FLEET_REDIS_CLUSTER=yes forces cluster mode" in caplog.text


def test_cluster_errors_are_transient_and_until_ok_retries_them():
    assert not issubclass(RedisClusterException, RedisError)  # why TRANSIENT names it
    assert issubclass(SlotNotCoveredError, TRANSIENT) and issubclass(RedisClusterException, TRANSIENT)
    moving = (MovedError("3999 127.0.0.1:6381"), AskError("3999 127.0.0.1:6381"), TryAgainError("x"),
              ClusterDownError("x"), MasterDownError("x"))
    assert [error_kind(e) for e in moving] == ["moved", "moved", "tryagain", "clusterdown", "masterdown"]
    calls = []

    async def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RedisClusterException("Redis Cluster cannot be connected")
        if len(calls) == 2:
            raise MovedError("3999 127.0.0.1:6381")

    asyncio.run(until_ok("flaky", flaky, backoff=Backoff(base=0.001, cap=0.001), log=logging.getLogger("t")))
    assert len(calls) == 3


def test_the_commander_stops_at_a_bad_mode_before_it_builds_anything(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture):
    import threading

    from commander.__main__ import _connect

    monkeypatch.setenv("FLEET_REDIS_CLUSTER", "maybe")
    assert _connect(URL, threading.Event()) is None
    assert "must be one of auto, yes, no" in caplog.text
