"""The ``process`` runtime's adoption and bookkeeping (a mixin of ``ProcessRuntime``).

``adopt`` tracks the live local workers a previous commander left: from the run records under
``run_dir`` (pid + creation time) and from the registry (this host and runtime, command line
checked); a worker whose process is gone loses its record, and its registry entry once it is
certainly dead. ``_clean_registry`` removes what a killed worker could not.

An rq tier's RQ workers are adopted as RQ workers (counted, up once in RQ's registry, retired
by SIGTERM): their run record says so, and one without a record is found in RQ's worker
registry (this host, a worker id of this runtime's form, its name on its command line).
"""

from __future__ import annotations

import builtins
import logging
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import psutil
import redis

from commander.runtime.base import Handles, WorkerHandle, WorkerState
from commander.runtime.procs import looks_like_rq_worker, looks_like_worker, same_process, tier_of
from commander.runtime.run_records import drop_record, read_records, write_record
from commander.runtime.template import TemplateSpawner
from protocol.models import WorkerInfo
from stores.policies import has_rq_tier
from stores.registry import RqEntry, forget_workers, heartbeat_alive, read_entries, rq_entries
from stores.retry import TRANSIENT

log = logging.getLogger("commander.runtime.process")  # the runtime's logger, as before the split


class _Candidate(NamedTuple):
    """A worker a previous commander may have left, and how to check its pid is still it."""

    worker_id: str
    tier: str
    pid: int
    started: float
    check: Callable[[int], psutil.Process | None]
    from_record: bool
    rq: bool = False


@dataclass
class _Tracked:
    handle: WorkerHandle
    proc: psutil.Process | None  # None when it died before we could look at it
    popen: subprocess.Popen[bytes] | None = None  # only for our own children
    start_mono: float = 0.0
    template: TemplateSpawner | None = None  # the template that forked it (reports its exit)
    rq: bool = False  # an RQ worker (worker.rq_worker): up once in RQ's registry, retired by SIGTERM


class Adoption:
    """Adoption and registry bookkeeping for ``ProcessRuntime``, which provides the state below."""

    name: str
    host: str
    run_dir: Path
    r: redis.Redis
    rq: redis.Redis  # RQ's Redis (the commander's rq_url), else Fleet's
    _workers: dict[str, _Tracked]
    _unclean: set[str]

    def _note_registrations(self) -> bool:
        raise NotImplementedError  # ProcessRuntime's

    # --- adopt ---------------------------------------------------------------------------
    def adopt(self) -> Handles:
        """Track live local workers from run records and the registry; drop dead records."""
        adopted = []
        for c in self._candidates():
            if c.worker_id in self._workers:
                continue
            proc = c.check(c.pid)
            if proc is None:
                self._forget_stale(c.worker_id, certain=c.from_record)
                continue
            handle = WorkerHandle(c.worker_id, c.tier, c.pid, WorkerState.STARTING, c.started, adopted=True)
            self._workers[c.worker_id] = _Tracked(handle, proc, None, time.monotonic(), rq=c.rq)
            write_record(self.run_dir, handle, proc, rq=c.rq)
            adopted.append(handle)
            log.info("adopted %sworker %s (tier %s, pid %d)", "RQ " if c.rq else "", c.worker_id,
                     c.tier, c.pid)
        self._note_registrations()
        self._clean_registry()
        return [replace(h) for h in adopted]

    def _candidates(self) -> Iterable[_Candidate]:
        seen = set()
        for rec in read_records(self.run_dir):
            seen.add(rec["worker"])
            yield _Candidate(rec["worker"], rec["tier"], rec["pid"], rec["started"],
                             partial(same_process, create_time=rec.get("create_time")), True, rec["rq"])
        for info in self._registry():
            if info.worker not in seen and info.host == self.host and info.runtime == self.name:
                seen.add(info.worker)
                yield _Candidate(info.worker, info.tier, info.pid, info.started,
                                 partial(looks_like_worker, worker_id=info.worker, started=info.started),
                                 False)
        for entry in self._rq_registry():
            tier = tier_of(entry.name)
            if entry.name not in seen and entry.hostname == self.host and tier is not None:
                yield _Candidate(entry.name, tier, entry.pid, entry.birth,
                                 partial(looks_like_rq_worker, name=entry.name, started=entry.birth),
                                 False, rq=True)

    def _registry(self) -> builtins.list[WorkerInfo]:  # `list` is a method here
        try:
            infos, unreadable = read_entries(self.r)
        except TRANSIENT as exc:
            log.warning("registry not readable, adopting from run records only: %s", exc)
            return []
        for worker_id in unreadable:
            log.warning("registry entry %r does not decode", worker_id)
        return infos

    def _rq_registry(self) -> builtins.list[RqEntry]:
        try:
            if not has_rq_tier(self.r):  # no rq tier: RQ's keys are none of this fleet's business
                return []
            return rq_entries(self.rq)  # RQ's Redis (the commander's rq_url), else Fleet's
        except TRANSIENT as exc:
            log.warning("RQ's worker registry not readable, RQ workers adopted from run records "
                        "only: %s", exc)
            return []

    def _forget_stale(self, worker_id: str, certain: bool) -> None:
        """A local worker whose process is gone: drop its record and registry entry.

        A registry entry alone is removed only once its heartbeat has expired too: the same
        host name may be shared with another pid namespace (a container on the host network).
        """
        drop_record(self.run_dir, worker_id)
        try:
            if certain or not heartbeat_alive(self.r, worker_id):
                self._unclean.add(worker_id)
        except TRANSIENT:
            pass

    # --- bookkeeping ---------------------------------------------------------------------
    def _forget(self, handle: WorkerHandle) -> None:
        drop_record(self.run_dir, handle.worker_id)
        self._unclean.add(handle.worker_id)

    def _clean_registry(self) -> None:
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
