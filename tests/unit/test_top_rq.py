"""``fleet top``'s rq tier blocks (``fleet.top_rq``): pure text from the status view."""

from __future__ import annotations

from fleet.top_rq import rq_lines

VIEW = {"workers_alive": 2, "backlog": 7, "pending": 1, "failed_jobs": 3, "oldest_job_age_s": 150.0,
        "queues": [{"name": "writeback"}, {"name": "eval"}],
        "rq_workers": [{"worker": "writeback-0000aaaa", "state": "busy", "job": "fleet-ab-0", "age_s": 42.0,
                        "queues": ["writeback"]},
                       {"worker": "writeback-0000bbbb", "state": "idle", "job": None, "age_s": None,
                        "queues": ["writeback"]}]}


def test_a_block_per_rq_tier_with_its_signals_and_workers() -> None:
    lines = rq_lines({"writeback": VIEW})
    assert lines[1] == "RQ TIER writeback (queues writeback,eval): queued 7  started 1  failed 3  oldest 2m"
    assert lines[3].split() == ["writeback-0000aaaa", "busy", "42s", "fleet-ab-0"]
    assert lines[4].split() == ["writeback-0000bbbb", "idle", "-", "-"]


def test_no_rq_tier_no_block_and_errors_and_empty_tiers_say_so() -> None:
    assert rq_lines({}) == []
    assert rq_lines({"w": {"rq_error": "RQ is not installed here (the rq extra)"}})[1] == \
        "RQ TIER w: RQ is not installed here (the rq extra)"
    empty = {**VIEW, "rq_workers": []}
    assert rq_lines({"w": empty})[-1] == "  (no RQ worker registered)"
