"""Shared pieces of the benchmark scripts: a private redis-server, worker processes, stats."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import redis

ROOT = Path(__file__).resolve().parents[1]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server(appendfsync: str = "everysec") -> Iterator[str]:
    """A private redis-server on a free loopback port; yields its URL, stops it after."""
    binary = shutil.which("redis-server")
    if not binary:
        sys.exit("redis-server is not installed (scripts/setup installs it)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "yes", "--appendfsync", appendfsync, "--dir", tmp],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            from stores import functions

            functions.install(client)  # Fleet's functions library, as an admin would (`fleet install`)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@contextmanager
def worker_processes(url: str, n: int, tier: str = "chat", log_dir: Path | None = None,
                     extra_env: dict[str, str] | None = None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` worker processes of ``tier``; drained (SIGTERM) and reaped afterwards."""
    env = {**os.environ, "REDIS_URL": url, "PYTHONPATH": str(ROOT), **(extra_env or {})}
    procs = []
    logs = []
    try:
        for i in range(n):
            log = open(log_dir / f"worker-{i}.log", "wb") if log_dir else subprocess.DEVNULL  # noqa: SIM115
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "worker", "--tier", tier,
                                           "--worker-id", f"{tier}-bench{i}", "--log-level", "WARNING"],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
        r = redis.Redis.from_url(url)
        deadline = time.monotonic() + 20
        while r.hlen("fleet:workers") < n:
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not register")
            time.sleep(0.05)
        yield procs
    finally:
        stop_processes(procs, timeout=15)
        for log in logs:
            if log is not subprocess.DEVNULL:
                log.close()


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout: float = 20) -> None:
    """SIGTERM every process (and remember their children), SIGKILL what is left after
    ``timeout``, then the children that outlived their parent."""
    descendants: list[psutil.Process] = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            descendants += psutil.Process(p.pid).children(recursive=True)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
            child.kill()
            child.wait(5)


def emit(result: object, path: Path | None) -> None:
    """Print the result as one JSON line (and write it, indented, to ``path`` if given)."""
    if path is not None:
        path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]
