"""An rq tier scaled by the commander: a burst of turns whose handler defers a job
each grows the write-back tier's RQ workers from zero, the queue drains, and the tier goes
back to zero; real commander, chat worker, relay and RQ worker processes on a real Redis."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.policy import TurnsPolicy, rq_policy
from stores import rqjobs
from stores.policies import write_policy
from tests.helpers import Started, ledger, passes, running, wait_until
from tests.integration.test_defer_rq import Proc, relay, start_proc  # noqa: F401  (a fixture)

pytestmark = pytest.mark.integration
QUEUE = "writeback"


def rq_workers(r: redis.Redis) -> list[rqjobs.RqWorker]:
    return rqjobs.workers(r, QUEUE)


def deferring_fleet(r: redis.Redis, commander: Callable[..., Started], proc: Callable[..., Proc],
                    job_sleep_s: float, rq_max: int) -> Path:
    """A chat worker whose every turn defers a ``count`` job (sleeping ``job_sleep_s``) to the rq
    tier (from zero to ``rq_max`` RQ workers), run by a commander, and a relay; the commander's log."""
    write_policy(r, "chat", TurnsPolicy(handler="echo_defer", concurrency=16, min_workers=1, max_workers=1,
                                        handler_options={"job": "count", "job_sleep_s": job_sleep_s}))
    write_policy(r, QUEUE, rq_policy(min_workers=0, max_workers=rq_max, target_backlog_per_worker=4,
                                     scale_down_stabilization_s=1, drain_timeout_s=15))
    log = commander().log
    relay(proc, "relay-1")
    return log


def test_a_burst_grows_the_rq_tier_from_zero_drains_and_goes_back_to_zero(
        r: redis.Redis, redis_server, start_commander, start_proc: Callable[..., Proc]) -> None:  # noqa: F811
    log = deferring_fleet(r, start_commander, start_proc, job_sleep_s=0.25, rq_max=4)
    wait_until(lambda: ledger(r, "chat", "scale-up"), 20, "the chat worker")
    assert rq_workers(r) == [] and not ledger(r, QUEUE, "scale-up")

    turns = [(f"u{i % 10}", f"t{i}") for i in range(40)]
    fleet = Fleet(redis_server.role_url("fleet-client"))
    for h in fleet.submit_many([(u, "hi") for u, _ in turns], turn_ids=[t for _, t in turns]):
        assert h.result(30).ok
    wait_until(lambda: len(rq_workers(r)) >= 2, 30, "the rq tier to grow")
    ups = ledger(r, QUEUE, "scale-up")
    assert ups and ups[0].from_count == 0, log.read_text()[-3000:]

    total = lambda: sum(int(r.hget(keys.usage(f"u{i}"), "jobs_run") or 0) for i in range(10))  # noqa: E731
    wait_until(lambda: total() == len(turns), 60, "every job to run")
    wait_until(lambda: rq_workers(r) == [], 60, "the rq tier to go back to zero")
    downs = ledger(r, QUEUE, "reclaim-idle", "consolidate")
    assert downs and all(e.action == "reclaim-idle" for e in downs)
    assert not ledger(r, QUEUE, "worker-exited")  # warm shutdowns, no crash
    assert total() == len(turns)
    assert r.zcard(f"rq:failed:{QUEUE}") == 0
    text = log.read_text()
    assert "Traceback" not in text and "pass failed" not in text, text[-3000:]


def test_an_rq_worker_killed_mid_job_is_reaped_by_the_commander_and_its_job_runs_once(
        r: redis.Redis, redis_server, start_commander, start_proc: Callable[..., Proc]) -> None:  # noqa: F811
    log = deferring_fleet(r, start_commander, start_proc, job_sleep_s=1.0, rq_max=2)
    turns = [(f"v{i % 4}", f"t{i}") for i in range(8)]
    fleet = Fleet(redis_server.role_url("fleet-client"))
    for h in fleet.submit_many([(u, "hi") for u, _ in turns], turn_ids=[t for _, t in turns]):
        assert h.result(30).ok

    def busy() -> tuple[str, int] | None:
        for w in rq_workers(r):
            if w.state == "busy" and w.job:
                return w.name, int(r.hget(keys.rq_worker(w.name), "pid") or 0)
        return None

    name, pid = wait_until(busy, 30, "an RQ worker in a job")  # type: ignore[misc]
    os.kill(pid, signal.SIGKILL)  # mid-job: its job sleeps 1 s before its one write
    exited = lambda: ledger(r, QUEUE, "worker-exited")  # noqa: E731
    wait_until(exited, 30, "the commander to reap the RQ worker")
    assert exited()[0].victims == [name] and exited()[0].why.get("rq_reaped") == 1, log.read_text()[-3000:]

    total = lambda: sum(int(r.hget(keys.usage(f"v{i}"), "jobs_run") or 0) for i in range(4))  # noqa: E731
    wait_until(lambda: total() >= len(turns) and r.llen(f"rq:queue:{QUEUE}") == 0
               and r.zcard(f"rq:wip:{QUEUE}") == 0, 60, "every job to run")
    assert total() == len(turns)  # the killed job ran again, once; none twice
    assert r.zcard(f"rq:finished:{QUEUE}") == len(turns) and r.zcard(f"rq:failed:{QUEUE}") == 0
    # the dead worker left RQ's registry when it was reaped: the tier goes back to zero
    wait_until(lambda: rq_workers(r) == [], 60, "the rq tier to go back to zero")


@pytest.mark.parametrize("source", ["run-records", "rq-registry"])
def test_a_new_commander_adopts_the_rq_workers_counts_them_and_scales_them_in(
        r: redis.Redis, start_commander, tmp_path: Path, source: str) -> None:
    # a policy of exactly two: an uncounted pair would make the new commander start two more
    write_policy(r, QUEUE, rq_policy(min_workers=2, max_workers=2, scale_down_stabilization_s=1,
                                     drain_timeout_s=15))
    first = start_commander("c1").proc
    wait_until(lambda: len(rq_workers(r)) == 2, 30, "two RQ workers")
    before = {w.name: int(r.hget(keys.rq_worker(w.name), "pid") or 0) for w in rq_workers(r)}
    os.kill(first.pid, signal.SIGKILL)  # no drain: its RQ workers keep running, orphaned
    first.wait(timeout=10)
    if source == "rq-registry":  # nothing on disk: RQ's worker registry is the only trace
        for rec in (tmp_path / "run").glob("*.json"):
            rec.unlink()
    try:
        log = start_commander("c2").log
        wait_until(lambda: log.read_text().count("adopted RQ worker") == 2, 20, "c2 to adopt the RQ workers")
        passes(r, 10, "c2")
        assert {w.name for w in rq_workers(r)} == set(before), log.read_text()[-3000:]
        assert not [e for e in ledger(r, QUEUE) if e.commander == "c2" and e.action == "scale-up"]
        assert log.read_text().count("adopted RQ worker") == 2

        write_policy(r, QUEUE, rq_policy(min_workers=0, max_workers=2, scale_down_stabilization_s=1,
                                         drain_timeout_s=15))
        wait_until(lambda: rq_workers(r) == [], 60, "c2 to scale the adopted RQ workers in")
        downs = [e for e in ledger(r, QUEUE) if e.commander == "c2" and e.action == "reclaim-idle"]
        assert {v for e in downs for v in e.victims} == set(before), log.read_text()[-3000:]
        wait_until(lambda: not any(running(p) for p in before.values()), 30, "the adopted processes to exit")
        assert not ledger(r, QUEUE, "worker-exited")  # warm shutdowns
    finally:
        for pid in before.values():  # if the test failed before c2 stopped them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
