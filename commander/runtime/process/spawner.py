"""How the ``process`` runtime starts one local worker.

``fork`` (the default ``spawn_mode``) asks a pre-imported fork template (``fork_client.py``)
to fork the worker, which serves within ~100 ms instead of the ~350-500 ms a fresh interpreter
spends importing; a group with its own interpreter gets a template of that interpreter
(``interpreters.py``). ``exec`` (or a custom ``command``) starts a fresh interpreter, as does a
template that cannot start (with a warning). An rq tier's workers are RQ workers
(``worker.rq.rq_worker`` on the tier's queues), always fresh interpreters: RQ is not in the
template.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from commander.runtime.interface import Lifecycle, WorkerHandle
from commander.runtime.process.fork_client import TemplateSpawner
from commander.runtime.process.identity import process_of
from commander.runtime.process.interpreters import CHECK_TIMEOUT_S, Interpreters
from commander.runtime.process.launch import (
    child_env,
    new_worker_id,
    rq_worker_command,
    start_fresh,
    worker_command,
)
from commander.runtime.process.proof import PROOF_ENV
from commander.runtime.process.workers import Tracked
from protocol.groups import split_pool

log = logging.getLogger(__name__)

CommandBuilder = Callable[[str, str], Sequence[str]]  # (tier, worker id) -> argv
SpawnMode = Literal["fork", "exec"]


class Spawner:
    """Starts workers; owns the fork templates (the default one and the groups' interpreters')."""

    def __init__(self, url: str, log_dir: Path, *, secret: str, command: CommandBuilder = worker_command,
                 spawn_mode: SpawnMode = "fork", template: TemplateSpawner | None = None,
                 rq_url: str | None = None, check_timeout_s: float = CHECK_TIMEOUT_S) -> None:
        """``secret``: the spawn proof every process it starts carries (``proof.py``);
        ``spawn_mode="fork"`` applies to the real worker only (the default ``command``);
        ``template`` replaces the one built from ``url`` and ``log_dir``; ``rq_url``: the Redis
        of RQ workers (their ``FLEET_RQ_URL``), else Fleet's own; ``check_timeout_s``: how long
        a group interpreter's check may run."""
        if spawn_mode not in ("fork", "exec"):
            raise ValueError(f"spawn_mode must be 'fork' or 'exec', not {spawn_mode!r}")
        self.url, self.log_dir, self.command, self.rq_url = url, log_dir, command, rq_url
        self._secret = secret
        self.template = self._make_template(spawn_mode, template)
        env = self.env()
        check_env = {k: v for k, v in env.items() if k != PROOF_ENV}
        self.interpreters = Interpreters(self.template, env, log_dir, fork=self.template is not None,
                                         check_env=check_env, timeout_s=check_timeout_s)
        self._rq: dict[str, tuple[str, ...]] = {}  # rq tiers (configure): tier -> its queues

    def _make_template(self, mode: SpawnMode, template: TemplateSpawner | None) -> TemplateSpawner | None:
        if mode == "exec" or self.command is not worker_command:
            return None
        template = template or TemplateSpawner(self.env(), self.log_dir)
        template.start(wait=False)  # it imports while the caller goes on: ready by the first spawn
        return template

    def env(self) -> dict[str, str]:
        """The environment of a process it starts (this process's, now): ``REDIS_URL``, the spawn
        proof, and ``SPT_NOENV`` (a worker's process title must keep its environment readable in
        ``/proc``, where adoption reads the proof)."""
        return {**child_env(self.url), PROOF_ENV: self._secret, "SPT_NOENV": "1"}

    def configure(self, tier: str, kind: str, queues: Sequence[str] = ()) -> None:
        """An rq tier's workers are started as ``worker.rq.rq_worker`` on its queues."""
        if kind == "rq":
            self._rq[tier] = tuple(queues) or (tier,)
        else:
            self._rq.pop(tier, None)

    def check(self, python: str, handler: str) -> str | None:
        """Why ``python`` cannot run workers of ``handler`` (None: it can; ``PENDING``: not known
        yet); never waits (``interpreters.py``)."""
        return self.interpreters.check(python, handler)

    def start(self, pool: str, python: str | None = None) -> Tracked:
        """Start one worker of ``pool`` (a tier, or a group's ``<tier>.<group>``, run by the
        group's interpreter ``python``); raise ``SpawnError`` if it cannot start."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        worker_id = new_worker_id(pool)
        tier, group = split_pool(pool)  # a group's worker is told its group by the environment
        env = self.env()
        if group:
            env["FLEET_WORKER_GROUP"] = group  # (WorkerSettings' env prefix: the fork takes it too)
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
        handle = WorkerHandle(worker_id, pool, pid, Lifecycle.STARTING, time.time())
        log.info("spawned worker %s (%s, pid %d, %s, log %s)", worker_id, pool, pid,
                 "exec" if popen else "forked", log_path)
        return Tracked(handle, proc, popen, time.monotonic(), template, rq=queues is not None)

    def stop_template(self) -> None:
        """Stop the default fork template (the next ``start`` starts it again)."""
        if self.template is not None:
            self.template.close()

    def close(self) -> None:
        """Stop every fork template (the workers run on)."""
        self.stop_template()
        self.interpreters.close()
