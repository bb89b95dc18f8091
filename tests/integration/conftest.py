"""Fixtures for integration tests: real worker processes, started and stopped by pid."""

from __future__ import annotations

import os
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

from protocol import keys
from tests.helpers import wait_until  # (imported from here by many modules)

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


@pytest.fixture
def process_commander(redis_server: Any, tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[ProcessRuntime]:
    """A leading commander on a process runtime, in a thread (workers refresh their policy every
    0.2 s); every worker it started is stopped by pid after the test."""
    from commander.commander import Commander
    from commander.runtime.process import ProcessRuntime
    from commander.settings import CommanderSettings
    from tests.conftest import TEST_WORKER_ENV

    for key, value in {**TEST_WORKER_ENV, "FLEET_WORKER_POLICY_REFRESH_S": "0.2"}.items():
        monkeypatch.setenv(key, value)
    runtime = ProcessRuntime(redis_server.url, log_dir=tmp_path / "logs")
    settings = CommanderSettings(commander_id="c-test", metrics_port=None, interval_s=0.2, always_tiers=())
    stop = threading.Event()
    thread = threading.Thread(target=Commander(redis_server.client(), runtime, settings).run, args=(stop,),
                              daemon=True)
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
