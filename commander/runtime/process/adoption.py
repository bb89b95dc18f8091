"""Which live local workers a previous commander left, for the ``process`` runtime to adopt.

From the run records under ``run_dir`` (pid + creation time) and from the registry (this host
and runtime, command line checked). A live process is adopted only if it carries this host's
spawn proof (``proof.py``): a record or an entry naming a process this host's commanders did not
start (no proof, another one, or an environment it cannot read) is left alone, never signalled,
and reported (``Found.unproven``). A worker whose process is gone loses its record, and its
registry entry once it is certainly dead.

An rq tier's RQ workers are adopted as RQ workers (counted, up once in RQ's registry, retired
by SIGTERM): their run record says so, and one without a record is found in RQ's worker
registry (this host, a worker id of this runtime's form, its name on its command line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import psutil
import redis

from commander.runtime.interface import Lifecycle, WorkerHandle
from commander.runtime.process.identity import looks_like_rq_worker, looks_like_worker, same_process
from commander.runtime.process.launch import tier_of
from commander.runtime.process.proof import Proof, proof_of
from commander.runtime.process.run_records import read_records
from commander.runtime.process.workers import Tracked
from protocol.models import WorkerInfo
from stores.policies import has_rq_tier
from stores.registry import RqEntry, heartbeat_alive, read_entries, rq_entries
from stores.retry import TRANSIENT

log = logging.getLogger(__name__)
YOUNG_S = 2.0  # a process younger than this may still be in its exec: its proof is waited for
SETTLE_S = 0.1  # ... for this long at most
SETTLE_BUDGET_S = 0.3  # and for this long at most in one look, however many young processes it meets


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
class Found:
    """What one look found: live workers to track, and dead ones to forget."""

    live: list[Tracked] = field(default_factory=list)
    dead: dict[str, bool] = field(default_factory=dict)  # worker id -> its registry entry may go too
    unproven: list[tuple[WorkerHandle, Proof]] = field(default_factory=list)  # alive, not ours: left alone


class Adoption:
    """Finds the local workers of this host and runtime that no one tracks."""

    def __init__(self, runtime: str, host: str, run_dir: Path, r: redis.Redis, rq: redis.Redis,
                 secret: str) -> None:
        """``runtime``: the runtime's name in the registry; ``r``: Fleet's Redis; ``rq``: RQ's
        (the commander's rq_url), else the same; ``secret``: the spawn proof its workers carry."""
        self.runtime, self.host, self.run_dir, self.r, self.rq = runtime, host, run_dir, r, rq
        self.secret = secret

    def find(self, known: Container[str]) -> Found:
        """The live workers not in ``known`` (their handles ``adopted``), the dead ones, and the
        live processes that do not prove they are ours."""
        found, taken = Found(), set()
        settle_until = time.monotonic() + SETTLE_BUDGET_S
        for c in self._candidates():
            if c.worker_id in known or c.worker_id in taken:
                continue
            proc = c.check(c.pid)
            if proc is None:
                may_go = self._entry_may_go(c.worker_id, certain=c.from_record)
                found.dead[c.worker_id] = found.dead.get(c.worker_id, False) or may_go
                continue
            handle = WorkerHandle(c.worker_id, c.tier, c.pid, Lifecycle.STARTING, c.started, adopted=True)
            young = time.time() - proc.create_time() < YOUNG_S  # (its exec may be in progress)
            wait_s = min(SETTLE_S, max(0.0, settle_until - time.monotonic())) if young else 0.0
            proof = proof_of(proc, self.secret, wait_s)
            if proof is not Proof.PROVEN:
                found.unproven.append((handle, proof))
                continue
            found.live.append(Tracked(handle, proc, None, time.monotonic(), rq=c.rq))
            taken.add(c.worker_id)
        return found

    def _candidates(self) -> Iterable[_Candidate]:
        seen = set()
        for rec in read_records(self.run_dir):
            seen.add(rec["worker"])
            yield _Candidate(rec["worker"], rec["tier"], rec["pid"], rec["started"],
                             partial(same_process, create_time=rec.get("create_time")), True, rec["rq"])
        for info in self._registry():
            if info.worker not in seen and info.host == self.host and info.runtime == self.runtime:
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

    def _registry(self) -> list[WorkerInfo]:
        try:
            infos, _unreadable = read_entries(self.r)  # (each warned about once: stores.bad_state)
        except TRANSIENT as exc:
            log.warning("registry not readable, adopting from run records only: %s", exc)
            return []
        return infos

    def _rq_registry(self) -> list[RqEntry]:
        try:
            if not has_rq_tier(self.r):  # no rq tier: RQ's keys are none of this fleet's business
                return []
            return rq_entries(self.rq)
        except TRANSIENT as exc:
            log.warning("RQ's worker registry not readable, RQ workers adopted from run records "
                        "only: %s", exc)
            return []

    def _entry_may_go(self, worker_id: str, certain: bool) -> bool:
        """Whether a dead worker's registry entry may be removed: yes if its run record said it
        was ours; an entry alone only once its heartbeat has expired too (the same host name
        may be shared with another pid namespace: a container on the host network)."""
        try:
            return certain or not heartbeat_alive(self.r, worker_id)
        except TRANSIENT:
            return False
