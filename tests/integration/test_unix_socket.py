"""A Redis reached by its Unix socket (``unix://`` URL): the clients Fleet builds connect."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from stores.connection import connect_async, connect_sync
from tests.conftest import ADMIN_PASSWORD, RedisServer, start_on_free_port


@pytest.fixture(scope="module")
def socket_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    work = tmp_path_factory.mktemp("unix")
    path = work / "redis.sock"
    server = start_on_free_port(work, extra=("--unixsocket", str(path), "--unixsocketperm", "700"),
                                library=False)
    try:
        yield server, path
    finally:
        server.stop()


def test_a_unix_socket_url_connects_blocking_and_asyncio(socket_server: tuple[RedisServer, Path]) -> None:
    _, path = socket_server
    url = f"unix://default:{ADMIN_PASSWORD}@{path}?db=0"
    r = connect_sync(url)
    try:
        assert r.ping()
        assert r.set("k", "é") and r.get("k") == "é".encode()
    finally:
        r.close()

    async def ping_async() -> object:
        ar = connect_async(url)
        try:
            return await ar.ping()
        finally:
            await ar.aclose()

    assert asyncio.run(ping_async())
