"""The local workers the ``process`` runtime tracks, and what it does to them.

For each: its exit status (our child's ``poll``; a forked one's code as its template reports
it; an adopted one watched with psutil), its registration (starting until it is in the registry
with a heartbeat, or in RQ's for an RQ worker), its drain (a drain command on its control
stream, else SIGTERM; SIGKILL of its process group once the deadline has passed), its run
record under ``run_dir`` (pid + creation time, for the next commander to adopt it), and the
registry entries a killed worker could not remove.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import redis

from commander.runtime.interface import Handles, Lifecycle, UnknownWorker, WorkerHandle
from commander.runtime.process.fork_client import TemplateSpawner
from commander.runtime.process.identity import leads_group, poll_foreign
from commander.runtime.process.run_records import drop_record, write_record
from protocol.models import Control, exit_meaning
from stores.control import send_control
from stores.registry import forget_workers, registered_and_beating, rq_registered
from stores.retry import TRANSIENT

log = logging.getLogger(__name__)
KILL_WAIT_S = 5.0  # how long stop_all waits for a SIGKILLed process to vanish
EXIT_REPORT_WAIT_S = 0.2  # how long to wait for the template's report of a forked worker's exit
CONTROL_MAXLEN = 64
START_TIMEOUT = "start timeout"  # the retire reason of a worker killed for not registering in time


@dataclass
class Tracked:
    """One worker: its handle and how to watch its process."""

    handle: WorkerHandle
    proc: psutil.Process | None  # None when it died before we could look at it
    popen: subprocess.Popen[bytes] | None = None  # only for our own children
    start_mono: float = 0.0
    template: TemplateSpawner | None = None  # the template that forked it (reports its exit)
    rq: bool = False  # an RQ worker (worker.rq.rq_worker): up once in RQ's registry, retired by SIGTERM


class LocalWorkers:
    """The tracked workers by id. Not thread-safe, but for ``handles`` and ``any_exited`` (a
    monitor thread may call them while the loop acts)."""

    def __init__(self, run_dir: Path, r: redis.Redis, rq: redis.Redis, *,
                 drain_timeout: Callable[[str], float], start_timeout_s: float) -> None:
        """``r``: Fleet's Redis; ``rq``: RQ's (RQ workers' registry), else the same;
        ``drain_timeout``: a tier's drain timeout in seconds."""
        self.run_dir, self.r, self.rq = run_dir, r, rq
        self.drain_timeout, self.start_timeout_s = drain_timeout, start_timeout_s
        self._tracked: dict[str, Tracked] = {}
        self._unclean: set[str] = set()  # exited workers whose registry entry is still to remove

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._tracked

    def add(self, tracked: Tracked) -> None:
        """Track a worker (spawned or adopted) and write its run record."""
        self._tracked[tracked.handle.worker_id] = tracked
        write_record(self.run_dir, tracked.handle, tracked.proc, rq=tracked.rq)

    def forget(self, worker_id: str, registry: bool = True) -> None:
        """Drop a gone worker's run record; with ``registry``, its registry entry too (later,
        by ``clean_registry``)."""
        drop_record(self.run_dir, worker_id)
        if registry:
            self._unclean.add(worker_id)

    # --- observe -------------------------------------------------------------------------
    def handles(self) -> Handles:
        """Copies of every tracked worker's handle (exit status refreshed, no Redis I/O)."""
        tracked_now = list(self._tracked.values())  # a snapshot: a monitor thread may call this
        for tracked in tracked_now:
            self._poll(tracked)
        return [replace(t.handle) for t in tracked_now]

    def any_exited(self) -> bool:
        """Whether a tracked worker has exited since the last ``reap`` (no copies, no Redis I/O)."""
        found = False
        for tracked in list(self._tracked.values()):
            self._poll(tracked)
            found = found or tracked.handle.state is Lifecycle.EXITED
        return found

    def reap(self) -> Handles:
        """Collect exits, kill overdue drains and stuck starts, note registrations."""
        now = time.monotonic()
        for tracked in self._tracked.values():
            self._poll(tracked)
        registry_ok = self.note_registrations()
        for tracked in self._tracked.values():
            self._enforce_deadlines(tracked, now, check_start=registry_ok)
        exited = [t for t in self._tracked.values() if t.handle.state is Lifecycle.EXITED]
        for tracked in exited:
            del self._tracked[tracked.handle.worker_id]
            self.forget(tracked.handle.worker_id)
        self.clean_registry()
        return [replace(t.handle) for t in exited]

    def note_registrations(self) -> bool:
        """Promote starting workers that registered with a heartbeat; False if Redis is down."""
        starting = [t for t in self._tracked.values() if t.handle.state is Lifecycle.STARTING]
        if not starting:
            return True
        try:  # Fleet's workers: in the registry with a heartbeat; RQ workers: in RQ's registry
            fleet_ = registered_and_beating(self.r, [t.handle.worker_id for t in starting if not t.rq])
            rq_ = rq_registered(self.rq, [t.handle.worker_id for t in starting if t.rq])
        except TRANSIENT as exc:
            log.debug("registry not readable, registrations not checked: %s", exc)
            return False
        answers = [(rq_ if t.rq else fleet_).pop(0) for t in starting]
        for handle, registered in zip((t.handle for t in starting), answers, strict=True):
            if registered:
                handle.state = Lifecycle.RUNNING
                log.info("worker %s (tier %s) is running", handle.worker_id, handle.tier)
        return True

    def clean_registry(self) -> None:
        """Remove what a killed worker could not: registry entry, heartbeat, control stream."""
        if not self._unclean:
            return
        ids = sorted(self._unclean)
        try:
            forget_workers(self.r, ids)
        except TRANSIENT as exc:
            log.debug("registry cleanup of %d workers postponed: %s", len(ids), exc)
            return
        self._unclean.clear()

    def _poll(self, tracked: Tracked) -> None:
        handle = tracked.handle
        if handle.state is Lifecycle.EXITED:
            return
        if tracked.popen is not None:
            code = tracked.popen.poll()
            if code is not None:
                self._mark_exited(handle, code)
            return
        template = tracked.template  # forked: the template reaps it and reports its exit code
        code = template.exit_code(handle.pid) if template is not None else None
        if code is None:
            code, gone = poll_foreign(handle.pid, tracked.proc)
            if not gone:
                return
            if code is None and template is not None:
                code = template.exit_code(handle.pid, wait_s=EXIT_REPORT_WAIT_S)
        self._mark_exited(handle, code)

    @staticmethod
    def _mark_exited(handle: WorkerHandle, code: int | None) -> None:
        prior = handle.state
        handle.state, handle.exit_code = Lifecycle.EXITED, code
        # a clean drain acked or handed on all it had; any other end (a crash, SIGKILL, an
        # unknown exit status) leaves its users to the commander's takeover
        handle.drained = prior is Lifecycle.DRAINING and not handle.killed and code == 0
        how = "was killed" if handle.killed else f"exited with {exit_meaning(code)}"
        if prior is Lifecycle.DRAINING and not handle.killed:
            log.info("worker %s (tier %s) drained and %s", handle.worker_id, handle.tier, how)
        else:
            log.warning("worker %s (tier %s, pid %d, %s) %s", handle.worker_id, handle.tier,
                        handle.pid, prior.value, how)

    def _enforce_deadlines(self, tracked: Tracked, now: float, check_start: bool = False) -> None:
        """Kill a drain past its deadline; with ``check_start``, a start that never registered."""
        handle = tracked.handle
        overdue = handle.kill_at is not None and now >= handle.kill_at
        if handle.state is Lifecycle.DRAINING and overdue:
            if not handle.killed:
                log.warning("worker %s did not drain in time: SIGKILL", handle.worker_id)
            self._kill(tracked)
        elif check_start and handle.state is Lifecycle.STARTING \
                and now - tracked.start_mono > self.start_timeout_s:
            log.warning("worker %s did not register within %.0fs: SIGKILL", handle.worker_id,
                        self.start_timeout_s)
            handle.retire_reason = START_TIMEOUT
            self._kill(tracked)

    # --- drain and stop ------------------------------------------------------------------
    def retire(self, worker_id: str, reason: str, drain_timeout_s: float | None) -> None:
        """Drain a worker now; ``reap()`` kills it if it is still alive after the timeout
        (``None``: its tier's). Retiring twice is a no-op."""
        tracked = self._tracked.get(worker_id)
        if tracked is None:
            raise UnknownWorker(worker_id)
        handle = tracked.handle
        self._poll(tracked)
        if handle.state in (Lifecycle.DRAINING, Lifecycle.EXITED):
            return
        timeout = self.drain_timeout(handle.tier) if drain_timeout_s is None else drain_timeout_s
        was_starting = handle.state is Lifecycle.STARTING
        handle.state, handle.retire_reason = Lifecycle.DRAINING, reason
        handle.kill_at = time.monotonic() + timeout
        sent = not tracked.rq and self._send_drain(handle.worker_id, reason)  # RQ's warm shutdown: SIGTERM
        if not sent or was_starting:
            # a starting worker may not read its control stream yet; it holds no work either
            self._signal(tracked, signal.SIGTERM)
        log.info("retiring worker %s (tier %s, pid %d): %s; killed in %.1fs if still alive",
                 handle.worker_id, handle.tier, handle.pid, reason or "no reason given", timeout)

    def stop_all(self, timeout: float | None) -> None:
        """Drain every worker (control stream and SIGTERM), wait, SIGKILL the rest."""
        now = time.monotonic()
        for tracked in self._tracked.values():
            self._poll(tracked)
            handle = tracked.handle
            if handle.state is Lifecycle.EXITED:
                continue
            wait = self.drain_timeout(handle.tier) if timeout is None else timeout
            deadline = now + wait
            handle.kill_at = deadline if handle.kill_at is None else min(handle.kill_at, deadline)
            if handle.state is not Lifecycle.DRAINING:
                handle.state, handle.retire_reason = Lifecycle.DRAINING, "stop"
                self._send_drain(handle.worker_id, "stop")
            self._signal(tracked, signal.SIGTERM)
        self._wait_all()

    def _wait_all(self) -> None:
        give_up = None
        while True:
            now = time.monotonic()
            alive = []
            for tracked in self._tracked.values():
                self._poll(tracked)
                self._enforce_deadlines(tracked, now)
                if tracked.handle.state is not Lifecycle.EXITED:
                    alive.append(tracked)
            if not alive:
                return
            if all(t.handle.killed for t in alive):
                give_up = give_up or now + KILL_WAIT_S
                if now > give_up:
                    ids = ", ".join(f"{t.handle.worker_id} (pid {t.handle.pid})" for t in alive)
                    log.error("still alive %.0fs after SIGKILL: %s", KILL_WAIT_S, ids)
                    return
            time.sleep(0.05)

    def _send_drain(self, worker_id: str, reason: str) -> bool:
        try:
            send_control(self.r, worker_id, Control(kind="drain", ts=time.time(), reason=reason[:200]),
                         maxlen=CONTROL_MAXLEN)
        except TRANSIENT as exc:
            log.warning("cannot send drain to %s over Redis (%s): sending SIGTERM", worker_id, exc)
            return False
        return True

    # --- signals -------------------------------------------------------------------------
    def _signal(self, tracked: Tracked, sig: signal.Signals) -> None:
        """Signal the worker only if it is still the process we started (pid reuse)."""
        if tracked.handle.state is Lifecycle.EXITED:
            return
        if tracked.popen is None and (tracked.proc is None or not tracked.proc.is_running()):
            return
        pid = tracked.handle.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if sig == signal.SIGKILL and leads_group(pid):
                os.killpg(pid, sig)  # also whatever the worker forked
            else:
                os.kill(pid, sig)

    def _kill(self, tracked: Tracked) -> None:
        tracked.handle.killed = True
        self._signal(tracked, signal.SIGKILL)
