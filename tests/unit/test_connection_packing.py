"""Fleet's connections pack commands with hiredis alone, byte for byte as redis-py does, and
leave to redis-py's packer what hiredis does not take (and the errors it raises)."""

from __future__ import annotations

import hiredis
import pytest
import redis
import redis.asyncio as aioredis
from redis._parsers.encoders import Encoder
from redis.exceptions import DataError

from stores.connection import connect_async, connect_sync

URLS = ("redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0", "unix:///tmp/fleet-never.sock")
# what Fleet's calls carry: a function call with str, bytes, int and float arguments
COMMIT = ("FCALL", "fleet_turn_commit_0123456789ab", 2, "fleet:u:{ü}:lane", "fleet:u:{ü}:state",
          "w1|5", "1796648278193-0", b"\x85\x00\xff" * 30, 20, 0.5, 1796648278.193123, 1e-07, -2,
          2**70, "é€", b"", "")


STOCK = {("redis", True): aioredis.Connection, ("rediss", True): aioredis.SSLConnection,
         ("unix", True): aioredis.UnixDomainSocketConnection, ("redis", False): redis.Connection,
         ("rediss", False): redis.SSLConnection, ("unix", False): redis.UnixDomainSocketConnection}


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("is_async", [True, False], ids=["asyncio", "blocking"])
def test_every_kind_of_connection_packs_with_hiredis_as_redis_py_does(
        url: str, is_async: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []  # redis-py's per-argument encoder, counted
    encode = Encoder.encode
    monkeypatch.setattr(Encoder, "encode", lambda self, v: calls.append(v) or encode(self, v))
    client = connect_async(url, cluster="no") if is_async else connect_sync(url, cluster="no")
    pool = client.connection_pool
    conn = pool.make_connection()
    stock_class = STOCK[url.split(":")[0], is_async]
    assert isinstance(conn, stock_class)  # the URL's kind of connection, kept
    stock = stock_class(**pool.connection_kwargs)  # redis-py's own
    ours = b"".join(conn.pack_command(*COMMIT))
    piped = b"".join(conn.pack_commands([COMMIT, ("GET", "k")]))  # a pipeline's way
    assert calls == []  # hiredis packed them
    assert ours == b"".join(stock.pack_command(*COMMIT))
    assert piped == b"".join(stock.pack_commands([COMMIT, ("GET", "k")]))
    assert len(calls) == 2 * len(COMMIT) + 2


@pytest.mark.parametrize("args", [("CONFIG GET", "maxmemory"), ("SET", "k", bytearray(b"v")),
                                  ("SET", "k", memoryview(b"v"))])
def test_what_hiredis_does_not_take_is_packed_by_redis_py(args: tuple[object, ...]) -> None:
    conn = connect_async(URLS[0], cluster="no").connection_pool.make_connection()
    stock = aioredis.Connection()
    assert b"".join(conn.pack_command(*args)) == b"".join(stock.pack_command(*args))


@pytest.mark.parametrize("bad", [True, None, 1j, ["x"]])
@pytest.mark.parametrize("is_async", [True, False], ids=["asyncio", "blocking"])
def test_an_argument_of_no_redis_type_is_refused_as_redis_py_refuses_it(bad: object, is_async: bool) -> None:
    connect = connect_async if is_async else connect_sync
    conn = connect(URLS[0], cluster="no").connection_pool.make_connection()
    with pytest.raises(DataError, match="Invalid input of type"):
        conn.pack_command("SET", "k", bad)


@pytest.mark.parametrize("is_async", [True, False], ids=["asyncio", "blocking"])
def test_a_client_with_another_encoding_keeps_redis_py_s_packer(is_async: bool) -> None:
    connect = connect_async if is_async else connect_sync
    conn = connect(URLS[0], cluster="no", encoding="latin-1").connection_pool.make_connection()
    latin = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n\xe9\r\n"
    assert b"".join(conn.pack_command("SET", "k", "é")) == latin
    assert b"".join(conn.pack_commands([("SET", "k", "é")])) == latin
    assert hiredis.pack_command(("SET", "k", "é")) != latin
