"""Fixtures for integration tests: real worker and commander processes and process runtimes,
started and stopped by pid."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from commander.runtime import Lifecycle, WorkerHandle
from protocol import keys
from stores.registry import read_entries
from tests.browser_driver import Browser, ensure_browser
from tests.helpers import Processes, Started, leads, no_process_left, wait_until  # wait_until: re-exported

if TYPE_CHECKING:
    from commander.runtime.process import ProcessRuntime

# Short leases so a killed worker's user is taken over in seconds, not the production 6 s
# (and, from fleet_env, tests/conftest.py's TEST_WORKER_ENV).
FAST_WORKER_ENV = {
    "FLEET_WORKER_LANE_TTL_MS": "2000",
    "FLEET_WORKER_RENEW_INTERVAL_S": "0.4",
    "FLEET_WORKER_RECLAIM_IDLE_MS": "2000",
    "FLEET_WORKER_RECLAIM_INTERVAL_S": "0.3",
    "FLEET_WORKER_HOUSEKEEPING_INTERVAL_S": "1",
}


@dataclass
class WorkerProc:
    worker_id: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def start_worker(fleet_env: dict[str, str], r: redis.Redis,
                 tmp_path: Path) -> Iterator[Callable[..., WorkerProc]]:
    """Factory: start a real worker process; every one is stopped (by pid) after the test."""
    started: list[WorkerProc] = []

    def start(tier: str = "chat", worker_id: str | None = None,
              env: dict[str, str] | None = None) -> WorkerProc:
        wid = worker_id or f"{tier}-t{len(started)}-{os.getpid() % 10000}"
        log = tmp_path / f"{wid}.log"
        full_env = {**fleet_env, **FAST_WORKER_ENV, **(env or {})}
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "worker", "--tier", tier, "--worker-id", wid],
                                    env=full_env, stdout=out, stderr=subprocess.STDOUT)
        wp = WorkerProc(wid, proc, log)
        started.append(wp)
        wait_until(lambda: r.exists(keys.heartbeat(wid)) or proc.poll() is not None, 20,
                   f"worker {wid} to register")
        assert proc.poll() is None, f"worker {wid} exited: {log.read_text()[-2000:]}"
        return wp

    yield start
    for wp in started:
        if wp.proc.poll() is None:
            wp.proc.terminate()
    for wp in started:
        try:
            wp.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            wp.proc.kill()
            wp.proc.wait(timeout=5)


def _worker_pids(r: redis.Redis) -> set[int]:
    return {info.pid for info in read_entries(r)[0]}


@pytest.fixture
def start_commander(fleet_env: dict[str, str], r: redis.Redis,
                    processes: Processes) -> Iterator[Callable[..., Started]]:
    """Factory: a commander process (``commander_argv``, the fast worker leases, ``env`` over
    them), waited on until it leads unless not ``lead``. After the test every commander is
    stopped (standbys first) and no worker they started may be left running."""
    def start(commander_id: str = "c1", *flags: str, env: dict[str, str] | None = None,
              lead: bool = True, metrics: bool = False) -> Started:
        started = processes.commander({**fleet_env, **FAST_WORKER_ENV, **(env or {})}, commander_id, *flags,
                                      metrics=metrics)
        if lead:
            wait_until(lambda: leads(r, commander_id) or not started.alive(), 15, f"{commander_id} to lead")
            assert started.alive(), started.tail()
        return started

    yield start
    pids = _worker_pids(r)
    processes.stop_all()
    no_process_left(pids | _worker_pids(r), within_s=0)


@pytest.fixture
def make_runtime(redis_server: Any, r: redis.Redis,
                 tmp_path: Path) -> Iterator[Callable[..., ProcessRuntime]]:
    """Factory of process runtimes (logging to ``tmp_path/logs`` unless told); at the end every
    worker they track is stopped, and no worker or fork template may be left running."""
    from commander.runtime.process import ProcessRuntime

    made: list[ProcessRuntime] = []
    pids: set[int] = set()

    def templates() -> set[int]:
        return {rt.spawner.template.pid for rt in made if rt.spawner.template is not None
                and rt.spawner.template.pid}

    def make(**kwargs: Any) -> ProcessRuntime:
        kwargs.setdefault("log_dir", tmp_path / "logs")
        # the runtime reads Redis as the commander it serves; its workers connect as workers
        kwargs.setdefault("client", redis.Redis.from_url(redis_server.role_url("fleet-commander")))
        made.append(ProcessRuntime(redis_server.role_url("fleet-worker"), **kwargs))
        pids.update(templates())
        return made[-1]

    yield make
    pids.update(templates())
    for rt in made:
        pids.update(h.pid for h in rt.list())
        rt.stop_all(timeout=2.0)
    for rt in made:
        rt.reap()  # collects the zombies of workers another runtime stopped
        rt.close()
    no_process_left(pids, within_s=0)


def share_proof(run_dir: Path, other: Path) -> None:
    """Give the run dir ``other`` the spawn proof of ``run_dir``'s runtime: a commander of the same
    host that lost its run records (it adopts from the registry)."""
    from commander.runtime.process.proof import PROOF_FILE

    other.mkdir(parents=True, exist_ok=True)
    shutil.copy(run_dir / PROOF_FILE, other / PROOF_FILE)


def wait_running(rt: ProcessRuntime, ids: list[str], timeout: float = 20.0) -> None:
    """Reap until every worker of ``ids`` is running (registered with a heartbeat)."""
    def all_running() -> bool:
        rt.reap()
        states = {h.worker_id: h.state for h in rt.list()}
        return all(states.get(i) is Lifecycle.RUNNING for i in ids)

    wait_until(all_running, timeout, f"{ids} to run")


def reap_until_exited(rt: ProcessRuntime, worker_id: str, timeout: float = 20.0) -> WorkerHandle:
    """Reap until ``worker_id`` has exited; its last handle."""
    gone: list[WorkerHandle] = []

    def exited() -> bool:
        gone.extend(h for h in rt.reap() if h.worker_id == worker_id)
        return bool(gone)

    wait_until(exited, timeout, f"{worker_id} to exit")
    return gone[0]


@pytest.fixture
def group_runtimes() -> dict[str, Any]:
    """The group runtimes ``process_commander`` allows (its ``group_runtimes`` setting): none
    unless a module overrides this fixture."""
    return {}


@pytest.fixture
def process_commander(redis_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      group_runtimes: dict[str, Any]) -> Iterator[ProcessRuntime]:
    """A leading commander on a process runtime, in a thread (workers refresh their policy every
    0.2 s), allowing ``group_runtimes``; every worker it started is stopped by pid after the test."""
    from commander.commander import Commander
    from commander.runtime.process import ProcessRuntime
    from commander.settings import CommanderSettings
    from tests.conftest import TEST_WORKER_ENV

    for key, value in {**TEST_WORKER_ENV, "FLEET_WORKER_POLICY_REFRESH_S": "0.2"}.items():
        monkeypatch.setenv(key, value)
    # a 10 s lease: an interpreter's check may take 8 s (0.8 of it) on a loaded test machine
    settings = CommanderSettings(commander_id="c-test", metrics_port=None, interval_s=0.2, always_tiers=(),
                                 lease_ttl_ms=10_000, group_runtimes=group_runtimes)
    runtime = ProcessRuntime(redis_server.role_url("fleet-worker"), log_dir=tmp_path / "logs",
                             client=redis.Redis.from_url(redis_server.role_url("fleet-commander")),
                             group_runtimes=settings.group_runtimes,
                             check_timeout_s=settings.check_timeout_s())
    stop = threading.Event()
    commander = Commander(redis.Redis.from_url(redis_server.role_url("fleet-commander")), runtime, settings)
    thread = threading.Thread(target=commander.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield runtime
    finally:
        stop.set()
        thread.join(timeout=30)
        runtime.stop_all(timeout=5.0)
        runtime.reap()
        runtime.close()
    assert not thread.is_alive()


def wait_workers_saw(runtime: ProcessRuntime, r: redis.Redis, text: str, what: str,
                     timeout: float = 30) -> None:
    """Wait until every live worker (the registry's) has ``text`` in its log: its policy refresh
    saw a change (a worker hands a user on by its own view of the weights)."""
    from stores.registry import read_registry

    def saw() -> bool:
        live = [wid for wid, (_info, alive) in read_registry(r).workers.items() if alive]
        return bool(live) and all(text in (runtime.log_dir / f"{w}.log").read_text() for w in live)
    wait_until(saw, timeout, what)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    """Debian's chromium, headless, through playwright-core (``tests.browser_driver``)."""
    node, chromium = ensure_browser()
    b = Browser(node, chromium, tmp_path / "browser.log")
    yield b
    b.close()
