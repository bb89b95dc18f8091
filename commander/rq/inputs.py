"""What ``decide`` sees of an rq tier, pure: RQ workers on the queues the policy names, judged
by the same ``decide`` as a turns tier.

What changes is what is measured, not how it is judged: a worker is ready once RQ's worker
registry has it and busy while RQ says it runs a job (one at a time: its ``total`` is 1); the
backlog is the jobs waiting in the tier's queues; the rate is jobs finished or failed per
second (RQ's registries' counts, over the last minute); the busy workers' count is the handler
time per second. So ``decide`` scales on queue depth, keeps ``scaling.target_buffer`` warm, scales to
zero when the queues are empty and the workers idle, reclaims idle workers first (a busy one
only by consolidation, never from under a job: RQ's warm shutdown lets the job finish), and
starts a worker for a job that arrives at an empty tier (its backlog proposal).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from commander.decide_inputs import mark_reception
from commander.runtime import Lifecycle, WorkerHandle
from commander.snapshot import TierSnapshot, ViewState, WorkerView
from protocol.policy import RqPolicy, ScaleRules

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


def decide_policy(policy: RqPolicy) -> ScaleRules:
    """What ``decide`` judges an rq tier by: one job per worker (``concurrency`` 1)."""
    return policy.scale_rules()


def rq_views(tier: str, handles: Iterable[WorkerHandle],
             seen: Sequence[RqWorkerSeen]) -> tuple[WorkerView, ...]:
    """The tier's workers this runtime runs: starting until RQ's registry has them, then ready,
    busy while RQ says so; draining once retired (RQ's warm shutdown under way)."""
    by_name = {w.name: w for w in seen}
    views = []
    for h in sorted(handles, key=lambda h: h.worker_id):
        if h.tier != tier or h.state is Lifecycle.EXITED:
            continue
        rq = by_name.get(h.worker_id)
        busy = 1 if rq is not None and rq.state == "busy" else 0
        state: ViewState = ("draining" if h.state is Lifecycle.DRAINING  # (a dead one's entry: not ready)
                            else "ready" if rq is not None and h.state is Lifecycle.RUNNING else "starting")
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
