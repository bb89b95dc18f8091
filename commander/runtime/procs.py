"""Local worker processes: how a fresh one is started and how a pid is known to still be it.

Shared by the ``process`` runtime and the fork template (``template.py``). Pids are always
checked together with their creation time (or the command line), so a reused pid is never
mistaken for a worker, reported alive or signalled.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from stores import home

TEMPLATE_MODULE = "worker.forkserver"  # in the command line of every forked worker
WORKER_ID = re.compile(r"(?P<tier>[a-z0-9][a-z0-9_-]{0,31})-[0-9a-f]{8}")  # new_worker_id's form


class SpawnError(RuntimeError):
    """A worker process could not be started."""


def worker_command(tier: str, worker_id: str, python: str | None = None) -> list[str]:
    """The argv of a real worker (the contract of ``worker/__main__.py``), run by ``python``
    (a group's virtualenv) or by this interpreter."""
    return [python or sys.executable, "-m", "worker", "--tier", tier, "--worker-id", worker_id]


def rq_worker_command(queues: Sequence[str], worker_id: str) -> list[str]:
    """The argv of an RQ worker of Fleet's (``worker/rq/rq_worker.py``) on ``queues``."""
    return [sys.executable, "-m", "worker.rq.rq_worker", "--queues", ",".join(queues), "--name", worker_id]


def tier_of(worker_id: str) -> str | None:
    """The tier of a worker id the process runtime made (``<tier>-<8 hex>``), else None."""
    m = WORKER_ID.fullmatch(worker_id)
    return m["tier"] if m else None


def child_env(url: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: ``REDIS_URL`` set, the code importable, output unbuffered."""
    return home.child_env({"REDIS_URL": url}, base)


def start_fresh(argv: list[str], env: Mapping[str, str], log_path: Path,
                what: str = "worker") -> subprocess.Popen[bytes]:
    """Start ``argv`` as a fresh process in its own session, output appended to ``log_path``."""
    try:
        with open(log_path, "ab") as out:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=dict(env),
                                    start_new_session=True)
    except OSError as exc:
        raise SpawnError(f"cannot start {what}: {argv[0]}: {exc}") from exc


# --- process identity ----------------------------------------------------------------------
def process_of(pid: int) -> psutil.Process | None:
    """The process ``pid`` with its creation time cached (``is_running()`` compares it later)."""
    try:
        proc = psutil.Process(pid)
        proc.create_time()
        return proc
    except psutil.Error:
        return None


def same_process(pid: int, create_time: float | None) -> psutil.Process | None:
    """The live process ``pid`` if it was created at ``create_time`` (not a reused pid)."""
    proc = process_of(pid)
    if proc is None or not alive(proc):
        return None
    if create_time is not None and abs(proc.create_time() - create_time) > 1.0:
        return None
    return proc


def looks_like_worker(pid: int, worker_id: str, started: float) -> psutil.Process | None:
    """The live process ``pid`` if it is the worker registered at ``started``.

    A worker names its id on its command line: ``--worker-id`` for a fresh one, and every
    worker sets its title to ``fleet-worker <tier> <id>`` once it runs. A forked one that has
    not set it yet carries the template's command line, so it must also have existed before
    the worker registered: a pid reused after the worker died belongs to a process created
    later.
    """
    proc = process_of(pid)
    if proc is None or not alive(proc):
        return None
    try:
        cmdline = proc.cmdline()
    except psutil.AccessDenied:
        return proc if proc.create_time() <= started + 1.0 else None
    except psutil.Error:
        return None
    if worker_id in " ".join(cmdline).split():  # (a title is one argv string with spaces)
        return proc
    forked = TEMPLATE_MODULE in cmdline and proc.create_time() <= started + 1.0
    return proc if forked else None


def looks_like_rq_worker(pid: int, name: str, started: float) -> psutil.Process | None:
    """The live process ``pid`` if it is the RQ worker ``name`` that registered at ``started``.

    Its command line names it: ``--name`` until RQ sets its title, ``rq:worker:<name>: …``
    after; and it existed before it registered (a pid reused later belongs to a newer process).
    """
    proc = process_of(pid)
    if proc is None or not alive(proc) or proc.create_time() > started + 1.0:
        return None
    try:
        words = " ".join(proc.cmdline()).split()
    except psutil.Error:
        return None
    return proc if name in words or f"rq:worker:{name}:" in words else None


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        running: bool = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE  # psutil: untyped
        return running
    except psutil.Error:
        return False


def poll_foreign(pid: int, proc: psutil.Process | None) -> tuple[int | None, bool]:
    """(exit code or None, gone?) for a process that may not be our child."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)  # ours after all (reparented, or a child)?
        if done == pid:
            return os.waitstatus_to_exitcode(status), True
    except ChildProcessError:
        pass
    return None, proc is None or not alive(proc)


def leads_group(pid: int) -> bool:
    """Whether ``pid`` is its process group's leader (so ``killpg`` reaches what it forked)."""
    with contextlib.suppress(OSError):
        return os.getpgid(pid) == pid
    return False
