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

import fakeredis
import pytest
import redis

from protocol.acl import ROLE_NAMES, acl_file
from stores import functions
from stores.roles import password_env, with_credentials
from tests.helpers import Processes

ROOT = Path(__file__).resolve().parents[1]

# Every test server runs Fleet's ACL roles (protocol.acl) with these passwords, and its default
# user is the admin with a password: a Fleet process that does not connect as its role is refused.
ADMIN_PASSWORD = "test-admin-pw"
ROLE_PASSWORDS = {role: f"test-{role}-pw" for role in ROLE_NAMES}


def role_env() -> dict[str, str]:
    """``FLEET_ACL_PASSWORD_<ROLE>`` of every role: each Fleet command connects as its own."""
    return {password_env(role): pw for role, pw in ROLE_PASSWORDS.items()}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortTaken(RuntimeError):
    """The free port was taken by another process before the server bound it."""


@dataclass
class RedisServer:
    """A redis-server process owned by a test: it can be killed and restarted on its port."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    extra: tuple[str, ...] = ()
    library: bool = True  # Fleet's functions installed when it starts, as an operator would
    acl: bool = True  # the roles' ACL file, the default user the admin (ADMIN_PASSWORD)

    @property
    def plain_url(self) -> str:
        """The server's URL without credentials."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def url(self) -> str:
        """The admin's URL (the tests' own clients)."""
        return with_credentials(self.plain_url, "default", ADMIN_PASSWORD) if self.acl else self.plain_url

    def role_url(self, role: str) -> str:
        """The URL of ACL role ``role`` (``fleet-worker``, …)."""
        return with_credentials(self.plain_url, role, ROLE_PASSWORDS[role]) if self.acl else self.plain_url

    def _acl_args(self) -> list[str]:
        if not self.acl:
            return []
        path = self.workdir / "users.acl"
        path.write_text(acl_file(ROLE_PASSWORDS, default=ADMIN_PASSWORD, shared_with_rq=True))  # RQ's too
        return ["--aclfile", str(path)]

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not on PATH (scripts/test installs it)"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.workdir),
                *self._acl_args(), *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2,
                             password=ADMIN_PASSWORD if self.acl else None)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    pid = int(client.info("server")["process_id"])
                    break
                except (redis.ConnectionError, redis.BusyLoadingError):
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                    time.sleep(0.02)
        finally:
            client.close()
        if pid != self.proc.pid:
            # another process (a parallel test run's server) took the port between free_port()
            # and this start: ours failed to bind; never use theirs
            self.proc.wait(timeout=10)
            self.proc = None
            raise PortTaken(f"port {self.port} is another redis-server's (pid {pid})")
        if self.library:
            install_library(self.url)

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


def install_library(url: str) -> None:
    """Install Fleet's functions library on the server (or Cluster) at ``url``, as an admin
    (``fleet install``): the one way the test fixtures load it."""
    from stores.connection import connect_sync

    client = connect_sync(url)
    try:
        functions.install(client)
    finally:
        client.close()


@pytest.fixture(autouse=True)
def fake_servers_hold_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fakeredis server a test makes starts with Fleet's functions library, as a server
    an operator installed it on."""
    init = fakeredis.FakeServer.__init__

    def installed(self: fakeredis.FakeServer, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        functions.install(fakeredis.FakeRedis(server=self))

    monkeypatch.setattr(fakeredis.FakeServer, "__init__", installed)


def start_on_free_port(workdir: Path, extra: tuple[str, ...] = (), library: bool = True) -> RedisServer:
    """A started RedisServer on a free port (with Fleet's functions library unless ``library``
    is false); a port another process took first is tried again."""
    for _ in range(4):
        server = RedisServer(port=free_port(), workdir=workdir, extra=extra, library=library)
        try:
            server.start()
        except PortTaken:
            continue
        return server
    raise RuntimeError("no free port for redis-server after 4 tries")


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
    server = start_on_free_port(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """The processes a test starts (a commander, a relay), logging under its tmp_path; stopped
    by pid after it."""
    started = Processes(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture
def r(redis_server: RedisServer, request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    """The admin's client on the module's server, with the database emptied before the test.
    After the test, a refusal by the ACL of a Fleet role (``ACL LOG``) fails it: a right a role
    lacks, unless the test is marked ``acl_denials``."""
    client = redis_server.client()
    client.flushall()
    if redis_server.acl:
        client.acl_log_reset()
    yield client
    try:
        if redis_server.acl and request.node.get_closest_marker("acl_denials") is None:
            denials = [acl_denial(e) for e in client.acl_log() if e.get("username") in ROLE_PASSWORDS]
            assert not denials, f"the ACL refused a Fleet role: {denials}"
    finally:
        client.close()


def acl_denial(entry: dict[str, object]) -> str:
    """One ``ACL LOG`` entry as ``<user> <reason> <object>`` (the command or the key refused)."""
    return f"{entry.get('username')} {entry.get('reason')} {entry.get('object')}"


# Settings every worker a test starts (directly, through a commander or `fleet up`) runs with:
# the ready-stream read blocks 200 ms, not the production 1 s; a drain lets that read finish,
# so a stopped worker exits in a fraction of a second instead of a second.
TEST_WORKER_ENV = {"FLEET_WORKER_BLOCK_MS": "200"}


@pytest.fixture
def fleet_env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
    """Environment for child processes (workers, CLI) pointed at the test server."""
    env = dict(os.environ)
    # pytest-xdist's workers carry COLUMNS/LINES of a pretend terminal; a child writing into a
    # pipe must see none, as it would under a plain run
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    # no credentials: each Fleet process and command connects as its own role (role_env)
    env["REDIS_URL"] = redis_server.plain_url
    env.update(role_env())
    env["FLEET_HOME"] = str(tmp_path / "fleet-home")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("FLEET_PYTHON", sys.executable)
    env.update(TEST_WORKER_ENV)
    return env
