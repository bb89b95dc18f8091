"""rq tiers on the ``kubernetes`` runtime, against the stand-in API server whose pods
run the real ``fleet rq-worker`` on the test's redis-server, each named after its pod.

A burst of jobs grows the tier from no pod and the tier goes back to none once the queue is
drained; a busy pod is never the victim while an idle one is there; a pod deleted mid-job
finishes its job (RQ's warm shutdown) and one whose container is killed mid-job hands it back
when its container restarts. Every job is checked in RQ's registries and by its own count of
runs. Waits are for a state of the stand-in or of Redis, with a deadline; nothing sleeps.
"""

from __future__ import annotations

import time

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from commander.runtime import Lifecycle, WorkerHandle
from protocol import keys
from protocol.deferral import Deferral
from protocol.policy import rq_policy
from stores import rqjobs
from stores.policies import write_policy
from tests.helpers import ledger, passes, wait_until
from tests.k8s import test_commander_k8s
from tests.k8s.cluster import Ended
from tests.k8s.standin import StandIn

pytestmark = pytest.mark.integration
run_commander = test_commander_k8s.run_commander  # the fixture: a commander on the stand-in

TIER = "writeback"
DEPLOYMENT = "fleet-worker-writeback"
RQ = dict(min_workers=0, max_workers=3, target_backlog_per_worker=4, scale_down_stabilization_s=1,
          drain_timeout_s=20)
USERS = 5


def add_tier(standin: StandIn, replicas: int = 0, grace_s: int = 30) -> None:
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, TIER, replicas=replicas, grace_s=grace_s,
                                       command=["fleet", "rq-worker", "--queues", TIER])


def defer(r: redis.Redis, n: int, sleep_s: float = 0.0, first: int = 0) -> list[str]:
    """Enqueue ``n`` ``count`` jobs (as the relay does); their ids."""
    ids = []
    for i in range(first, first + n):
        d = Deferral(name="count", kwargs={"sleep_s": sleep_s}, queue=TIER, user=f"u{i % USERS}",
                     turn_id=f"t{i}", index=0, retry_max=2, ts=time.time())
        assert rqjobs.enqueue(r, d)
        ids.append(d.job_id)
    return ids


def runs(r: redis.Redis) -> int:
    """Runs of ``count`` jobs, all users (a job run twice counts twice)."""
    return sum(int(r.hget(keys.usage(f"u{i}"), "jobs_run") or 0) for i in range(USERS))


def ran_once(r: redis.Redis, ids: list[str]) -> None:
    """Every job finished, in RQ's finished registry; none failed, started or queued; run once each."""
    stats = rqjobs.queue_stats(r, TIER)
    assert (stats.finished, stats.failed, stats.started, stats.queued) == (len(ids), 0, 0, 0), stats
    statuses = {Job.fetch(i, connection=r, serializer=JSONSerializer).get_status() for i in ids}
    assert statuses == {"finished"}
    assert runs(r) == len(ids)


def rq_names(r: redis.Redis, state: str | None = None) -> list[str]:
    return sorted(w.name for w in rqjobs.workers(r, TIER) if state is None or w.state == state)


def replicas(standin: StandIn) -> int:
    with standin.cluster.lock:
        return int(standin.cluster.deployments[DEPLOYMENT]["spec"]["replicas"])


def scaled_to_zero(standin: StandIn, r: redis.Redis) -> bool:
    with standin.cluster.lock:
        pods = len(standin.cluster.pods)
    return replicas(standin) == pods == 0 and rq_names(r) == []


def test_a_burst_grows_the_rq_tier_from_no_pod_and_it_goes_back_to_none(standin: StandIn, run_commander, r):
    write_policy(r, TIER, rq_policy(**RQ))
    add_tier(standin)
    run_commander()
    passes(r, 3, commander="k1")
    assert replicas(standin) == 0 and not ledger(r, TIER, "scale-up")  # nothing queued: no pod

    ids = defer(r, 24, sleep_s=0.2)
    wait_until(lambda: len(rq_names(r)) >= 2, 30, "the rq tier to grow")
    ups = ledger(r, TIER, "scale-up")
    assert ups[0].from_count == 0 and max(e.to_count for e in ups) >= 2
    assert all(name in standin.cluster.pods for name in rq_names(r))  # RQ's workers are the pods
    wait_until(lambda: runs(r) == len(ids), 60, "every job to run")
    wait_until(lambda: scaled_to_zero(standin, r), 60, "the tier back to no pod")

    ran_once(r, ids)
    downs = ledger(r, TIER, "reclaim-idle", "consolidate")
    assert downs and all(e.action == "reclaim-idle" for e in downs)
    chosen = [victim for e in downs for victim in e.victims]
    assert sorted(standin.cluster.rs_deleted) == sorted(chosen)  # the pods the commander chose went
    assert all(standin.cluster.ended[pod] == Ended(0, killed=False, restarts=0) for pod in chosen)
    assert not any(r.exists(keys.control(pod)) for pod in chosen)  # no drain over Redis: SIGTERM is one
    assert not ledger(r, TIER, "worker-exited", "substituted", "refused")  # warm shutdowns, no surprise


def test_a_busy_pod_is_never_the_victim_while_an_idle_one_is_there(standin: StandIn, run_commander, r):
    write_policy(r, TIER, rq_policy(**{**RQ, "min_workers": 4, "max_workers": 4}))
    add_tier(standin)
    run_commander()
    wait_until(lambda: len(rq_names(r)) == 4, 40, "four RQ workers")
    (job,) = defer(r, 1, sleep_s=8)
    (busy,) = wait_until(lambda: rq_names(r, "busy"), 20, "a pod to take the job")

    write_policy(r, TIER, rq_policy(**RQ))  # quiet: back to min_workers 0
    # around one running job the capacity ledger keeps three (its compaction margin): one idle goes
    wait_until(lambda: ledger(r, TIER, "reclaim-idle", "consolidate"), 20, "a first victim")
    assert rq_names(r, "busy") == [busy], "the job outlived the first scale-in"
    wait_until(lambda: runs(r) == 1, 30, "the job to finish")
    wait_until(lambda: scaled_to_zero(standin, r), 60, "the tier back to no pod")

    ran_once(r, [job])
    ended = Job.fetch(job, connection=r, serializer=JSONSerializer).ended_at
    assert ended is not None
    for event in ledger(r, TIER, "reclaim-idle", "consolidate"):
        assert busy not in event.victims or event.ts >= ended.timestamp(), event  # only once idle
    assert [e.action for e in ledger(r, TIER, "reclaim-idle", "consolidate")].count("consolidate") == 0
    assert all(e == Ended(0, killed=False, restarts=0) for e in standin.cluster.ended.values())
    assert not ledger(r, TIER, "worker-exited", "substituted")


def one_running_pod(standin: StandIn, make_runtime):
    add_tier(standin)
    runtime = make_runtime()
    runtime.configure(TIER, "rq", [TIER])
    assert runtime.refusal(TIER) is None  # rq tiers are no longer refused
    runtime.spawn(TIER, 1)

    def running() -> list[str]:
        runtime.reap()
        return [h.worker_id for h in runtime.list() if h.state is Lifecycle.RUNNING]

    (pod,) = wait_until(running, 30, "the pod's RQ worker registered")
    return runtime, pod


def test_a_pod_deleted_mid_job_finishes_its_job_and_leaves_nothing(standin: StandIn, make_runtime, r):
    runtime, pod = one_running_pod(standin, make_runtime)
    (job,) = defer(r, 1, sleep_s=2)
    wait_until(lambda: rq_names(r, "busy") == [pod], 20, "the pod to take the job")
    with standin.cluster.lock:
        standin.cluster.delete_pod(pod)  # kubectl delete pod (or a node drain): SIGTERM

    exits: list[WorkerHandle] = []

    def state() -> Lifecycle | None:
        exits.extend(runtime.reap())  # an exit is handed over once: kept here
        return next((h.state for h in runtime.list() if h.worker_id == pod), None)

    wait_until(lambda: state() is Lifecycle.DRAINING, 10, "the pod draining")
    wait_until(lambda: [h for h in exits if h.worker_id == pod] or state() and False, 30, "the pod gone")
    (gone,) = [h for h in exits if h.worker_id == pod]
    assert gone.drained  # RQ's registry no longer has it: it deregistered, nothing left behind
    assert standin.cluster.ended[pod] == Ended(0, killed=False, restarts=0)
    ran_once(r, [job])


def test_a_pod_whose_container_is_killed_mid_job_hands_it_back_when_it_restarts(standin: StandIn,
                                                                                 make_runtime, r):
    runtime, pod = one_running_pod(standin, make_runtime)
    (job,) = defer(r, 1, sleep_s=1)
    wait_until(lambda: rq_names(r, "busy") == [pod], 20, "the pod to take the job")
    with standin.cluster.lock:
        standin.cluster.crash(pod)  # SIGKILL (an OOM kill): its RQ worker cannot deregister
    # the restarted container's RQ worker finds its predecessor under the pod's name, hands the
    # job back to RQ (the job has retries left: queued again) and registers; the job runs again
    # (its count is added at its end: the killed run added none)
    wait_until(lambda: rqjobs.queue_stats(r, TIER).finished == 1, 40, "the job run again and finished")
    assert runs(r) == 1
    assert rq_names(r) == [pod]
    stats = rqjobs.queue_stats(r, TIER)
    # (once seen started == 1 here under a loaded CI machine, not reproduced since: the message
    # names what the started registry held)
    started = r.zrange(f"rq:wip:{TIER}", 0, -1, withscores=True)
    assert (stats.failed, stats.started, stats.queued) == (0, 0, 0), (started, Job.fetch(
        job, connection=r, serializer=JSONSerializer).get_status(), time.time())
    runtime.reap()
    assert {h.worker_id: h.state for h in runtime.list()} == {pod: Lifecycle.RUNNING}
    with standin.cluster.lock:
        statuses = standin.cluster.pods[pod]["status"]["containerStatuses"]
    assert statuses[0]["restartCount"] == 1
