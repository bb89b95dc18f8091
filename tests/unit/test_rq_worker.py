"""Fleet's RQ worker and its jobs on fakeredis: only ``worker.jobs.run`` runs, a
failing job is retried per its registration then lands in RQ's failed registry with its
traceback, a requeue runs it again, and a job pulls its user's context as a turn does."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import fakeredis
import pytest
from rq import Queue
from rq.job import JobStatus
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from protocol import keys
from protocol.codec import encode
from protocol.deferral import Deferral
from protocol.models import SessionEntry
from stores import rqjobs
from worker.rq import rq_worker

Q = "writeback"


def run(r: fakeredis.FakeRedis) -> None:
    rq_worker.build(r, [Q], "rq-test").work(burst=True)


def deferral(name: str, index: int = 0, **kwargs: object) -> Deferral:
    return Deferral(name=name, kwargs=dict(kwargs), queue=Q, user="alice", turn_id="t1", index=index, ts=1.0)


def test_a_job_naming_any_other_function_is_refused_and_fails() -> None:
    r = fakeredis.FakeRedis()
    job = Queue(Q, connection=r, serializer=JSONSerializer).enqueue("os.getcwd")
    run(r)
    [failed] = rqjobs.failed(r, Q)
    assert failed.id == job.id
    result = failed.latest_result()
    assert result is not None and "UnsafeJob" in (result.exc_string or "")
    assert "worker.jobs.run" in (result.exc_string or "")


def test_an_unknown_job_name_fails_with_the_known_names() -> None:
    r = fakeredis.FakeRedis()
    payload = deferral("noop").model_dump(mode="json") | {"name": "gone"}
    Queue(Q, connection=r, serializer=JSONSerializer).enqueue("worker.jobs.run", payload)
    run(r)
    [failed] = rqjobs.failed(r, Q)
    exc = failed.latest_result().exc_string  # type: ignore[union-attr]
    assert "no job registered as 'gone'" in exc and "memory_summary" in exc


def test_a_failing_job_is_retried_then_failed_with_its_traceback_and_requeued() -> None:
    r = fakeredis.FakeRedis()
    d = Deferral(name="fail_first", kwargs={"times": 3}, queue=Q, user="alice", turn_id="t1", index=0, ts=1.0,
                 retry_max=1)
    assert rqjobs.enqueue(r, d)
    run(r)  # run 1 fails, the retry (no interval: queued again at once) fails too
    assert r.hget(keys.usage("alice"), "fail_first_runs") == b"2"
    [failed] = rqjobs.failed(r, Q)
    assert failed.id == d.job_id
    assert "fails on purpose" in (failed.latest_result().exc_string or "")  # type: ignore[union-attr]
    assert "Traceback" in (failed.latest_result().exc_string or "")  # type: ignore[union-attr]
    assert rqjobs.requeue(r, Q, [d.job_id]) == [d.job_id]
    run(r)  # run 3 fails once more (times=3)
    assert rqjobs.requeue(r, Q, None) == [d.job_id]
    run(r)  # run 4 succeeds
    assert r.hget(keys.usage("alice"), "fail_first_runs") == b"4"
    assert rqjobs.failed(r, Q) == []
    with pytest.raises(KeyError, match="not in the failed registry"):
        rqjobs.requeue(r, Q, ["fleet-nope-0"])


def test_a_memory_summary_pulls_the_users_context() -> None:
    r = fakeredis.FakeRedis()
    for i in range(3):
        r.rpush(keys.session("alice"), encode(SessionEntry(turn_id=f"t{i}", entry=f"{i}-0", text=f"q{i}",
                                                           reply=f"a{i}", ts=1.0)))
    assert rqjobs.enqueue(r, deferral("memory_summary", turns=2))
    run(r)
    memories = [m for m in r.zrange(keys.memory("alice"), 0, -1) if b"summary of 2 turns" in m]
    assert len(memories) == 1 and b"q1 -> a1" in memories[0] and b"q2 -> a2" in memories[0]
    assert r.hget(keys.usage("alice"), "summaries") == b"1"


@pytest.mark.parametrize("started", [True, False], ids=["mid-job", "between-dequeue-and-start"])
def test_reaping_a_dead_workers_job_retries_it_now(started: bool) -> None:
    """What the commander does when it sees an RQ worker's process die mid-job, or after it
    took the job but before it marked it started (RQ registers the execution first: its own
    cleanup would drop that job as a leftover, and the job would never run)."""
    r = fakeredis.FakeRedis()
    d = deferral("count")
    assert rqjobs.enqueue(r, Deferral(**{**d.model_dump(), "retry_max": 1}))
    w = rq_worker.build(r, [Q], "rq-dead")
    w.register_birth()
    assert [w.name for w in rqjobs.workers(r, Q)] == ["rq-dead"]
    job = w.dequeue_job_and_maintain_ttl(1)
    assert job is not None
    w.prepare_execution(job[0])  # in the started registry under rq-dead (and busy), then
    if started:
        job[0].set_status(JobStatus.STARTED)  # as perform_job has it; then the worker is "killed"
    assert rqjobs.queue_stats(r, Q).started == 1
    assert rqjobs.reap_worker(r, "rq-other", [Q]) == 0  # another worker's: untouched
    assert rqjobs.reap_worker(r, "rq-dead", [Q]) == 1
    assert [w.name for w in rqjobs.workers(r, Q)] == []  # out of RQ's worker registry too
    st = rqjobs.queue_stats(r, Q)
    assert (st.started, st.queued + st.scheduled) == (0, 1)  # back in the queue: run once
    run(r)
    assert r.hget(keys.usage("alice"), "jobs_run") == b"1"


def test_the_entry_rq_jobs_name_is_the_registrys_runner() -> None:
    from worker import jobs

    assert f"{jobs.run.__module__}.{jobs.run.__name__}" == jobs.ENTRY


def test_a_job_taken_but_never_started_is_queued_again_after_a_grace() -> None:
    """A worker that died between taking a job (RQ moves it to ``<queue>:intermediate``) and
    registering it: the commander's pass puts it back once it has sat there ``grace_s``; a job a
    live worker has registered is left alone."""
    r = fakeredis.FakeRedis()
    d, live = deferral("count"), deferral("count", index=1)
    assert rqjobs.enqueue(r, d) and rqjobs.enqueue(r, live)
    q = rqjobs.queue(r, Q)
    r.lmove(q.key, q.intermediate_queue_key)  # the dead worker took d
    w = rq_worker.build(r, [Q], "rq-live")
    job, _ = w.dequeue_job_and_maintain_ttl(1)  # a live worker took the other, and registered it
    w.prepare_execution(job)
    seen: dict[str, float] = {}
    assert rqjobs.requeue_stuck(r, Q, seen, 100.0, grace_s=5) == []  # first seen now
    assert rqjobs.requeue_stuck(r, Q, seen, 104.0, grace_s=5) == []  # within the grace
    assert rqjobs.requeue_stuck(r, Q, seen, 106.0, grace_s=5) == [d.job_id]
    assert r.lrange(q.key, 0, -1) == [d.job_id.encode()]
    assert seen == {}
    run(r)
    assert r.hget(keys.usage("alice"), "jobs_run") == b"1"  # d ran, once


def test_a_pods_new_rq_worker_hands_back_what_its_killed_predecessor_held() -> None:
    """A container killed mid-job leaves its RQ worker registered under the pod's name, which RQ
    refuses to a new worker; the pod's next container hands the job back and takes the name."""
    r = fakeredis.FakeRedis()
    assert rqjobs.enqueue(r, Deferral(**{**deferral("count").model_dump(), "retry_max": 1}))
    dead = rq_worker.build(r, [Q], "fleet-worker-writeback-5f7c9d8b6-abcde")
    dead.register_birth()
    job, _ = dead.dequeue_job_and_maintain_ttl(1)
    dead.prepare_execution(job)
    job.set_status(JobStatus.STARTED)  # then the container is SIGKILLed
    with pytest.raises(ValueError, match="exists an active worker"):
        rq_worker.build(r, [Q], dead.name).register_birth()

    rq_worker.reap_predecessor(r, dead.name, [Q])
    st = rqjobs.queue_stats(r, Q)
    assert (st.started, st.queued + st.scheduled) == (0, 1)  # back in the queue (a retry left)
    assert rqjobs.workers(r, Q) == []
    rq_worker.reap_predecessor(r, "fleet-worker-writeback-5f7c9d8b6-fghij", [Q])  # none: nothing done
    assert rqjobs.queue_stats(r, Q).queued + rqjobs.queue_stats(r, Q).scheduled == 1
    rq_worker.build(r, [Q], dead.name).work(burst=True)  # the name is free again: it registers
    assert r.hget(keys.usage("alice"), "jobs_run") == b"1"


def test_a_redis_error_under_the_dequeue_is_retried_and_logged_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """RQ's loop quits on an error reply it does not retry itself (READONLY after a failover, BUSY,
    NOPERM, ...): Fleet's dequeue waits them out, each kind logged once."""
    from redis.exceptions import ReadOnlyError
    from rq import SimpleWorker

    r = fakeredis.FakeRedis()
    Queue(Q, connection=r, serializer=JSONSerializer).enqueue("os.getcwd")  # (refused: a job all the same)
    real = SimpleWorker.dequeue_job_and_maintain_ttl
    failures = [ReadOnlyError("You can't write against a read only replica.")] * 3

    def flaky(self: SimpleWorker, *args: object, **kwargs: object) -> object:
        if failures:
            raise failures.pop()
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SimpleWorker, "dequeue_job_and_maintain_ttl", flaky)
    monkeypatch.setattr(rq_worker, "_BACKOFF", rq_worker.Backoff(base=0.001, cap=0.001))
    run(r)
    assert not failures  # every failure met, and the worker went on to its job
    assert r.llen(f"rq:queue:{Q}") == 0
    assert caplog.text.count("Redis error READONLY ") == 1, caplog.text


def test_a_redis_error_in_rqs_suspension_check_or_maintenance_does_not_end_the_loop(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """RQ's loop runs both outside its dequeue, and quits on any error there."""
    from redis.exceptions import NoPermissionError
    from rq import SimpleWorker

    r = fakeredis.FakeRedis()
    Queue(Q, connection=r, serializer=JSONSerializer).enqueue("os.getcwd")  # (refused: a job all the same)
    refusal = NoPermissionError("this user has no permissions to run the 'exists' command")

    def refused(self: SimpleWorker, *args: object) -> None:
        raise refusal

    monkeypatch.setattr(SimpleWorker, "check_for_suspension", refused)
    monkeypatch.setattr(SimpleWorker, "run_maintenance_tasks", refused)
    run(r)
    assert r.llen(f"rq:queue:{Q}") == 0  # the job was taken all the same
    assert caplog.text.count("Redis error NOPERM ") == 1, caplog.text


def test_a_worker_that_stopped_heartbeating_is_not_counted_though_its_entry_lingers() -> None:
    """A killed RQ worker cannot deregister; its entry stays in RQ's worker registry until its
    key expires. It is not a live worker for ``fleet status`` or the commander once its last
    heartbeat is older than the worker TTL (a busy one is judged by its job's TTL instead)."""
    r = fakeredis.FakeRedis()
    live, dead = rq_worker.build(r, [Q], "rq-live"), rq_worker.build(r, [Q], "rq-dead")
    live.register_birth()
    dead.register_birth()
    assert live.worker_ttl == rqjobs.RQ_WORKER_TTL_S
    now = time.time()
    assert sorted(w.name for w in rqjobs.workers(r, Q, now)) == ["rq-dead", "rq-live"]
    later = now + rqjobs.RQ_WORKER_TTL_S + 1  # ...and only the live one heartbeat since
    live.heartbeat()
    r.hset(live.key, "last_heartbeat", utcformat(datetime.fromtimestamp(later, UTC)))
    assert [w.name for w in rqjobs.workers(r, Q, later)] == ["rq-live"]
    assert r.exists(dead.key)  # (its entry lingers: only its liveness is judged)
