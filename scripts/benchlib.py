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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


MAX_LOAD_AT_START = 1.5  # a run that starts above this load average is invalid
SETTLED_LOAD = 1.0  # settle_load waits for the load average to fall to this


def settle_load(max_wait_s: float = 240.0, every_s: float = 5.0) -> float:
    """Wait until the 1-minute load average is at most ``SETTLED_LOAD`` (at most ``max_wait_s``)
    and return it. The load average lags by about a minute: a benchmark run right after another
    starts at that one's load and is invalid by its own watch, though the machine is quiet."""
    deadline = time.monotonic() + max_wait_s
    load = os.getloadavg()[0]
    while load > SETTLED_LOAD and time.monotonic() < deadline:
        print(f"   waiting for the load average to settle: {load:.2f}", flush=True)
        time.sleep(every_s)
        load = os.getloadavg()[0]
    return load
MAX_OTHERS_SHARE = 0.10  # ... and one in which other processes used more than this of a core


@dataclass
class Phase:
    """One phase of a benchmark as the machine saw it: how long it took and the CPU seconds
    processes outside the benchmark used meanwhile."""

    name: str
    started: float
    seconds: float = 0.0
    others_cpu_s: float = 0.0
    ended: bool = False

    @property
    def others_share(self) -> float:
        """Of one core, what other processes used during the phase."""
        return self.others_cpu_s / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, object]:
        return {"name": self.name, "seconds": round(self.seconds, 1),
                "others_cpu_share_of_a_core": round(self.others_share, 3)}


class MachineWatch:
    """Whether the machine was quiet while a benchmark ran. On two cores anything else running
    makes every figure meaningless, so each benchmark records the load average when it starts
    and, every second, the CPU time that processes outside its own tree (itself and its
    descendants: workers, redis-servers, peers) used, per phase. A run that started above a
    load average of ``MAX_LOAD_AT_START``, or in one of whose phases others used more than
    ``MAX_OTHERS_SHARE`` of a core, is invalid: its verdict says so, and the benchmark leaves it
    out of ratios."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.load_at_start = os.getloadavg()
        self.interval_s = interval_s
        self.phases: list[Phase] = []
        self._open: list[Phase] = [Phase("whole run", time.monotonic())]
        self._seen = self._others()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="machine-watch", daemon=True)
        self._thread.start()

    @staticmethod
    def _others() -> dict[tuple[int, float], float]:
        """(pid, start time) -> CPU seconds so far, of every process outside this one's tree."""
        me = psutil.Process()
        mine = {me.pid} | {c.pid for c in me.children(recursive=True)}
        out = {}
        for proc in psutil.process_iter(["pid", "create_time", "cpu_times"]):
            info = proc.info
            if info["pid"] in mine or info["cpu_times"] is None:
                continue
            out[(info["pid"], info["create_time"])] = info["cpu_times"].user + info["cpu_times"].system
        return out

    def _sample(self) -> None:
        now = self._others()
        used = sum(cpu - self._seen.get(key, 0.0) for key, cpu in now.items())  # (new ones: all of theirs)
        self._seen = now
        with self._lock:
            for phase in self._open:
                phase.others_cpu_s += max(0.0, used)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(psutil.Error):
                self._sample()

    @contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        """Watch the ``with`` block as a phase named ``name``."""
        with contextlib.suppress(psutil.Error):
            self._sample()  # what came before is not this phase's
        phase = Phase(name, time.monotonic())
        with self._lock:
            self._open.append(phase)
        try:
            yield phase
        finally:
            with contextlib.suppress(psutil.Error):
                self._sample()
            with self._lock:
                self._open.remove(phase)
            phase.seconds, phase.ended = time.monotonic() - phase.started, True
            self.phases.append(phase)

    def invalid_because(self, phases: list[Phase] | None = None) -> list[str]:
        """Why the run (or only ``phases`` of it) is invalid; [] if it is not."""
        why = []
        if self.load_at_start[0] > MAX_LOAD_AT_START:
            why.append(f"load average {self.load_at_start[0]:.2f} at the start (over {MAX_LOAD_AT_START})")
        for phase in self.phases if phases is None else phases:
            if phase.others_share > MAX_OTHERS_SHARE:
                why.append(f"other processes used {phase.others_share:.0%} of a core during {phase.name!r} "
                           f"(over {MAX_OTHERS_SHARE:.0%})")
        return why

    def verdict(self) -> dict[str, object]:
        """The machine's record of the run so far: the load at the start, each phase, and
        whether the run is valid (and if not, why)."""
        whole = self._open[0]
        with contextlib.suppress(psutil.Error):
            self._sample()
        whole.seconds = time.monotonic() - whole.started
        why = self.invalid_because([*self.phases, whole])
        return {"load_average_at_start": [round(x, 2) for x in self.load_at_start],
                "phases": [p.summary() for p in [*self.phases, whole]], "valid": not why,
                "invalid_because": why}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def emit(result: object, path: Path | None, watch: MachineWatch | None = None) -> None:
    """Print the result as one JSON line (and write it, indented, to ``path`` if given); with
    ``watch``, the machine's verdict goes in it as ``machine``, and an invalid run says so on
    stderr."""
    if watch is not None and isinstance(result, dict):
        result["machine"] = verdict = watch.verdict()
        watch.close()
        if not verdict["valid"]:
            print("THIS RUN IS INVALID (the machine was not quiet): " + "; ".join(verdict["invalid_because"]),
                  file=sys.stderr, flush=True)
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


def result_path(raw: Path, step: str) -> Path:
    """Where ``scripts/bench`` keeps a step's JSON result under its raw directory."""
    return raw / {"trace": "trace/trace.json", "scaling": "scaling/scaling.json"}.get(step, f"{step}.json")
