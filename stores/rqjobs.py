"""Fleet's calls into RQ: enqueue a deferral exactly once, read a queue's signals,
list and requeue failed jobs, and hand back the jobs of an RQ worker that died.

RQ is the ``rq`` extra: this module imports it, so only the relay, the RQ workers, the
commander's rq tiers and ``fleet jobs`` import this module. RQ keeps its keys unhashed
(``rq:job:<id>``, ``rq:queue:<name>``) and writes them together, so it needs one Redis node:
on a Fleet Cluster, the RQ connection is a node of its own (``--rq-url``).

Jobs are stored with RQ's JSON serializer, never its default one: a job hash in Redis cannot make a
worker deserialize (run) arbitrary code, and their one function is ``worker.jobs.run``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from rq import Queue, Retry, worker_registration
from rq.exceptions import DuplicateJobError, NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import Worker

from protocol import keys
from protocol.codec import as_str
from protocol.deferral import JOB_ENTRY, RESULT_TTL_S, Deferral
from stores.replies import bytes_list

# Fleet's RQ workers' TTL: an idle one heartbeats every RQ_WORKER_TTL_S - 15 s (RQ's dequeue
# timeout; RQ's default TTL, 420 s, would leave a killed worker counted for 7 minutes)
RQ_WORKER_TTL_S = 30
LIVE_WITHIN_S = RQ_WORKER_TTL_S  # an idle worker not heard from for this long is not live


def queue(conn: redis.Redis, name: str) -> Queue:
    """An RQ queue of Fleet's (JSON serializer)."""
    return Queue(name, connection=conn, serializer=JSONSerializer)


def enqueue(conn: redis.Redis, d: Deferral, result_ttl_s: int = RESULT_TTL_S) -> bool:
    """Put the deferral into its queue under its job id, unless RQ holds that id already: True
    if enqueued now, False if it was there (RQ's check and save are one Lua script,
    ``unique=True``). A delayed one goes to the queue's scheduled registry, due at commit time
    + delay (RQ workers run the scheduler: ``worker.rq.rq_worker``)."""
    q = queue(conn, d.queue)
    options: dict[str, Any] = {
        "job_id": d.job_id, "unique": True, "result_ttl": result_ttl_s,
        "description": f"{d.name} for {d.user} (turn {d.turn_id}, #{d.index})",
        "meta": {"fleet_user": d.user, "fleet_turn": d.turn_id, "fleet_job": d.name},
    }
    if d.retry_max > 0:
        options["retry"] = Retry(max=d.retry_max, interval=d.retry_interval_s or 0)
    payload = d.model_dump(mode="json")
    try:
        if d.delay_s > 0:
            due = datetime.fromtimestamp(d.ts + d.delay_s, tz=UTC)
            q.enqueue_at(due, JOB_ENTRY, payload, job_timeout=d.job_timeout_s, **options)
        else:  # (None: RQ's default timeout)
            q.enqueue_call(JOB_ENTRY, args=[payload], timeout=d.job_timeout_s, **options)
    except DuplicateJobError:
        return False
    return True


@dataclass(frozen=True)
class QueueStats:
    """What an rq tier's signals read of one queue."""

    name: str
    queued: int  # waiting in the queue
    started: int  # in the started registry (running, or abandoned and not reaped yet)
    failed: int
    finished: int  # in the finished registry (done within result_ttl: a rate from its deltas)
    scheduled: int
    oldest_age_s: float  # how long the oldest queued job has waited (0: none)


def queue_stats(conn: redis.Redis, name: str, now: float | None = None) -> QueueStats:
    """One queue's counts and the age of its oldest queued job."""
    q = queue(conn, name)
    oldest = 0.0
    first = bytes_list(conn.lrange(q.key, 0, 0))
    if first:
        try:
            job = Job.fetch(as_str(first[0]), connection=conn, serializer=JSONSerializer)
            if job.enqueued_at is not None:
                now = now if now is not None else datetime.now(UTC).timestamp()
                oldest = max(0.0, now - job.enqueued_at.timestamp())
        except NoSuchJobError:
            pass  # removed between the two reads: the next read sees the new head
    return QueueStats(name, q.count, StartedJobRegistry(queue=q).count, FailedJobRegistry(queue=q).count,
                      FinishedJobRegistry(queue=q).count, q.scheduled_job_registry.count, oldest)


@dataclass(frozen=True)
class RqWorker:
    """An RQ worker as RQ's worker registry has it."""

    name: str
    queues: tuple[str, ...]
    state: str  # RQ's: idle, busy, started, suspended
    job: str | None
    birth: float | None = None  # when it registered (epoch seconds)


def workers(conn: redis.Redis, queue_name: str | None = None, now: float | None = None) -> list[RqWorker]:
    """The live RQ workers registered (of one queue's, if named).

    A killed worker cannot deregister, and its entry lingers until its key expires. One that is
    not busy is live only while its last heartbeat is within ``LIVE_WITHIN_S`` of ``now`` (an
    idle Fleet RQ worker heartbeats every ``RQ_WORKER_TTL_S - 15`` seconds, RQ's dequeue
    timeout); a busy one runs its job in its own process (no heartbeat meanwhile) and is live
    while its entry is, which RQ keeps for the job's timeout."""
    q = queue(conn, queue_name) if queue_name else None
    now = now if now is not None else datetime.now(UTC).timestamp()
    out = []
    for w in Worker.all(connection=conn, queue=q, serializer=JSONSerializer):
        state, beat = w.get_state(), w.last_heartbeat
        if state != "busy" and (beat is None or now - beat.timestamp() > LIVE_WITHIN_S):
            continue
        born = w.birth_date.timestamp() if w.birth_date is not None else None
        out.append(RqWorker(w.name, tuple(w.queue_names()), state, w.get_current_job_id(), born))
    return out


def failed(conn: redis.Redis, name: str, limit: int = 100) -> list[Job]:
    """The newest ``limit`` failed jobs of a queue (their traceback in ``exc_info``)."""
    reg = FailedJobRegistry(queue=queue(conn, name))
    ids = reg.get_job_ids(0, limit - 1, desc=True)
    return [j for j in Job.fetch_many(ids, connection=conn, serializer=JSONSerializer) if j is not None]


def requeue(conn: redis.Redis, name: str, job_ids: list[str] | None) -> list[str]:
    """Put failed jobs back in their queue (all of the queue's if ``job_ids`` is None); the ids
    requeued. An id not in the failed registry raises KeyError (nothing is requeued)."""
    reg = FailedJobRegistry(queue=queue(conn, name))
    present = set(reg.get_job_ids())
    ids = sorted(present) if job_ids is None else job_ids
    missing = [i for i in ids if i not in present]
    if missing:
        raise KeyError(f"not in the failed registry of queue {name!r}: {', '.join(missing)}")
    for job_id in ids:
        reg.requeue(job_id)
    return ids


def requeue_stuck(conn: redis.Redis, name: str, seen: dict[str, float], now: float,
                  grace_s: float = 5.0) -> list[str]:
    """Jobs a worker took from the queue (RQ moves them into ``<queue>:intermediate``) and died
    before it registered them as started: back to the head of the queue once seen so for
    ``grace_s`` (a live worker registers its job within milliseconds of taking it). RQ's own
    cleanup waits two maintenance rounds a minute apart and then counts it as a failure.
    ``seen`` is the caller's memory between calls (job id -> first seen); the ids requeued."""
    q = queue(conn, name)
    wip = {as_str(m).split(":", 1)[0] for m in bytes_list(conn.zrange(q.started_job_registry.key, 0, -1))}
    popped = [as_str(x) for x in bytes_list(conn.lrange(q.intermediate_queue_key, 0, -1))]
    for job_id in list(seen):
        if job_id not in popped or job_id in wip:
            del seen[job_id]
    requeued = []
    for job_id in popped:
        if job_id in wip:
            continue
        first = seen.setdefault(job_id, now)
        if now - first < grace_s:
            continue
        try:
            status = Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status()
        except NoSuchJobError:
            conn.lrem(q.intermediate_queue_key, 1, job_id)
            continue
        if status == JobStatus.QUEUED:
            with conn.pipeline() as pipe:
                pipe.lrem(q.intermediate_queue_key, 1, job_id)
                q.push_job_id(job_id, pipeline=pipe, at_front=True)
                pipe.execute()
            requeued.append(job_id)
        del seen[job_id]
    return requeued


def reap_worker(conn: redis.Redis, worker_name: str, queue_names: list[str]) -> int:
    """Hand back the jobs a dead RQ worker was running: each is retried if it has retries left,
    else moved to the failed registry (RQ's own handling of an abandoned job, done now rather
    than when its heartbeat would expire, a minute or more later). The number of jobs handed
    back. Only for a worker known dead (its process is gone): a live one's job would run twice.
    The worker leaves RQ's worker registry too (else it would be listed until its key expires)."""
    reaped = 0
    for name in queue_names:
        q = queue(conn, name)
        reg = StartedJobRegistry(queue=q)
        abandoned = 0
        for job_id, execution_id in reg.get_job_and_execution_ids(cleanup=False):
            execution = Execution.fetch(execution_id, job_id, connection=conn)
            if execution is None or execution.worker_name != worker_name:
                continue
            status = Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status()
            if status == JobStatus.STARTED:
                conn.zadd(reg.key, {execution.composite_key: 1}, xx=True)  # expired: abandoned now
                abandoned += 1
            elif status == JobStatus.QUEUED:
                # dequeued, and the worker died before it marked the job started (RQ registers
                # the execution first): RQ's own cleanup would drop it as a leftover, so it goes
                # back to the head of its queue here, never started, so never run twice
                with conn.pipeline() as pipe:
                    pipe.zrem(reg.key, execution.composite_key)
                    pipe.lrem(q.intermediate_queue_key, 1, job_id)
                    q.push_job_id(job_id, pipeline=pipe, at_front=True)
                    pipe.execute()
                reaped += 1
        if abandoned:
            reg.cleanup(timestamp=1)  # only what is scored at or below 1: the entries set above
        reaped += abandoned
    dead = Worker.find_by_key(keys.rq_worker(worker_name), connection=conn, serializer=JSONSerializer)
    if dead is not None:
        worker_registration.unregister(dead)
        conn.delete(dead.key)
    return reaped
