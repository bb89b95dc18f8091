"""``fleet top``'s rows of the rq tiers: each tier's queue signals and its RQ
workers, from the view ``fleet status`` shows (``fleet.status.rq_status``). Pure: text from
what was read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleet.events import clip, duration


def rq_lines(rq: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One block per rq tier: queued, started, failed jobs and the oldest queued job's age,
    then its RQ workers (busy or idle, the job in hand, age); [] without an rq tier."""
    lines: list[str] = []
    for tier, row in sorted(rq.items()):
        if row.get("rq_error"):
            lines += ["", f"RQ TIER {tier}: {row['rq_error']}"]
            continue
        queues = ",".join(q["name"] for q in row.get("queues", []))
        lines += ["", f"RQ TIER {tier} (queues {queues}): queued {row['backlog']}  started {row['pending']}"
                      f"  failed {row['failed_jobs']}  oldest {duration(row['oldest_job_age_s'])}",
                  f"  {'RQ WORKER':<25}{'STATE':<10}{'AGE':>5}  JOB"]
        for w in row.get("rq_workers", []):
            job = w["job"] or "-"
            lines.append(f"  {clip(w['worker'], 24):<25}{w['state']:<10}{duration(w['age_s']):>5}  {job}")
        if not row.get("rq_workers"):
            lines.append("  (no RQ worker registered)")
    return lines
