"""Where a process finds its Redis, and how it gives up: never a silent 127.0.0.1:6379."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet import local
from stores.connection import (
    HandshakeTimeout,
    NoFleetFound,
    _SSLConnection,
    async_retry_options,
    connect_sync,
    resolve_url,
)


@pytest.fixture
def nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with no fleet in it or above it (up to $HOME), no REDIS_URL."""
    work = tmp_path / "home" / "project" / "sub"
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("FLEET_HOME", raising=False)
    monkeypatch.chdir(work)
    return work


def test_no_url_and_no_fleet_is_refused_with_where_it_looked(nowhere: Path):
    with pytest.raises(NoFleetFound) as err:
        resolve_url()
    message = str(err.value)
    assert f"no .fleet/ in {nowhere} or above it (up to {nowhere.parents[1]})" in message
    assert "REDIS_URL" in message and "fleet up" in message and "6379" not in message
    with pytest.raises(NoFleetFound):
        connect_sync()  # before any socket is opened


def test_an_explicit_url_or_redis_url_needs_no_fleet(nowhere: Path, monkeypatch: pytest.MonkeyPatch):
    assert resolve_url("redis://10.0.0.5:6380/1") == "redis://10.0.0.5:6380/1"
    monkeypatch.setenv("REDIS_URL", "redis://10.0.0.6:6380/0")
    assert resolve_url() == "redis://10.0.0.6:6380/0"


def test_the_state_dir_is_found_upward_but_not_above_home(nowhere: Path, monkeypatch: pytest.MonkeyPatch):
    home = nowhere.parents[1]
    (home / ".fleet").mkdir()
    assert local.fleet_home() == home / ".fleet"  # like git: the nearest one up to $HOME
    (nowhere.parent / ".fleet").mkdir()
    assert local.fleet_home() == nowhere.parent / ".fleet"
    monkeypatch.setenv("HOME", str(nowhere))  # $HOME below the ones found: not looked at
    assert local.fleet_home() == nowhere / ".fleet"
    monkeypatch.setenv("FLEET_HOME", str(home / "elsewhere"))
    assert local.fleet_home() == home / "elsewhere"


def test_a_found_fleet_that_is_not_up_is_named(nowhere: Path):
    (nowhere.parent / ".fleet").mkdir()
    with pytest.raises(NoFleetFound, match=f"the fleet of {nowhere.parent / '.fleet'} is not up"):
        resolve_url()


def test_a_rediss_url_gets_a_tls_connection_with_a_bounded_handshake():
    r = connect_sync("rediss://u:p@127.0.0.1:1/0?ssl_cert_reqs=none")  # never contacted
    assert r.connection_pool.connection_class is _SSLConnection
    assert r.connection_pool.connection_kwargs["socket_connect_timeout"] == 5
    assert connect_sync("redis://127.0.0.1:1/0").connection_pool.connection_class is not _SSLConnection


def test_a_handshake_timeout_is_final_not_retried():
    calls = []

    def fail() -> None:
        calls.append(1)
        raise HandshakeTimeout("no TLS handshake")

    retry = connect_sync("redis://127.0.0.1:1/0").get_retry()  # never contacted
    assert retry is not None
    with pytest.raises(HandshakeTimeout):
        retry.call_with_retry(fail, lambda error: None)
    assert len(calls) == 1  # retried, nested command-over-connect, it took minutes


async def test_a_handshake_timeout_is_final_on_an_asyncio_client_too():
    calls = []

    async def fail() -> None:
        calls.append(1)
        raise HandshakeTimeout("no TLS handshake")

    async def nothing(error: Exception) -> None:
        pass

    with pytest.raises(HandshakeTimeout):
        await async_retry_options(5)["retry"].call_with_retry(fail, nothing)
    assert len(calls) == 1


def test_env_text_quotes_the_url_for_the_shell(nowhere: Path):
    assert local.env_text("redis://u:p@h:1/0?a=b&c=d") == "export REDIS_URL='redis://u:p@h:1/0?a=b&c=d'\n"
    with pytest.raises(local.LocalRedisError, match="no fleet to point at"):
        local.env_text()
