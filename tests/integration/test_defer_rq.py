"""Deferred jobs end to end: real redis-server, a real chat worker whose handler
defers a job per turn, real relay and RQ worker processes (each started and stopped by pid).

The fault test SIGKILLs the relay while outboxes fill and an RQ worker in the middle of a
job; every deferred job is then executed, and none was enqueued twice: RQ's registries hold
each expected job id once (finished), and the job's own effect, a counter with no
idempotency of its own, adds up to exactly one run per turn."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.deferral import job_id
from protocol.policy import TurnsPolicy
from stores import rqjobs
from stores.policies import write_policy
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration
QUEUE = "writeback"


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture
def start_proc(fleet_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Factory: ``fleet relay`` / ``fleet rq-worker`` processes, stopped by pid after the test."""
    started: list[Proc] = []

    def start(name: str, *argv: str) -> Proc:
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", *argv], env=fleet_env,
                                    stdout=out, stderr=subprocess.STDOUT)
        p = Proc(name, proc, log)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGKILL)
            p.proc.wait(timeout=10)


def relay(start_proc: Callable[..., Proc], name: str) -> Proc:
    return start_proc(name, "relay", "--id", name, "--claim-idle-ms", "500", "--sweep-interval", "2")


def rq_worker(start_proc: Callable[..., Proc], r: redis.Redis, name: str) -> Proc:
    p = start_proc(name, "rq-worker", "--queues", QUEUE, "--name", name)
    wait_until(lambda: any(w.name == name for w in rqjobs.workers(r)) or p.proc.poll() is not None, 20,
               f"RQ worker {name} to register")
    assert p.proc.poll() is None, p.tail()
    return p


def submit_all(url: str, turns: list[tuple[str, str]]) -> None:
    fleet = Fleet(url)
    handles = [fleet.submit(user, f"turn {tid}", turn_id=tid) for user, tid in turns]
    for h in handles:
        assert h.result(30).ok


def test_a_chat_handler_defers_a_memory_summary_per_turn(r: redis.Redis, redis_server, start_worker,
                                                          start_proc: Callable[..., Proc]) -> None:
    write_policy(r, "chat", TurnsPolicy(handler="echo_defer"))
    start_worker()
    relay(start_proc, "relay-1")
    rq_worker(start_proc, r, "rq-1")
    turns = [(user, f"t{i}") for user in ("alice", "bob") for i in range(3)]
    submit_all(redis_server.role_url("fleet-client"), turns)
    for user in ("alice", "bob"):
        wait_until(lambda u=user: r.hget(keys.usage(u), "summaries") == b"3", 30, f"{user}'s summaries")
        memories = [m for m in r.zrange(keys.memory(user), 0, -1) if b"summary of" in m]
        assert len(memories) == 3
    # RQ files a job as finished once its function has returned, after the writes seen above
    expected = {job_id(u, t, 0).encode() for u, t in turns}
    finished = lambda: set(r.zrange(f"rq:finished:{QUEUE}", 0, -1))  # noqa: E731
    wait_until(lambda: expected <= finished(), 30, "every job filed as finished")
    assert finished() == expected
    assert r.xlen(keys.outbox("alice")) == 0 and r.xlen(keys.outbox("bob")) == 0


def _busy(r: redis.Redis, name: str) -> str | None:
    """The job RQ worker ``name`` is running now, if it is busy."""
    for w in rqjobs.workers(r, QUEUE):
        if w.name == name and w.state == "busy" and w.job:
            return w.job
    return None


def test_sigkill_of_the_relay_and_of_rq_workers_mid_job_runs_every_job_once(
        r: redis.Redis, redis_server, start_worker, start_proc: Callable[..., Proc]) -> None:
    write_policy(r, "chat", TurnsPolicy(handler="echo_defer", concurrency=8,
                                        handler_options={"job": "count", "job_sleep_s": 0.8}))
    start_worker()
    users = [f"u{i}" for i in range(6)]
    first = [(u, f"a{i}") for u in users for i in range(3)]
    second = [(u, f"b{i}") for u in users for i in range(3)]

    relay_1 = relay(start_proc, "relay-1")
    w1 = rq_worker(start_proc, r, "rq-1")
    w2 = rq_worker(start_proc, r, "rq-2")
    submit_all(redis_server.role_url("fleet-client"), first)
    wait_until(lambda: r.llen(f"rq:queue:{QUEUE}") > 0, 30, "the first jobs in RQ")
    relay_1.kill()  # the outboxes of the second batch fill with no relay running
    submit_all(redis_server.role_url("fleet-client"), second)
    assert sum(r.xlen(keys.outbox(u)) for u in users) >= len(second)  # (and what relay-1 left)

    job = wait_until(lambda: _busy(r, "rq-1"), 30, "rq-1 to be in a job")
    w1.kill()  # mid-job: its job sleeps 0.8 s before its one write
    assert job in {job_id(u, t, 0) for u, t in first + second}
    # the commander does this at once when it sees the process die (else RQ does, a minute on),
    # and each pass requeues a job a dead worker took from the queue but never started
    # (its job is in the started registry, or was taken from the queue and not registered yet)
    rqjobs.reap_worker(r, "rq-1", [QUEUE])
    seen: dict[str, float] = {}
    relay(start_proc, "relay-2")  # claims relay-1's pending notifications, relays the rest
    rq_worker(start_proc, r, "rq-3")

    everything = first + second
    total = lambda: sum(int(r.hget(keys.usage(u), "jobs_run") or 0) for u in users)  # noqa: E731

    def all_done() -> bool:
        rqjobs.requeue_stuck(r, QUEUE, seen, time.time())  # as each commander pass does
        return (total() >= len(everything) and r.llen(f"rq:queue:{QUEUE}") == 0
                and r.zcard(f"rq:wip:{QUEUE}") == 0)

    wait_until(all_done, 90, "every job to run")
    expected = {job_id(u, t, 0) for u, t in everything}
    finished = {x.decode() for x in r.zrange(f"rq:finished:{QUEUE}", 0, -1)}
    assert finished == expected  # each one finished (a set: RQ keeps one entry per id)
    assert r.zcard(f"rq:failed:{QUEUE}") == 0
    assert total() == len(everything)  # the job's own effect: exactly one run each
    assert sum(r.xlen(keys.outbox(u)) for u in users) == 0
    assert r.xpending(keys.OUTBOX_READY, keys.RELAY_GROUP)["pending"] == 0
    assert w2.proc.poll() is None



def test_failed_jobs_are_listed_and_requeued_from_the_cli(r: redis.Redis, redis_server, start_worker,
                                                          start_proc: Callable[..., Proc],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.cli import main

    write_policy(r, "chat", TurnsPolicy(handler="echo_defer", handler_options={"job": "fail_first"}))
    start_worker()
    relay(start_proc, "relay-1")
    rq_worker(start_proc, r, "rq-1")
    submit_all(redis_server.role_url("fleet-client"), [("carol", "t1")])
    jid = job_id("carol", "t1", 0)
    wait_until(lambda: r.zscore(f"rq:failed:{QUEUE}", jid) is not None, 30, "the job to fail")
    url = ["--redis-url", redis_server.role_url("fleet-operator")]
    assert main([*url, "jobs", "failed", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["id"] == jid and "fails on purpose" in row["traceback"] and "Traceback" in row["traceback"]
    assert main([*url, "jobs", "failed"]) == 0
    assert jid in capsys.readouterr().out
    assert main([*url, "jobs", "requeue", "fleet-nope-0"]) == 1
    assert "not in the failed registry" in capsys.readouterr().err
    assert main([*url, "jobs", "requeue"]) == 2  # neither ids nor --all: one line, exit 2
    assert main([*url, "jobs", "requeue", "--all"]) == 0
    wait_until(lambda: r.hget(keys.usage("carol"), "fail_first_runs") == b"2", 30, "the requeued run")
    wait_until(lambda: r.zscore(f"rq:finished:{QUEUE}", jid) is not None, 30, "the job to finish")
    assert r.zcard(f"rq:failed:{QUEUE}") == 0
