"""The one-machine setup of ``fleet up``: its state dir, its Redis, its process bookkeeping.

Everything lives under one ``.fleet/`` directory: ``$FLEET_HOME`` if set, else the nearest
``.fleet/`` in the current directory or above it (like git, up to ``$HOME`` or the root), else
a new one in the current directory. It holds
``state.json`` (what ``fleet up`` started: URL, pids with their creation times),
``redis/`` (the append-only file of the local redis-server), ``logs/`` and ``run/`` (the
process runtime's spawn records). Pids are always checked together with their creation time
so that a reused pid is never reported alive or signalled.

A process is recorded in ``state.json`` as it is started: Ctrl-C (SIGINT) is held back from
the spawn until the record is written. One Redis per data folder: ``redis/server.lock`` is
locked (``flock``) by ``fleet up`` and handed to the server it starts, which holds it for as
long as it runs, so a server that no state names is still found (:func:`data_dir_holders`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import redis

from protocol.acl import acl_file
from stores.connection import ping
from stores.local_fleet import (
    STATE_FILE,
    no_fleet_reason,
    recorded_url,
)
from stores.local_fleet import child_env as _child_env
from stores.local_fleet import fleet_home as fleet_home  # re-exported: fleet.updown calls them through us
from stores.local_fleet import pid_alive as pid_alive
from stores.local_fleet import read_state as read_state
from stores.roles import ADMIN, as_role, default_passwords_path, ensure_passwords, role_password, write_secret

EMBEDDED_WARNING = """\
WARNING: redis-server was not found on PATH: starting an EMBEDDED in-memory Redis (fakeredis).
WARNING: NOTHING IS DURABLE. Every turn, session, memory and policy is lost at `fleet down`
WARNING: or when that process dies, and it is slower than a real Redis. Install redis-server
WARNING: (e.g. `apt-get install redis-server`) or set REDIS_URL to use a real one.
"""


class LocalRedisError(RuntimeError):
    """The local Redis could not be started; the message says why in one line."""


# --- state dir ---------------------------------------------------------------------------
def logs_dir() -> Path:
    """Where the commander, the local Redis and every worker log."""
    return fleet_home() / "logs"


def run_dir() -> Path:
    """Spawn records of the process runtime (used to adopt workers after a restart)."""
    return fleet_home() / "run"


def write_state(state: dict[str, Any]) -> None:
    """Replace ``state.json`` atomically; readable by the owner only (it may hold a URL)."""
    home = fleet_home()
    home.mkdir(parents=True, exist_ok=True)
    tmp = home / f".{STATE_FILE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(state, out, indent=2)
    tmp.replace(home / STATE_FILE)


def update_state(**parts: Any) -> dict[str, Any]:
    """Merge ``parts`` into ``state.json`` (a ``None`` value removes the part)."""
    state = read_state() or {}
    for name, value in parts.items():
        if value is None:
            state.pop(name, None)
        else:
            state[name] = value
    write_state(state)
    return state


def clear_state() -> None:
    """Forget the local setup."""
    (fleet_home() / STATE_FILE).unlink(missing_ok=True)


@contextlib.contextmanager
def state_lock() -> Iterator[None]:
    """Serialize ``fleet up`` / ``fleet down`` on one state dir."""
    home = fleet_home()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def env_text(url: str | None = None) -> str:
    """The shell lines that point a shell at the fleet found (``eval "$(fleet env)"``):
    ``url`` if given, else the running local fleet, else ``$REDIS_URL``.

    The local fleet comes before ``$REDIS_URL``, so a shell holding the URL of an earlier
    ``fleet up`` (another port) is corrected. Raises ``LocalRedisError`` if there is none.
    """
    found = url or recorded_url() or os.environ.get("REDIS_URL")
    if not found:
        raise LocalRedisError(f"no fleet to point at: {no_fleet_reason()}; run `fleet up` first")
    return f"export REDIS_URL={shlex.quote(found)}\n"


# --- processes ---------------------------------------------------------------------------
def process_record(pid: int) -> dict[str, Any]:
    """``{"pid", "create_time"}`` of a process we just started."""
    try:
        return {"pid": pid, "create_time": psutil.Process(pid).create_time()}
    except psutil.Error:
        return {"pid": pid, "create_time": None}


def terminate(pid: int, create_time: float | None, timeout: float) -> bool:
    """SIGTERM ``pid``, wait up to ``timeout``, then SIGKILL it. True if it is gone."""
    if not pid_alive(pid, create_time):
        return True
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)
    if wait_gone(pid, create_time, timeout):
        return True
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
    return wait_gone(pid, create_time, 5.0)


def wait_gone(pid: int, create_time: float | None, timeout: float) -> bool:
    """Poll until ``pid`` has exited (collecting it if it is our child)."""
    deadline = time.monotonic() + timeout
    while pid_alive(pid, create_time):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def interrupt_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back while a process is started and recorded: it arrives, as a
    KeyboardInterrupt, once the block ends, never between the start and its record."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def spawn_detached(argv: list[str], log_name: str, env: dict[str, str] | None = None,
                   keep_fd: int | None = None) -> int:
    """Start a process in its own session, output appended to ``logs/<log_name>``, with no
    signal blocked (whatever ``interrupt_held`` blocks here); ``keep_fd`` is inherited.

    ``posix_spawn`` rather than ``Popen``: nothing here will wait for it, and a dropped Popen
    of a running child warns. ``pid_alive`` collects it if it exits while we still run.
    """
    logs = logs_dir()
    logs.mkdir(parents=True, exist_ok=True)
    log_path = str(logs / log_name)
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    if keep_fd is not None:
        os.set_inheritable(keep_fd, True)
    try:
        return os.posix_spawnp(argv[0], argv, env or child_env(), file_actions=actions,
                               setsid=True, setsigmask=())
    except OSError as exc:
        raise LocalRedisError(f"cannot start {argv[0]}: {exc}") from exc
    finally:
        if keep_fd is not None:
            os.set_inheritable(keep_fd, False)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for our helper processes: the code importable, output unbuffered, this home."""
    return _child_env({"FLEET_HOME": str(fleet_home()), **(extra or {})})


# --- local Redis -------------------------------------------------------------------------
def free_port() -> int:
    """A loopback TCP port that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_local_redis(timeout: float = 10.0, appendfsync: str = "always") -> tuple[str, int]:
    """Start a local Redis on a free loopback port, recorded in ``state.json`` as it starts;
    (url, pid). Raises ``LocalRedisError`` if one already runs on the data folder.

    A real ``redis-server`` (append-only file under ``.fleet/redis``, fsynced per write by
    default: an accepted turn survives a crash, as the chaos run proves) when it is on PATH,
    else an embedded fakeredis server in a helper process, with a loud warning on stderr.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        _require_fakeredis()
        sys.stderr.write(EMBEDDED_WARNING)
    last_error = "no attempt"
    for _ in range(3):  # the free port may be taken between probe and bind
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        where = {"dir": str(redis_dir()), "appendfsync": appendfsync} if binary else {}
        lock = _claim_data_dir()
        try:
            with interrupt_held():
                if binary:
                    pid, kind = _spawn_redis_server(binary, port, appendfsync, lock), "redis-server"
                    # the client role's URL (`fleet env`; its password made with the server's
                    # ACL just now): each Fleet process and command swaps in its own role
                    url = as_role(url, "fleet-client")
                else:
                    pid, kind = _spawn_embedded(port, lock), "embedded"
                record = process_record(pid)
                update_state(url=url, redis={**record, "kind": kind, "port": port, **where})
        finally:
            os.close(lock)  # the server holds it now
        ok, last_error = _wait_ping(own_url(url), record, timeout)
        if ok:
            return url, pid
        terminate(pid, record["create_time"], 2.0)
        update_state(redis=None)
    log = logs_dir() / "redis.log"
    raise LocalRedisError(f"local Redis did not start: {last_error} (see {log})")


LOCK_FILE = "server.lock"


def redis_dir() -> Path:
    """The local Redis's data folder (its append-only file, its ACL file, its lock)."""
    return fleet_home() / "redis"


def _claim_data_dir() -> int:
    """Lock the data folder for a new server (the fd to hand it); ``LocalRedisError`` naming
    the server that holds it already."""
    data = redis_dir()
    data.mkdir(parents=True, exist_ok=True)
    fd = os.open(data / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        held = ", ".join(f"{p.name()} pid {p.pid}" for p in data_dir_holders()) or "a process"
        raise LocalRedisError(f"a Redis already runs on {data} ({held}) that no fleet state names "
                              f"(an earlier `fleet up` did not finish): `fleet down` stops it") from None
    return fd


def data_dir_holders() -> list[psutil.Process]:
    """The live processes that hold the data folder's lock open: the server a `fleet up`
    started (and, for a moment, the children it forks to write its files)."""
    path = str(redis_dir() / LOCK_FILE)
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and any(f.path == path for f in proc.open_files()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def stop_local_redis(timeout: float = 10.0) -> bool:
    """Stop the Redis that ``start_local_redis`` recorded (SIGTERM: it writes its AOF); True
    if none is left running."""
    state = read_state() or {}
    local = state.get("redis") or {}
    if not local.get("pid"):
        return True
    gone = terminate(local["pid"], local.get("create_time"), timeout)
    if gone:
        update_state(redis=None)
    return gone


def _require_fakeredis() -> None:
    try:
        import fakeredis  # noqa: F401
    except ImportError:
        raise LocalRedisError(
            "no Redis: set REDIS_URL, install redis-server, or `pip install 'fleet[embedded]'` "
            "for the in-memory fallback"
        ) from None


def own_url(url: str) -> str:
    """The URL ``fleet up`` and ``fleet down`` connect with themselves: as the admin when its
    password is known (the local redis-server runs the roles' ACL), else as ``fleet-operator``
    when that role's is (``stores.roles``), else ``url`` as given."""
    return as_role(url, ADMIN) if role_password(ADMIN) else as_role(url, "fleet-operator")


def _spawn_redis_server(binary: str, port: int, appendfsync: str, lock: int) -> int:
    """A redis-server running Fleet's ACL roles (``fleet acl``): the passwords in
    ``acl-passwords`` (generated, 0600), the ACL file beside its data (0600), the default user
    the admin; each process ``fleet up`` starts connects as its role, and the URL recorded
    (``fleet env``) is the client role's."""
    data = fleet_home() / "redis"
    data.mkdir(parents=True, exist_ok=True)
    passwords = ensure_passwords(default_passwords_path())
    aclfile = data / "users.acl"
    # RQ's queues live here too unless --rq-url names another node: the relay and RQ workers need them
    write_secret(aclfile, acl_file(passwords, default=passwords[ADMIN], shared_with_rq=True))
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes",
            "--appendfsync", appendfsync, "--dir", str(data), "--daemonize", "no", "--aclfile", str(aclfile)]
    return spawn_detached(argv, "redis.log", keep_fd=lock)


def _spawn_embedded(port: int, lock: int) -> int:
    code = f"from fleet.local import serve_embedded; serve_embedded({port})"
    return spawn_detached([sys.executable, "-c", code], "redis.log", keep_fd=lock)


def _wait_ping(url: str, record: dict[str, Any], timeout: float) -> tuple[bool, str]:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=2)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if ping(client):
                    return True, ""
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
                error = str(exc)
            if not pid_alive(record["pid"], record["create_time"]):
                return False, "the server exited at start"
            if time.monotonic() > deadline:
                return False, f"no answer to PING after {timeout:.0f}s ({error})"
            time.sleep(0.05)
    finally:
        client.close()


def serve_embedded(port: int) -> None:
    """Serve an in-memory fakeredis on loopback ``port`` until killed (helper process body)."""
    import fakeredis

    server = fakeredis.TcpFakeServer(("127.0.0.1", port), server_type="redis")
    print(f"embedded fakeredis {fakeredis.__version__} serving on 127.0.0.1:{port}; "
          "NOTHING IS DURABLE", flush=True)
    server.serve_forever()
