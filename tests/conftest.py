"""Shared fixtures: a real, private redis-server per test module (never the machine's 6379)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    """A redis-server process owned by a test: it can be killed and restarted on its port."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    extra: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not on PATH (scripts/test installs it)"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.workdir),
                *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)
        client.close()

    def stop(self, sig_kill: bool = False) -> None:
        if self.proc is None:
            return
        if sig_kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(timeout=10)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


def _require_redis_server() -> None:
    if shutil.which("redis-server"):
        return
    msg = "redis-server is not installed: run ./scripts/test (it installs it) or apt-get install redis-server"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh redis-server on a free port for the module; stopped (by pid) afterwards."""
    _require_redis_server()
    server = RedisServer(port=free_port(), workdir=tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on the module's server, with the database emptied before the test."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


# Settings every worker a test starts (directly, through a commander or `fleet up`) runs with:
# the ready-stream read blocks 200 ms, not the production 1 s; a drain lets that read finish,
# so a stopped worker exits in a fraction of a second instead of a second.
TEST_WORKER_ENV = {"FLEET_WORKER_BLOCK_MS": "200"}


@pytest.fixture
def fleet_env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
    """Environment for child processes (workers, CLI) pointed at the test server."""
    env = dict(os.environ)
    env["REDIS_URL"] = redis_server.url
    env["FLEET_HOME"] = str(tmp_path / "fleet-home")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("FLEET_PYTHON", sys.executable)
    env.update(TEST_WORKER_ENV)
    return env
