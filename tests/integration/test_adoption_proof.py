"""The process runtime adopts, and so may signal, only processes that prove this host's commanders
started them (the spawn proof in their environment): a registry entry or a run record naming
another process of the same user, even one whose command line carries the worker id, is left
alone past the no-heartbeat deadline, warned about once, ledgered and counted; a restarted
commander still adopts the workers its predecessor started."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from commander.commander import Commander
from commander.metrics import Metrics, sample
from commander.runtime import Lifecycle, WorkerHandle
from commander.runtime.process import ProcessRuntime
from commander.runtime.process.run_records import write_record
from commander.settings import CommanderSettings
from protocol import keys
from protocol.codec import encode
from protocol.models import WorkerInfo
from tests.helpers import ledger, passes, running, wait_until
from tests.integration.conftest import share_proof, wait_running

pytestmark = pytest.mark.integration
FORGED = "chat-0badf00d"


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of the test's user that Fleet did not start, the forged worker id on its
    command line; killed by pid after the test."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "--worker-id", FORGED],
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def forge_entry(r: redis.Redis, pid: int, worker: str = FORGED) -> None:
    """A registry entry naming ``pid`` on this host, as a worker of the process runtime writes it."""
    started = psutil.Process(pid).create_time() + 0.5  # registered just after it started
    info = WorkerInfo(worker=worker, tier="chat", pid=pid, host=socket.gethostname(), started=started)
    r.hset(keys.WORKERS, worker, encode(info))


def test_a_forged_entry_and_record_are_never_adopted_nor_signalled(
        make_runtime: Any, r: redis.Redis, bystander: subprocess.Popen[bytes],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="commander.runtime.process.runtime")
    rt: ProcessRuntime = make_runtime(start_timeout_s=0.3)  # an adopted worker not beating: killed at 0.3 s
    forge_entry(r, bystander.pid)
    proc = psutil.Process(bystander.pid)
    write_record(rt.workers.run_dir, WorkerHandle("chat-0000cafe", "chat", bystander.pid, Lifecycle.RUNNING,
                                                  proc.create_time()), proc)  # a run record too
    assert rt.adopt() == [] and rt.list() == []
    notes = rt.notes()
    assert sorted((n.action, n.workers) for n in notes) == [
        ("unproven-process", ("chat-0000cafe",)), ("unproven-process", (FORGED,))]
    assert all(f"pid {bystander.pid}" in n.reason and "spawn proof (missing)" in n.reason for n in notes)

    deadline = time.monotonic() + 1.5  # five times the no-heartbeat deadline of an adopted worker
    while time.monotonic() < deadline:  # (the deadline is what is tested: it must pass)
        assert rt.adopt() == [] and rt.reap() == []
        time.sleep(0.05)
    assert bystander.poll() is None and running(bystander.pid)  # never signalled
    assert rt.notes() == []  # reported once per worker id and pid
    assert caplog.text.count(f"pid {bystander.pid}") == 2


def test_a_restarted_commander_still_adopts_its_predecessors_workers(make_runtime: Any, r: redis.Redis,
                                                                      tmp_path: Path) -> None:
    first = make_runtime()
    ids = first.spawn("chat", 1) + make_runtime(spawn_mode="exec").spawn("chat", 1)  # forked, and fresh
    wait_running(first, ids[:1])
    # a restart: a new runtime on the same run dir (the same proof); then one whose run records
    # are gone (the registry names the workers) but whose proof file is kept
    assert {h.worker_id for h in make_runtime().adopt()} == set(ids)
    other = tmp_path / "other-run"
    share_proof(tmp_path / "run", other)
    wait_until(lambda: r.hlen(keys.WORKERS) == 2, 30, "both registered")
    assert {h.worker_id for h in make_runtime(run_dir=other).adopt()} == set(ids)
    # another host's proof (a run dir of its own): nothing is adopted, both are reported
    stranger = make_runtime(run_dir=tmp_path / "stranger-run")
    assert stranger.adopt() == [] and {n.workers for n in stranger.notes()} == {(i,) for i in ids}


def test_the_commander_ledgers_and_counts_a_process_it_cannot_prove(
        redis_server: Any, r: redis.Redis, tmp_path: Path, bystander: subprocess.Popen[bytes]) -> None:
    forge_entry(r, bystander.pid)
    runtime = ProcessRuntime(redis_server.url, log_dir=tmp_path / "logs", start_timeout_s=0.3)
    metrics = Metrics()
    settings = CommanderSettings(commander_id="c-proof", metrics_port=None, interval_s=0.2)
    stop = threading.Event()
    thread = threading.Thread(target=Commander(redis_server.client(), runtime, settings, metrics).run,
                              args=(stop,), daemon=True)
    thread.start()
    try:
        (event,) = wait_until(lambda: ledger(r, "chat", "unproven-process"), 20, "the process ledgered")
        assert event.victims == [FORGED] and f"pid {bystander.pid}" in event.reason
        # (counted after the ledger append, on the commander's thread: wait for it, too)
        wait_until(lambda: sample(metrics, "fleet_unproven_processes_total") == 1.0, 5, "the process counted")
        passes(r, 10, "c-proof")  # 2 s of passes: well past the 0.3 s deadline of an adopted worker
        assert bystander.poll() is None and not [h for h in runtime.list() if h.worker_id == FORGED]
        assert len(ledger(r, "chat", "unproven-process")) == 1
    finally:
        stop.set()
        thread.join(timeout=30)
        runtime.stop_all(timeout=5.0)
        runtime.close()
    assert bystander.poll() is None
