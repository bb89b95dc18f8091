"""SIGTERM stops a serving worker promptly when its Redis is gone.

Before: with Redis killed under it, a worker took ~60 s (later ~11 s) to exit on SIGTERM: its
read of the ready stream sat in the client's reconnect attempts, then the deregistration
retried in turn. Nothing can be finished without Redis, and what it held (lanes, pending
notifications) is the commander's to take over, so it exits within a couple of seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from protocol import keys
from protocol.codec import decode
from protocol.models import OccupancyReport
from tests.conftest import start_on_free_port
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


def _drain(proc: subprocess.Popen[str]) -> str:
    """What the process wrote to stderr (it has exited); the pipe is closed."""
    assert proc.stderr is not None
    with proc.stderr:
        return proc.stderr.read()


def _open(pid: int, port: int) -> int:
    """How many connections to ``port`` process ``pid`` (not its children) holds open. A
    connection whose server died stays open (CLOSE_WAIT) until a read on it fails."""
    live = (psutil.CONN_ESTABLISHED, psutil.CONN_CLOSE_WAIT)
    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.raddr and c.raddr.port == port and c.status in live)


def _reported_ready(r: redis.Redis, worker: str) -> bool:
    for _id, fields in r.xrevrange(keys.REPORTS, count=20):
        report = decode(OccupancyReport, fields[b"m"])
        if report.worker == worker and report.state == "ready":
            return True
    return False


def test_a_serving_worker_whose_redis_is_gone_stops_promptly_on_sigterm(tmp_path: Path, fleet_env) -> None:
    server = start_on_free_port(tmp_path)
    env = dict(fleet_env, REDIS_URL=server.url)
    worker = subprocess.Popen([sys.executable, "-m", "worker", "--tier", "chat", "--worker-id", "chat-w1"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        r = redis.Redis.from_url(server.url)
        # serving = its first "ready" report (the heartbeat alone is set inside the start,
        # whose reply the kill below can still cut: the worker would be starting, not serving)
        wait_until(lambda: _reported_ready(r, "chat-w1"), 20, "the worker serving")
        r.close()
        held = _open(worker.pid, server.port)
        server.stop(sig_kill=True)
        # it notices: a read fails, the connection is closed, and it is reconnecting
        wait_until(lambda: _open(worker.pid, server.port) < held, 20, "the worker to notice Redis is gone")
        began = time.monotonic()
        os.kill(worker.pid, signal.SIGTERM)
        code = worker.wait(timeout=60)
        took = time.monotonic() - began
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        server.stop(sig_kill=True)
    err = _drain(worker)
    assert code == 0, err
    assert took < 5.0, f"{took:.1f} s to stop:\n{err[-2000:]}"  # before: ~11 s
    assert "drained and stopped" in err


def test_a_commander_whose_redis_is_gone_stops_promptly_on_sigterm(tmp_path: Path, fleet_env) -> None:
    """Before: ~13 s (a pass stuck in the client's 8 reconnect attempts, then the lease and the
    registry entry given up through as many). Its workers are left running, by design (a new
    leader adopts them): the test stops them by pid."""
    server = start_on_free_port(tmp_path)
    env = dict(fleet_env, REDIS_URL=server.url)
    commander = subprocess.Popen([sys.executable, "-m", "commander", "--no-metrics", "--log-dir",
                                  str(tmp_path / "logs")], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
    spawned: list[psutil.Process] = []
    try:
        r = redis.Redis.from_url(server.url)
        wait_until(lambda: r.hlen(keys.WORKERS) >= 1, 30, "the commander's first worker")
        r.close()
        spawned = psutil.Process(commander.pid).children(recursive=True)
        held = _open(commander.pid, server.port)
        server.stop(sig_kill=True)
        wait_until(lambda: _open(commander.pid, server.port) < held, 20, "the commander to notice")
        began = time.monotonic()
        commander.send_signal(signal.SIGTERM)
        code = commander.wait(timeout=60)
        took = time.monotonic() - began
    finally:
        if commander.poll() is None:
            commander.kill()
            commander.wait()
        for proc in spawned:
            if proc.is_running():
                proc.kill()
        server.stop(sig_kill=True)
    err = _drain(commander)
    assert code == 0, err
    assert took < 5.0, f"{took:.1f} s to stop:\n{err[-2000:]}"
