"""Whether a pid is still the worker it was: pids are always checked together with their
creation time (or the command line), so a reused pid is never mistaken for a worker, reported
alive or signalled. psutil, because a forked or adopted worker is not our child."""

from __future__ import annotations

import contextlib
import os

import psutil

from commander.runtime.process.launch import FORK_TEMPLATE_MODULE


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
    except psutil.Error:  # (another user's process, or gone: not a worker of ours)
        return None
    if worker_id in " ".join(cmdline).split():  # (a title is one argv string with spaces)
        return proc
    forked = FORK_TEMPLATE_MODULE in cmdline and proc.create_time() <= started + 1.0
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
