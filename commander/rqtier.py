"""An rq tier (issue 16): RQ workers on the queues the policy names, judged by the same pure
``decide`` as a turns tier.

What changes is what is measured, not how it is judged: a worker is ready once RQ's worker
registry has it and busy while RQ says it runs a job (one at a time: its ``total`` is 1); the
backlog is the jobs waiting in the tier's queues; the rate is jobs finished or failed per
second (RQ's registries' counts, over the last minute); the busy workers' count is the handler
time per second. So ``decide`` scales on queue depth, keeps ``target_buffer`` warm, scales to
zero when the queues are empty and the workers idle, reclaims idle workers first (a busy one
only by consolidation, never from under a job: RQ's warm shutdown lets the job finish), and
starts a worker for a job that arrives at an empty tier (its backlog proposal).

RQ is the ``rq`` extra: this module reads RQ through ``stores.rqjobs``, imported when a tier of
kind rq is first judged.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from commander.runtime import WorkerHandle, WorkerState
from commander.snapshot import TierSnapshot, WorkerView
from commander.snapshot import WorkerState as ViewState
from commander.views import mark_reception
from protocol.models import LedgerEvent
from protocol.policy import Policy

log = logging.getLogger("fleet.commander")
RATE_WINDOW_S = 60.0


@dataclass(frozen=True)
class RqWorkerSeen:
    """An RQ worker as RQ's registry has it (``stores.rqjobs.RqWorker``'s fields)."""

    name: str
    state: str
    job: str | None = None


@dataclass(frozen=True)
class RqTierRead:
    """One pass's reading of an rq tier."""

    queued: int = 0
    started: int = 0
    failed: int = 0
    scheduled: int = 0
    oldest_age_s: float = 0.0
    done_total: int = 0  # finished + failed in the registries (a rate from its deltas)
    workers: tuple[RqWorkerSeen, ...] = ()


def decide_policy(policy: Policy) -> Policy:
    """The policy ``decide`` runs for an rq tier: one job per worker (``concurrency`` 1)."""
    return policy if policy.concurrency == 1 else policy.model_copy(update={"concurrency": 1})


def rq_views(tier: str, handles: Iterable[WorkerHandle],
             seen: Sequence[RqWorkerSeen]) -> tuple[WorkerView, ...]:
    """The tier's workers this runtime runs: starting until RQ's registry has them, then ready,
    busy while RQ says so; draining once retired (RQ's warm shutdown under way)."""
    by_name = {w.name: w for w in seen}
    views = []
    for h in sorted(handles, key=lambda h: h.worker_id):
        if h.tier != tier or h.state is WorkerState.EXITED:
            continue
        rq = by_name.get(h.worker_id)
        busy = 1 if rq is not None and rq.state == "busy" else 0
        state: ViewState = ("draining" if h.state is WorkerState.DRAINING  # (a dead one's entry: not ready)
                            else "ready" if rq is not None and h.state is WorkerState.RUNNING else "starting")
        views.append(WorkerView(id=h.worker_id, state=state, occupancy=float(busy), busy=busy, total=1,
                                lanes=busy, fresh=True, started=h.started))
    return mark_reception(views)


def rq_snapshot(tier: str, views: tuple[WorkerView, ...], read: RqTierRead,
                jobs_per_s: float) -> TierSnapshot:
    """The ``decide`` input of an rq tier: the queued jobs are its backlog."""
    busy = sum(v.busy for v in views if v.state == "ready")
    return TierSnapshot(tier=tier, workers=views, active_users=0, backlog=read.queued, rps=jobs_per_s,
                        handler_rate=float(busy) if jobs_per_s > 0 else 0.0, pressure_events=0)


@dataclass
class RqRates:
    """Jobs done per second from the registries' counts at each pass (the last minute)."""

    points: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=600))

    def add(self, now: float, done_total: int) -> float:
        self.points.append((now, done_total))
        while len(self.points) > 2 and now - self.points[0][0] > RATE_WINDOW_S:
            self.points.popleft()
        (t0, n0), (t1, n1) = self.points[0], self.points[-1]
        if t1 <= t0 or n1 < n0:  # one point, or the registries were cleaned: no rate
            return 0.0
        return (n1 - n0) / (t1 - t0)


NO_RQ_ON_CLUSTER = ("Fleet's Redis is a Cluster and the commander has no RQ Redis: RQ keeps its keys "
                    "without hash tags and needs one node; give the commander (and the relay and RQ "
                    "workers) that node's URL: --rq-url or $FLEET_RQ_URL")


class RqReader:
    """Reads the rq tiers' queues and workers (one reader per commander) on RQ's Redis: its own
    node (``rq_url``), else Fleet's when that is one node; ``r`` None: none usable (a Cluster
    without ``rq_url``), and every rq tier is refused (``RqTiers._rq_refused``)."""

    def __init__(self, r: redis.Redis | None) -> None:
        self._r = r
        self.rates: dict[str, RqRates] = {}
        self.popped: dict[str, dict[str, float]] = {}  # queue -> job taken, not started -> first seen

    def read(self, tier: str, policy: Policy, now: float) -> tuple[RqTierRead, float]:
        """The tier's queues and RQ workers now, and its jobs per second."""
        from stores import rqjobs  # the rq extra

        for q in policy.rq_queues(tier):  # a job taken by a worker that died before starting it
            for job_id in rqjobs.requeue_stuck(self.r, q, self.popped.setdefault(q, {}), now):
                log.warning("tier %s: job %s was taken from queue %s by a worker that never started "
                            "it: queued again", tier, job_id, q)
        stats = [rqjobs.queue_stats(self.r, q, now) for q in policy.rq_queues(tier)]
        seen: dict[str, Any] = {}
        for q in policy.rq_queues(tier):
            for w in rqjobs.workers(self.r, q):
                seen[w.name] = RqWorkerSeen(w.name, w.state, w.job)
        read = RqTierRead(queued=sum(s.queued for s in stats), started=sum(s.started for s in stats),
                          failed=sum(s.failed for s in stats), scheduled=sum(s.scheduled for s in stats),
                          oldest_age_s=max((s.oldest_age_s for s in stats), default=0.0),
                          done_total=sum(s.finished + s.failed for s in stats),
                          workers=tuple(seen.values()))
        rate = self.rates.setdefault(tier, RqRates()).add(now, read.done_total)
        return read, rate

    def reap(self, worker_id: str, policy: Policy, tier: str) -> int:
        """A dead RQ worker's jobs handed back now (retried or failed, as RQ would later)."""
        from stores import rqjobs

        return rqjobs.reap_worker(self.r, worker_id, list(policy.rq_queues(tier)))

    @property
    def r(self) -> redis.Redis:
        """RQ's client (only asked once ``RqTiers._rq_refused`` said there is one)."""
        if self._r is None:
            raise RuntimeError(NO_RQ_ON_CLUSTER)
        return self._r


class RqTiers:
    """The commander's part for rq tiers, for ``Commander``, which provides the state below."""

    runtime: Any
    rq: RqReader
    _rq_refusals: set[str]  # rq tiers refused for want of an RQ Redis, ledgered once each
    _append: Callable[[LedgerEvent], None]
    _event: Callable[..., LedgerEvent]

    def _rq_refused(self, tier: str) -> str | None:
        """Why the rq tier cannot be run here (no RQ Redis: a Cluster without ``rq_url``), or
        None; said once in the ledger and the log, not every pass."""
        if self.rq._r is not None:
            self._rq_refusals.discard(tier)
            return None
        if tier not in self._rq_refusals:
            self._rq_refusals.add(tier)
            reason = f"tier {tier} is of kind rq, not run: {NO_RQ_ON_CLUSTER}"
            self._append(self._event(tier, "refused", reason=reason, why={"refused": NO_RQ_ON_CLUSTER}))
            log.error("%s", reason)
        return NO_RQ_ON_CLUSTER

    def _rq_inputs(self, tier: str, policy: Policy, handles: list[WorkerHandle],
                   now: float) -> tuple[tuple[WorkerView, ...], TierSnapshot, Policy]:
        """The views, snapshot and decide policy of an rq tier (its workers are RQ's)."""
        read, rate = self.rq.read(tier, policy, now)
        views = rq_views(tier, handles, read.workers)
        return views, rq_snapshot(tier, views, read, rate), decide_policy(policy)

    def _reap_rq(self, handle: WorkerHandle, policy: Policy) -> None:
        """An RQ worker that died (not a warm shutdown): its job goes back to RQ now, retried if
        it has retries left, else failed; RQ itself would do it only once the job's heartbeat
        expires (a minute or more). A failure leaves it to RQ, and says so."""
        try:
            n = self.rq.reap(handle.worker_id, policy, handle.tier)
        except Exception as exc:  # noqa: BLE001 - RQ's own cleanup still hands the job back later
            log.warning("tier %s: the jobs of dead RQ worker %s could not be handed back (%s: %s); "
                        "RQ does it once their heartbeat expires", handle.tier, handle.worker_id,
                        type(exc).__name__, exc)
            return
        if n == 0 and handle.retire_reason is not None and not handle.killed and handle.exit_code is None:
            # retired, and not our child (adopted): its exit status is unknown, but it left no
            # job behind, which is what a warm shutdown does
            log.info("tier %s: RQ worker %s (adopted) exited after its retirement, no job in hand",
                     handle.tier, handle.worker_id)
            return
        how = "was killed" if handle.killed else f"exited (code {handle.exit_code})"
        reason = f"RQ worker {handle.worker_id} {how}; {n} job(s) in hand handed back to RQ"
        log.warning("tier %s: %s", handle.tier, reason)
        self._append(self._event(handle.tier, "worker-exited", reason=reason, victims=[handle.worker_id],
                                 why={"rq_reaped": n}))
