"""The ``process`` runtime: workers are local processes, each in its own session.

Own session (``start_new_session``) so a worker outlives a commander restart and a Ctrl-C in
the commander's terminal does not reach it: the commander drains it instead. Every spawn is
written to a small record under ``run_dir`` (pid + process creation time) so that the next
commander can adopt workers that had not registered yet when the previous one died.

Spawning (``spawn_mode``): ``fork`` (default) asks a pre-imported template process
(``template.py``) to fork the worker, which serves within ~100 ms instead of the ~350-500 ms
a fresh interpreter spends importing; ``exec`` (or a custom ``command``) starts a fresh
interpreter. If the template cannot start, workers are exec'd with a warning.

Retiring sends a drain on the worker's control stream (``SIGTERM`` if Redis is unreachable);
``reap()`` SIGKILLs the worker's process group once its drain deadline has passed. Workers
that are not our children (forked by the template, or adopted) are watched with psutil,
which checks the creation time so a reused pid is never mistaken for (or killed as) a worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

import redis
from redis.exceptions import RedisClusterException, RedisError

from commander.runtime.adoption import Adoption, _Tracked
from commander.runtime.base import Handles, Runtime, UnknownWorker, WorkerHandle, WorkerIds, WorkerState
from commander.runtime.interpreters import GroupRejected, Interpreters
from commander.runtime.procs import (
    SpawnError,
    child_env,
    leads_group,
    poll_foreign,
    process_of,
    rq_worker_command,
    start_fresh,
    worker_command,
)
from commander.runtime.run_records import write_record
from commander.runtime.template import TemplateSpawner
from protocol.groups import split_pool, validate_pool
from protocol.ids import validate_token
from protocol.models import Control
from protocol.policy import Policy, PolicyError, parse_policy
from stores.connection import connect_rq, connect_sync, resolve_url
from stores.control import send_control
from stores.policies import read_good_policy, read_policy
from stores.registry import registered_and_beating, rq_registered
from stores.retry import TRANSIENT

log = logging.getLogger(__name__)

CommandBuilder = Callable[[str, str], Sequence[str]]  # (tier, worker id) -> argv
SpawnMode = Literal["fork", "exec"]
KILL_WAIT_S = 5.0  # how long stop_all waits for a SIGKILLed process to vanish
EXIT_REPORT_WAIT_S = 0.2  # how long to wait for the template's report of a forked worker's exit
CONTROL_MAXLEN = 64
__all__ = ["ProcessRuntime", "SpawnError", "UnknownWorker", "child_env", "new_worker_id",
           "worker_command"]


def new_worker_id(tier: str) -> str:
    """``<tier>-<8 hex>`` (``<tier>.<group>-<8 hex>`` in a group's pool): unique enough for a
    fleet, readable in ``fleet status``."""
    return validate_token(f"{validate_pool(tier)}-{secrets.token_hex(4)}", "worker id")


class ProcessRuntime(Adoption, Runtime):
    """Local worker processes. Not thread-safe: one loop owns it."""

    name = "process"

    def __init__(
        self,
        url: str | None = None,
        log_dir: Path | str = Path(".fleet/logs"),
        *,
        run_dir: Path | str | None = None,
        command: CommandBuilder = worker_command,
        drain_timeout: Callable[[str], float] | None = None,
        start_timeout_s: float = 120.0,
        client: redis.Redis | None = None,
        spawn_mode: SpawnMode = "fork",
        template: TemplateSpawner | None = None,
        rq_url: str | None = None,
    ) -> None:
        """``spawn_mode="fork"`` applies to the real worker only (the default ``command``);
        ``template`` replaces the spawner built from ``url`` and ``log_dir`` (tests); ``rq_url``:
        RQ's Redis (RQ workers' registry, and their ``FLEET_RQ_URL``), else Fleet's own."""
        if spawn_mode not in ("fork", "exec"):
            raise ValueError(f"spawn_mode must be 'fork' or 'exec', not {spawn_mode!r}")
        self.url = resolve_url(url)
        self.log_dir = Path(log_dir).resolve()
        self.run_dir = Path(run_dir).resolve() if run_dir else self.log_dir.parent / "run"
        self.command = command
        self.drain_timeout = drain_timeout or self._policy_drain_timeout
        self.start_timeout_s = start_timeout_s
        self.r = client if client is not None else connect_sync(self.url, retries=2,
                                                                 socket_timeout=5)
        self.rq_url, self.rq = rq_url, connect_rq(rq_url) if rq_url else self.r
        self.host = socket.gethostname()
        self._workers: dict[str, _Tracked] = {}
        self._unclean: set[str] = set()  # exited workers whose registry entry is still to remove
        self._rq: dict[str, tuple[str, ...]] = {}  # rq tiers (configure): tier -> its queues
        self.template = self._make_template(spawn_mode, template)
        self.interpreters = Interpreters(self.template, child_env(self.url), self.log_dir,
                                         fork=self.template is not None)

    def _make_template(self, mode: SpawnMode, template: TemplateSpawner | None) -> TemplateSpawner | None:
        if mode == "exec" or self.command is not worker_command:
            return None
        template = template or TemplateSpawner(child_env(self.url), self.log_dir)
        template.start(wait=False)  # it imports while the caller goes on: ready by the first spawn
        return template

    def close(self) -> None:
        """Close the Redis client and stop the fork template (the workers keep running)."""
        if self.template is not None:
            self.template.close()
        self.interpreters.close()
        self.r.close()
        if self.rq is not self.r:
            self.rq.close()

    def _policy_drain_timeout(self, tier: str) -> float:
        """The tier's last good policy's ``drain_timeout_s`` (the default if unreadable)."""
        try:
            return parse_policy(read_good_policy(self.r, tier) or b"{}").drain_timeout_s
        except (RedisError, OSError, RedisClusterException, PolicyError):  # TRANSIENT, or a bad policy
            return Policy().drain_timeout_s

    def configure(self, tier: str, kind: str, queues: Sequence[str] = ()) -> None:
        """An rq tier's workers are started as ``worker.rq_worker`` on its queues."""
        if kind == "rq":
            self._rq[tier] = tuple(queues) or (tier,)
        else:
            self._rq.pop(tier, None)

    # --- spawn ---------------------------------------------------------------------------
    def spawn(self, tier: str, n: int = 1) -> WorkerIds:
        """Start ``n`` workers of ``tier`` (or of a group's pool ``<tier>.<group>``, run by the
        group's interpreter); raise ``SpawnError`` if one cannot start, ``GroupRejected`` if the
        group's interpreter is missing or cannot load its handler."""
        validate_pool(tier)
        if n < 0:
            raise ValueError(f"cannot spawn {n} workers")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env = child_env(self.url)
        base, group = split_pool(tier)
        python = None
        if group and n > 0:
            env["FLEET_WORKER_GROUP"] = group  # (WorkerSettings' env prefix: the fork takes it too)
            python, handler = self._group_runs(base, group)
            why = self.interpreters.check(python, handler) if python is not None else None
            if why is not None:
                raise GroupRejected(why)
        return [self._spawn_one(tier, env, python) for _ in range(n)]

    def check_group(self, pool: str) -> str | None:
        """Why the group of ``pool`` cannot run here: its interpreter cannot load its handler."""
        tier, group = split_pool(pool)
        python, handler = self._group_runs(tier, group) if group else (None, "")
        return self.interpreters.check(python, handler) if python is not None else None

    def _group_runs(self, tier: str, group: str) -> tuple[str | None, str]:
        """The interpreter of ``group`` (None: this one) and its handler, from the tier's policy."""
        policy = read_policy(self.r, tier).policy
        found = next((g for g in policy.groups if g.name == group), None)
        return (found.python if found is not None else None), policy.group_handler(group)

    def _spawn_one(self, pool: str, env: dict[str, str], python: str | None = None) -> str:
        worker_id = new_worker_id(pool)
        tier = split_pool(pool)[0]  # a group's worker is told its group by the environment
        log_path = self.log_dir / f"{worker_id}.log"
        template, popen = self.interpreters.template(python), None
        queues = self._rq.get(pool)
        if queues is not None:  # an RQ worker: a fresh interpreter (RQ is not in the template)
            rq_env = {**env, "FLEET_RQ_URL": self.rq_url} if self.rq_url else env
            popen = start_fresh(rq_worker_command(queues, worker_id), rq_env, log_path,
                                f"RQ worker of {pool}")
            pid, template = popen.pid, None
        elif template is not None:
            spawned = template.spawn(tier, worker_id, env, log_path)
            pid, popen = spawned.pid, spawned.popen
            template = template if spawned.forked else None
        else:
            argv = worker_command(tier, worker_id, python) if self.command is worker_command and python \
                else list(self.command(tier, worker_id))
            popen = start_fresh(argv, env, log_path, f"worker of {pool}")
            pid = popen.pid
        proc = process_of(pid)
        handle = WorkerHandle(worker_id, pool, pid, WorkerState.STARTING, time.time())
        self._workers[worker_id] = _Tracked(handle, proc, popen, time.monotonic(), template,
                                            rq=queues is not None)
        write_record(self.run_dir, handle, proc, rq=queues is not None)
        log.info("spawned worker %s (%s, pid %d, %s, log %s)", worker_id, pool, pid,
                 "exec" if popen else "forked", log_path)
        return worker_id

    # --- retire --------------------------------------------------------------------------
    def retire(self, worker_id: str, reason: str = "",
               drain_timeout_s: float | None = None) -> None:
        """Drain a worker now; ``reap()`` kills it if it is still alive after the timeout."""
        tracked = self._workers.get(worker_id)
        if tracked is None:
            raise UnknownWorker(worker_id)
        handle = tracked.handle
        self._poll(tracked)
        if handle.state in (WorkerState.DRAINING, WorkerState.EXITED):
            return
        timeout = self.drain_timeout(handle.tier) if drain_timeout_s is None else drain_timeout_s
        was_starting = handle.state is WorkerState.STARTING
        handle.state, handle.retire_reason = WorkerState.DRAINING, reason
        handle.kill_at = time.monotonic() + timeout
        sent = not tracked.rq and self._send_drain(worker_id, reason)  # RQ's warm shutdown: SIGTERM
        if not sent or was_starting:
            # a starting worker may not read its control stream yet; it holds no work either
            self._signal(tracked, signal.SIGTERM)
        log.info("retiring worker %s (tier %s, pid %d): %s; killed in %.1fs if still alive",
                 worker_id, handle.tier, handle.pid, reason or "no reason given", timeout)

    def _send_drain(self, worker_id: str, reason: str) -> bool:
        try:
            send_control(self.r, worker_id, Control(kind="drain", ts=time.time(), reason=reason[:200]),
                         maxlen=CONTROL_MAXLEN)
        except TRANSIENT as exc:
            log.warning("cannot send drain to %s over Redis (%s): sending SIGTERM", worker_id, exc)
            return False
        return True

    # --- observe -------------------------------------------------------------------------
    def list(self) -> Handles:
        """Every tracked worker (exit status refreshed, no Redis I/O)."""
        tracked_now = list(self._workers.values())  # a snapshot: a monitor thread may call this
        for tracked in tracked_now:
            self._poll(tracked)
        return [replace(t.handle) for t in tracked_now]

    def has_exits(self) -> bool:
        """Whether a tracked worker has exited since the last ``reap`` (no copies, no Redis I/O)."""
        found = False
        for tracked in list(self._workers.values()):
            self._poll(tracked)
            found = found or tracked.handle.state is WorkerState.EXITED
        return found

    def reap(self) -> Handles:
        """Collect exits, kill overdue drains and stuck starts, note registrations."""
        now = time.monotonic()
        for tracked in self._workers.values():
            self._poll(tracked)
        registry_ok = self._note_registrations()
        for tracked in self._workers.values():
            self._enforce_deadlines(tracked, now, check_start=registry_ok)
        exited = [t for t in self._workers.values() if t.handle.state is WorkerState.EXITED]
        for tracked in exited:
            del self._workers[tracked.handle.worker_id]
            self._forget(tracked.handle)
        self._clean_registry()
        return [replace(t.handle) for t in exited]

    def _poll(self, tracked: _Tracked) -> None:
        handle = tracked.handle
        if handle.state is WorkerState.EXITED:
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

    def _mark_exited(self, handle: WorkerHandle, code: int | None) -> None:
        prior = handle.state
        handle.state, handle.exit_code = WorkerState.EXITED, code
        # a clean drain acked or handed on all it had; any other end (a crash, SIGKILL, an
        # unknown exit status) leaves its users to the commander's takeover
        handle.drained = prior is WorkerState.DRAINING and not handle.killed and code == 0
        how = "was killed" if handle.killed else f"exited with code {code}"
        if prior is WorkerState.DRAINING and not handle.killed:
            log.info("worker %s (tier %s) drained and %s", handle.worker_id, handle.tier, how)
        else:
            log.warning("worker %s (tier %s, pid %d, %s) %s", handle.worker_id, handle.tier,
                        handle.pid, prior.value, how)

    def _enforce_deadlines(self, tracked: _Tracked, now: float, check_start: bool = False) -> None:
        """Kill a drain past its deadline; with ``check_start``, a start that never registered."""
        handle = tracked.handle
        overdue = handle.kill_at is not None and now >= handle.kill_at
        if handle.state is WorkerState.DRAINING and overdue:
            if not handle.killed:
                log.warning("worker %s did not drain in time: SIGKILL", handle.worker_id)
            self._kill(tracked)
        elif check_start and handle.state is WorkerState.STARTING \
                and now - tracked.start_mono > self.start_timeout_s:
            log.warning("worker %s did not register within %.0fs: SIGKILL", handle.worker_id,
                        self.start_timeout_s)
            handle.retire_reason = "start timeout"
            self._kill(tracked)

    def _note_registrations(self) -> bool:
        """Promote starting workers that registered with a heartbeat; False if Redis is down."""
        starting = [t for t in self._workers.values() if t.handle.state is WorkerState.STARTING]
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
                handle.state = WorkerState.RUNNING
                log.info("worker %s (tier %s) is running", handle.worker_id, handle.tier)
        return True

    # --- signals -------------------------------------------------------------------------
    def _signal(self, tracked: _Tracked, sig: signal.Signals) -> None:
        """Signal the worker only if it is still the process we started (pid reuse)."""
        if tracked.handle.state is WorkerState.EXITED:
            return
        if tracked.popen is None and (tracked.proc is None or not tracked.proc.is_running()):
            return
        pid = tracked.handle.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if sig == signal.SIGKILL and leads_group(pid):
                os.killpg(pid, sig)  # also whatever the worker forked
            else:
                os.kill(pid, sig)

    def _kill(self, tracked: _Tracked) -> None:
        tracked.handle.killed = True
        self._signal(tracked, signal.SIGKILL)

    # --- stop ----------------------------------------------------------------------------
    def stop_all(self, timeout: float | None = None) -> Handles:
        """Drain every worker (control stream and SIGTERM), wait, SIGKILL the rest.

        The fork template stops too (the next ``spawn`` starts it again): nothing is left.
        """
        now = time.monotonic()
        for tracked in self._workers.values():
            self._poll(tracked)
            handle = tracked.handle
            if handle.state is WorkerState.EXITED:
                continue
            wait = self.drain_timeout(handle.tier) if timeout is None else timeout
            deadline = now + wait
            handle.kill_at = deadline if handle.kill_at is None else min(handle.kill_at, deadline)
            if handle.state is not WorkerState.DRAINING:
                handle.state, handle.retire_reason = WorkerState.DRAINING, "stop"
                self._send_drain(handle.worker_id, "stop")
            self._signal(tracked, signal.SIGTERM)
        self._wait_all()
        if self.template is not None:
            self.template.close()
        return self.reap()

    def _wait_all(self) -> None:
        give_up = None
        while True:
            now = time.monotonic()
            alive = []
            for tracked in self._workers.values():
                self._poll(tracked)
                self._enforce_deadlines(tracked, now)
                if tracked.handle.state is not WorkerState.EXITED:
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
