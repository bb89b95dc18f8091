"""The ``process`` runtime: workers are local processes, each in its own session.

A worker outlives a commander restart; the next commander adopts it from its run record or
the registry. The runtime is a short loop over three collaborators, each owning its state:

- ``spawner`` (``spawner.py``): starts a worker, forked by a fork template or as a fresh
  interpreter; the groups' interpreters and their checks;
- ``workers`` (``workers.py``): the tracked workers, their exits, drains, deadlines,
  registrations, run records and registry cleanup;
- ``adoption`` (``adoption.py``): finds the live workers a previous commander left, and only
  those that carry this host's spawn proof (``proof.py``): any other process a record or a
  registry entry names is left alone, warned about once and noted for the ledger;
- ``crash_loops`` (``crashloop.py``): a pool whose workers keep exiting at start waits longer
  before each next start (1 s, 2 s, 4 s, ... 5 min), and says why (``refusal``, ``crash_loop``).

A group's interpreter is never read from its policy: the group names a runtime
(``Group.runtime``) and the commander's ``group_runtimes`` say which interpreter that is
(``commander.group_runtimes``); a name it does not know rejects the group.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import redis
from redis.exceptions import RedisClusterException, RedisError

from commander.group_runtimes import GroupRuntime, resolve
from commander.runtime.interface import (
    Handles,
    Lifecycle,
    Notes,
    Refused,
    Runtime,
    RuntimeNote,
    WorkerHandle,
    WorkerIds,
)
from commander.runtime.process.adoption import Adoption, Found
from commander.runtime.process.crashloop import CrashLoops
from commander.runtime.process.fork_client import TemplateSpawner
from commander.runtime.process.interpreters import CHECK_TIMEOUT_S, PENDING, GroupRejected
from commander.runtime.process.launch import worker_command
from commander.runtime.process.proof import load_secret
from commander.runtime.process.spawner import CommandBuilder, Spawner, SpawnMode
from commander.runtime.process.workers import START_TIMEOUT, LocalWorkers
from protocol.groups import split_pool, validate_pool
from protocol.models import exit_meaning
from protocol.policy import PolicyError, TurnsPolicy, parse_policy
from protocol.policy_controls import Controls
from stores.connection import connect_rq, connect_sync, resolve_url
from stores.policies import read_good_policy, read_policy

log = logging.getLogger(__name__)


class ProcessRuntime(Runtime):
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
        group_runtimes: Mapping[str, GroupRuntime] | None = None,
        check_timeout_s: float = CHECK_TIMEOUT_S,
        crash_loops: CrashLoops | None = None,
    ) -> None:
        """``spawn_mode="fork"`` applies to the real worker only (the default ``command``);
        ``template`` replaces the fork template built from ``url`` and ``log_dir`` (tests);
        ``rq_url``: RQ's Redis (RQ workers' registry, and their ``FLEET_RQ_URL``), else Fleet's
        own; ``drain_timeout``: a tier's, else its policy's ``drain_timeout_s``;
        ``group_runtimes``: the runtimes a group may name (the commander's setting);
        ``check_timeout_s``: how long a group interpreter's check may run; ``crash_loops``:
        the back-off of pools whose workers exit at start (its clock: the tests')."""
        url = resolve_url(url)
        log_dir = Path(log_dir).resolve()
        run_dir = Path(run_dir).resolve() if run_dir else log_dir.parent / "run"
        secret = load_secret(run_dir)
        self.group_runtimes = dict(group_runtimes or {})
        self.r = client if client is not None else connect_sync(url, retries=2, socket_timeout=5)
        self.rq = connect_rq(rq_url) if rq_url else self.r
        self.workers = LocalWorkers(run_dir, self.r, self.rq, start_timeout_s=start_timeout_s,
                                    drain_timeout=drain_timeout or self._policy_drain_timeout)
        self.adoption = Adoption(self.name, socket.gethostname(), run_dir, self.r, self.rq, secret)
        self.spawner = Spawner(url, log_dir, secret=secret, command=command, spawn_mode=spawn_mode,
                               template=template, rq_url=rq_url, check_timeout_s=check_timeout_s)
        self.crash_loops = crash_loops or CrashLoops()
        self._notes: Notes = []
        self._unproven: set[tuple[str, int]] = set()  # (worker id, pid) reported as not ours

    @property
    def log_dir(self) -> Path:
        """Where each worker's output goes (``<worker id>.log``)."""
        return self.spawner.log_dir

    def close(self) -> None:
        """Close the Redis clients and stop the fork templates (the workers keep running)."""
        self.spawner.close()
        self.r.close()
        if self.rq is not self.r:
            self.rq.close()

    def _policy_drain_timeout(self, tier: str) -> float:
        """The tier's last good policy's ``controls.drain_timeout_s`` (the default if unreadable)."""
        try:
            return parse_policy(read_good_policy(self.r, tier) or b"{}").controls.drain_timeout_s
        except (RedisError, OSError, RedisClusterException, PolicyError):  # TRANSIENT, or a bad policy
            return Controls().drain_timeout_s

    def configure(self, tier: str, kind: str, queues: Sequence[str] = ()) -> None:
        """An rq tier's workers are started as ``worker.rq.rq_worker`` on its queues."""
        self.spawner.configure(tier, kind, queues)

    # --- act -----------------------------------------------------------------------------
    def spawn(self, tier: str, n: int = 1) -> WorkerIds:
        """Start ``n`` workers of ``tier`` (or of a group's pool ``<tier>.<group>``, run by the
        group's interpreter); raise ``SpawnError`` if one cannot start, ``GroupRejected`` if the
        group's interpreter is missing or cannot load its handler, ``Refused`` while its check
        is in progress or while its workers' crash-loop back-off waits."""
        validate_pool(tier)
        if n < 0:
            raise ValueError(f"cannot spawn {n} workers")
        python = None
        if n > 0:
            python, why = self._group_interpreter(tier)
            if why == PENDING:
                raise Refused(f"group pool {tier}: {PENDING}")
            if why is not None:
                raise GroupRejected(why)
            if (waiting := self.crash_loops.refusal(tier)) is not None:
                raise Refused(f"pool {tier}: {waiting}")
        ids = []
        for _ in range(n):
            tracked = self.spawner.start(tier, python)
            self.workers.add(tracked)
            ids.append(tracked.handle.worker_id)
        return ids

    def check_group(self, pool: str) -> str | None:
        """Why the group of ``pool`` cannot run here: it names a runtime this commander does not
        allow, or its interpreter cannot load its handler; ``CHECK_PENDING`` while its
        interpreter is being checked (``refusal`` holds its spawns meanwhile)."""
        return self._group_interpreter(pool)[1]

    def refusal(self, tier: str) -> str | None:
        """Why workers of the pool ``tier`` may not start now: its interpreter's check is in
        progress (a verdict comes within the check's timeout), or its workers keep exiting at
        start and the back-off waits; or None."""
        why = self._group_interpreter(tier)[1]
        if why == PENDING:
            return f"group pool {tier}: {PENDING}"
        return self.crash_loops.refusal(tier)

    def crash_loop(self) -> dict[str, str]:
        """The pools whose workers keep exiting at start: pool -> the count and the last error."""
        return self.crash_loops.loops()

    def _group_interpreter(self, pool: str) -> tuple[str | None, str | None]:
        """The interpreter of ``pool``'s group (None: this one), and why it cannot run the
        group's handler (None: it can; ``PENDING``: not known yet), from the tier's policy and
        the allowed group runtimes."""
        tier, group = split_pool(pool)
        if not group:
            return None, None
        policy = read_policy(self.r, tier).policy
        found = next((g for g in policy.rollout.groups if g.name == group), None)
        if found is None or not isinstance(policy, TurnsPolicy):
            return None, None
        python, why = resolve(self.group_runtimes, tier, found, "python")
        if python is None:
            return None, why
        return python, self.spawner.check(python, policy.group_handler(group))

    def retire(self, worker_id: str, reason: str = "",
               drain_timeout_s: float | None = None) -> None:
        """Drain a worker now; ``reap()`` kills it if it is still alive after the timeout."""
        self.workers.retire(worker_id, reason, drain_timeout_s)

    def stop_all(self, timeout: float | None = None) -> Handles:
        """Drain every worker (control stream and SIGTERM), wait, SIGKILL the rest.

        The fork template stops too (the next ``spawn`` starts it again): nothing is left.
        """
        self.workers.stop_all(timeout)
        self.spawner.stop_template()
        return self.reap()

    # --- observe -------------------------------------------------------------------------
    def list(self) -> Handles:
        """Every tracked worker (exit status refreshed, no Redis I/O)."""
        return self.workers.handles()

    def has_exits(self) -> bool:
        """Whether a tracked worker has exited since the last ``reap`` (no Redis I/O)."""
        return self.workers.any_exited()

    def reap(self) -> Handles:
        """Collect exits, kill overdue drains and stuck starts, note registrations; a failed exit
        nobody asked for carries the last line of the worker's log (``error``), and any exit
        nobody asked for counts toward its pool's crash loop when it came soon after the start."""
        exited = self.workers.reap()
        now = time.time()
        for handle in exited:
            if handle.retire_reason in (None, START_TIMEOUT):
                if handle.exit_code != 0:
                    handle.error = last_line(self.log_dir / f"{handle.worker_id}.log")
                self._judge_exit(handle, now)
        if self.crash_loops.loops():
            for handle in self.workers.handles():
                if handle.state is Lifecycle.RUNNING and now - handle.started >= self.crash_loops.healthy_s:
                    self.crash_loops.healthy(handle.tier, handle.started)
        return exited

    def _judge_exit(self, handle: WorkerHandle, now: float) -> None:
        """A failure at start: an unasked exit within ``healthy_s`` of the start, or a start that
        never registered in time."""
        if handle.retire_reason != START_TIMEOUT and now - handle.started >= self.crash_loops.healthy_s:
            return
        how = ("did not register in time" if handle.retire_reason == START_TIMEOUT else
               "was killed" if handle.killed else f"exited with {exit_meaning(handle.exit_code)}")
        self.crash_loops.failed(handle.tier, handle.started, f"worker {handle.worker_id} {how}"
                                + (f", its log ends: {handle.error}" if handle.error else ""))

    def adopt(self) -> Handles:
        """Track live local workers from run records and the registry; drop dead records."""
        found = self.adoption.find(self.workers)
        self._report_unproven(found)
        for worker_id, entry_too in found.dead.items():
            self.workers.forget(worker_id, registry=entry_too)
        for tracked in found.live:
            self.workers.add(tracked)
            handle = tracked.handle
            log.info("adopted %sworker %s (tier %s, pid %d)", "RQ " if tracked.rq else "",
                     handle.worker_id, handle.tier, handle.pid)
        self.workers.note_registrations()
        self.workers.clean_registry()
        return [replace(t.handle) for t in found.live]

    def _report_unproven(self, found: Found) -> None:
        """Warn about, and note for the ledger, each live process a record or a registry entry
        names that does not prove this host's commanders started it: once per worker id and pid
        while it is named (what is no longer named is forgotten)."""
        reported, self._unproven = self._unproven, {(h.worker_id, h.pid) for h, _ in found.unproven}
        for handle, proof in found.unproven:
            if (handle.worker_id, handle.pid) in reported:
                continue
            reason = (f"pid {handle.pid}, named for worker {handle.worker_id} (tier {handle.tier}), "
                      f"does not carry this host's spawn proof ({proof}): not adopted, never signalled")
            log.warning("%s", reason)
            self._notes.append(RuntimeNote(handle.tier, "unproven-process", reason, (handle.worker_id,)))

    def notes(self) -> Notes:
        """The processes found since the last call that could not be proven ours."""
        notes, self._notes = self._notes, []
        return notes


def last_line(log: Path, tail_bytes: int = 4096) -> str:
    """The last non-blank line of a worker's log (a traceback's ends with the error), at most
    300 characters; "" when there is none or it cannot be read."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - tail_bytes))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
