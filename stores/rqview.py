"""An rq tier's status as people read it: its RQ workers (busy or idle, the job in
hand, age) and its queues' signals (queued, started, failed, the oldest queued job's age),
from RQ's registries. One view for ``fleet status``, ``fleet top`` and the monitor page; and
the failed jobs, for ``fleet jobs failed`` and the monitor page.

RQ is the ``rq`` extra: this module imports ``stores.rqjobs`` (and so RQ).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import redis

from stores import rqjobs


def tier_view(r: redis.Redis, queues: Sequence[str], now: float) -> dict[str, Any]:
    """The tier on ``queues``: ``workers_alive``, ``backlog`` (queued), ``pending`` (started),
    ``failed_jobs``, ``oldest_job_age_s``, per queue ``queues`` and its ``rq_workers``."""
    stats = [rqjobs.queue_stats(r, q, now) for q in queues]
    seen = {w.name: w for q in queues for w in rqjobs.workers(r, q, now)}
    rows = [{"worker": w.name, "state": w.state, "job": w.job, "queues": list(w.queues),
             "age_s": None if w.birth is None else round(max(0.0, now - w.birth), 1)}
            for _, w in sorted(seen.items())]
    return {"workers_alive": len(seen), "backlog": sum(s.queued for s in stats),
            "pending": sum(s.started for s in stats), "failed_jobs": sum(s.failed for s in stats),
            "oldest_job_age_s": round(max((s.oldest_age_s for s in stats), default=0.0), 1),
            "queues": [dataclasses.asdict(s) for s in stats], "rq_workers": rows}


def failed_rows(r: redis.Redis, queue: str, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` failed jobs of ``queue``, newest first: id, description, queue, end
    time, retries left, meta (user, turn, job name), the last traceback and its last line."""
    rows = []
    for job in rqjobs.failed(r, queue, limit):
        result = job.latest_result()
        exc = result.exc_string if result is not None else None
        last = (exc or "").strip().splitlines()[-1:] or ["(no traceback)"]
        rows.append({"id": job.id, "description": job.description, "queue": job.origin,
                     "ended_at": job.ended_at.isoformat() if job.ended_at else None,
                     "retries_left": job.retries_left, "meta": job.meta, "traceback": exc,
                     "error": last[0]})
    return rows
