"""What many test modules do the same way: wait on a condition, run the ``fleet`` CLI, start
and stop processes (a commander, a relay) by pid, read the ledger and the registry, make a
virtualenv."""

from __future__ import annotations

import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import redis

from protocol import keys
from protocol.codec import decode, encode
from protocol.models import CommanderInfo, LedgerEvent, WorkerInfo
from stores.registry import read_entries


def wait_until(predicate: Callable[[], object], timeout: float, what: str, every: float = 0.05) -> object:
    """Poll ``predicate`` until it is truthy; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def fleet_argv(*args: str) -> list[str]:
    """``fleet ARGS`` as a child process's command line: this interpreter running ``fleet.cli``."""
    return [sys.executable, "-m", "fleet.cli", *args]


def fleet_cli(env: dict[str, str], *args: str, cwd: Path | None = None, stdin: str | None = None,
              timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``fleet ARGS`` in a child interpreter, with ``env``; its output captured as text."""
    return subprocess.run(fleet_argv(*args), env=env, cwd=cwd, text=True, capture_output=True,
                          timeout=timeout, input=stdin)


# --- processes ----------------------------------------------------------------------------------
def commander_argv(commander_id: str, log_dir: Path, *flags: str, metrics: bool = False) -> list[str]:
    """A test's commander: a pass every 0.2 s, its workers' logs in ``log_dir``, its workers
    stopped when it exits, no /metrics unless ``metrics``; ``flags`` add to (or override) these."""
    return ["-m", "commander", "--commander-id", commander_id, *([] if metrics else ["--no-metrics"]),
            "--interval", "0.2", "--log-dir", str(log_dir), "--stop-workers-on-exit", *flags]


@dataclass
class Started:
    """A process a test started, and the file its stdout and stderr go to."""

    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Processes:
    """The processes a test starts (``python ARGV``, each logging to ``<dir>/<name>.log``, in
    ``cwd`` unless told), stopped by pid when it ends (``stop_all``): SIGTERM, then SIGKILL
    after ``grace_s``."""

    dir: Path
    grace_s: float = 40.0
    cwd: Path | None = None
    started: list[Started] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> Started:
        log = self.dir / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=cwd or self.cwd)
        self.started.append(Started(proc, log))
        return self.started[-1]

    def commander(self, env: dict[str, str], commander_id: str = "c1", *flags: str,
                  metrics: bool = False) -> Started:
        """A commander (``commander_argv``), logging to ``commander-<id>.log``."""
        argv = commander_argv(commander_id, self.dir / "logs", *flags, metrics=metrics)
        return self.start(f"commander-{commander_id}", argv, env)

    def logs(self) -> str:
        """Every log below the folder (the processes' and their workers')."""
        return "".join(p.read_text(errors="replace") for p in sorted(self.dir.rglob("*.log")))

    def stop_all(self) -> None:
        """Last started first (a standby commander before the leader stopping the fleet)."""
        for s in reversed(self.started):
            if s.alive():
                s.proc.send_signal(signal.SIGTERM)
        for s in reversed(self.started):
            try:
                s.proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait(timeout=5)


def leads(r: redis.Redis, commander_id: str) -> bool:
    """Whether ``commander_id`` holds the leader lease."""
    return (r.get(keys.LEADER) or b"").startswith(f"{commander_id}|".encode())


def passes(r: redis.Redis, n: int, commander: str | None = None, timeout: float = 30) -> None:
    """Wait until the leader (or ``commander``) has run ``n`` more passes: it registers after each."""
    name = commander or (r.get(keys.LEADER) or b"").decode().split("|")[0]
    seen: set[float] = set()

    def more() -> bool:
        raw = r.hget(keys.COMMANDERS, name)
        if raw:
            seen.add(decode(CommanderInfo, raw).seen)
        return len(seen) > n

    wait_until(more, timeout, f"{n} passes of commander {name!r}")


def no_process_left(pids: Iterable[int], within_s: float = 15.0) -> None:
    """Fail, after SIGKILLing them, if any of ``pids`` still runs ``within_s`` from now."""
    pids = set(pids)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if running(p)]
    for pid in left:
        psutil.Process(pid).kill()
    assert not left, f"processes left behind: {left}"


def running(pid: int) -> bool:
    """Whether ``pid`` runs: alive and not a zombie (an orphan's zombie may never be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- what Fleet wrote ---------------------------------------------------------------------------
def ledger(r: redis.Redis, tier: str | None = None, *actions: str) -> list[LedgerEvent]:
    """The scaling ledger, oldest first: of ``tier`` (None: every tier), of ``actions`` (none: all)."""
    events = (decode(LedgerEvent, fields[b"m"]) for _id, fields in r.xrange(keys.EVENTS))
    return [e for e in events if (tier is None or e.tier == tier) and (not actions or e.action in actions)]


def register(r: redis.Redis, worker: str, tier: str = "chat", alive: bool = True,
             started: float | None = None) -> None:
    """A worker's registry entry as a worker writes it (started a minute ago unless ``started``),
    with a live heartbeat unless not ``alive``."""
    info = WorkerInfo(worker=worker, tier=tier, pid=4242, host="h",
                      started=time.time() - 60 if started is None else started)
    r.hset(keys.WORKERS, worker, encode(info))
    r.incr(keys.WORKERS_VERSION)  # (as a worker registering does)
    if alive:
        r.set(keys.heartbeat(worker), "1", ex=60)


def live_workers(r: redis.Redis, tier: str | None = None) -> list[WorkerInfo]:
    """The registry's workers (of ``tier``) whose heartbeat is alive."""
    infos, _ = read_entries(r)
    return [i for i in infos if (tier is None or i.tier == tier) and r.exists(keys.heartbeat(i.worker))]


# --- virtualenvs --------------------------------------------------------------------------------
def offline_venv(root: Path) -> Path:
    """A virtualenv at ``root`` made offline (no pip), seeing this environment's installed
    packages through a ``.pth`` file; its interpreter."""
    base = sys._base_executable  # type: ignore[attr-defined]
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([str(python), "-c", probe], check=True, capture_output=True,
                             text=True).stdout.strip()
    Path(purelib, "fleet_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def venv_install(python: Path, *paths: Path) -> None:
    """Install the packages at ``paths`` into ``python``'s virtualenv with this environment's pip,
    offline (no index, no dependencies, no build isolation)."""
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                           "--no-index", "--no-deps", "--no-build-isolation", *map(str, paths)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
