"""Reads the rq tiers' queues and RQ workers on RQ's Redis, through ``stores.rqjobs`` (the
``rq`` extra, imported when a tier of kind rq is first read)."""

from __future__ import annotations

import logging

import redis

from commander.rq.inputs import RqRates, RqTierRead, RqWorkerSeen
from protocol.policy import RqPolicy

log = logging.getLogger("fleet.commander")
NO_RQ_ON_CLUSTER = ("Fleet's Redis is a Cluster and the commander has no RQ Redis: RQ keeps its keys "
                    "without hash tags and needs one node; give the commander (and the relay and RQ "
                    "workers) that node's URL: --rq-url or $FLEET_RQ_URL")


class RqReader:
    """One commander's reader of RQ's Redis: its own node (``rq_url``), else Fleet's when that
    is one node; ``r`` None: none usable (a Cluster without ``rq_url``, every rq tier refused)."""

    def __init__(self, r: redis.Redis | None) -> None:
        self._r = r
        self.rates: dict[str, RqRates] = {}
        self.popped: dict[str, dict[str, float]] = {}  # queue -> job taken, not started -> first seen

    @property
    def available(self) -> bool:
        """Whether there is an RQ Redis to read."""
        return self._r is not None

    @property
    def r(self) -> redis.Redis:
        """RQ's client (asked only once ``available`` said there is one)."""
        if self._r is None:
            raise RuntimeError(NO_RQ_ON_CLUSTER)
        return self._r

    def read(self, tier: str, policy: RqPolicy, now: float) -> tuple[RqTierRead, float]:
        """The tier's queues and RQ workers now, and its jobs per second."""
        from stores import rqjobs  # the rq extra

        for q in policy.rq_queues(tier):  # a job taken by a worker that died before starting it
            for job_id in rqjobs.requeue_stuck(self.r, q, self.popped.setdefault(q, {}), now):
                log.warning("tier %s: job %s was taken from queue %s by a worker that never started "
                            "it: queued again", tier, job_id, q)
        stats = [rqjobs.queue_stats(self.r, q, now) for q in policy.rq_queues(tier)]
        seen: dict[str, RqWorkerSeen] = {}
        for q in policy.rq_queues(tier):
            for w in rqjobs.workers(self.r, q, now):
                seen[w.name] = RqWorkerSeen(w.name, w.state, w.job)
        read = RqTierRead(queued=sum(s.queued for s in stats), started=sum(s.started for s in stats),
                          failed=sum(s.failed for s in stats), scheduled=sum(s.scheduled for s in stats),
                          oldest_age_s=max((s.oldest_age_s for s in stats), default=0.0),
                          done_total=sum(s.finished + s.failed for s in stats),
                          workers=tuple(seen.values()))
        rate = self.rates.setdefault(tier, RqRates()).add(now, read.done_total)
        return read, rate

    def reap(self, worker_id: str, policy: RqPolicy, tier: str) -> int:
        """A dead RQ worker's jobs handed back now (retried or failed, as RQ would later)."""
        from stores import rqjobs

        return rqjobs.reap_worker(self.r, worker_id, list(policy.rq_queues(tier)))
