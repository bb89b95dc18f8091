"""SIGTERM stops a serving worker promptly when its Redis is gone (issue 9, item 8).

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

import pytest
import redis

from protocol import keys
from tests.conftest import RedisServer, free_port
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


def test_a_serving_worker_whose_redis_is_gone_stops_promptly_on_sigterm(tmp_path: Path, fleet_env) -> None:
    server = RedisServer(port=free_port(), workdir=tmp_path)
    server.start()
    env = dict(fleet_env, REDIS_URL=server.url)
    worker = subprocess.Popen([sys.executable, "-m", "worker", "--tier", "chat", "--worker-id", "chat-w1"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        r = redis.Redis.from_url(server.url)
        wait_until(lambda: r.exists(keys.heartbeat("chat-w1")), 20, "the worker serving")
        r.close()
        server.stop(sig_kill=True)
        time.sleep(1.5)  # it notices: its reads fail and it is reconnecting
        began = time.monotonic()
        os.kill(worker.pid, signal.SIGTERM)
        code = worker.wait(timeout=60)
        took = time.monotonic() - began
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        server.stop(sig_kill=True)
    err = worker.stderr.read() if worker.stderr else ""
    assert code == 0, err
    assert took < 5.0, f"{took:.1f} s to stop:\n{err[-2000:]}"  # before: ~11 s
    assert "drained and stopped" in err
