"""Client construction: retries of the right kind, no socket timeout under a long BLPOP."""

from __future__ import annotations

from redis.asyncio.retry import Retry as AsyncRetry
from redis.retry import Retry

from stores.connection import connect_async, connect_sync

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
