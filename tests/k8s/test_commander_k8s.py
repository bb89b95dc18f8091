"""A real ``Commander`` with the ``kubernetes`` runtime against the stand-in API server, whose pods
are real ``fleet worker`` processes: the ledger of a refusal and of a Pending pod, and a scale
scenario (a burst scales the tier up, quiet scales it in, the pods that go are the ones the
commander chose, idle first, and every turn gets exactly one reply)."""

from __future__ import annotations

import calendar
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from commander.commander import Commander
from commander.settings import CommanderSettings
from fleet.client import Fleet
from protocol.policy import turns_policy
from stores.policies import write_policy
from tests.conftest import RedisServer
from tests.helpers import ledger, live_workers, passes, wait_until
from tests.k8s.cluster import Cluster, Ended
from tests.k8s.conftest import DEPLOYMENT, answered_once
from tests.k8s.semantics import deletion_order
from tests.k8s.standin import StandIn

pytestmark = pytest.mark.integration

FAST = dict(handler="sleep", handler_options={"sleep_ms": 300}, concurrency=2, min_workers=1,
            max_workers=4,
            target_backlog_per_worker=2, users_per_instance=None, report_interval_s=0.3,
            scale_down_stabilization_s=1, drain_timeout_s=15)


def replicas(standin: StandIn) -> int:
    with standin.cluster.lock:
        return int(standin.cluster.deployments[DEPLOYMENT]["spec"]["replicas"])


@pytest.fixture
def run_commander(redis_server: RedisServer, make_runtime) -> Iterator[Callable[..., Commander]]:
    """Start a leading commander on the kubernetes runtime in a thread (pass every 0.2 s); stopped
    and joined after the test."""
    running: list[tuple[threading.Event, threading.Thread, Commander]] = []

    def start(**runtime_options: object) -> Commander:
        settings = CommanderSettings(commander_id="k1", metrics_port=None, interval_s=0.2)
        commander = Commander(redis_server.client(), make_runtime(**runtime_options), settings)
        stop = threading.Event()
        thread = threading.Thread(target=commander.run, args=(stop,), name="commander", daemon=True)
        thread.start()
        running.append((stop, thread, commander))
        return commander

    yield start
    for stop, thread, commander in running:
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "the commander did not stop"
        commander.r.close()


def test_an_hpa_on_the_deployment_is_refused_once_in_the_ledger_until_it_goes(standin: StandIn,
                                                                             run_commander, r):
    write_policy(r, "chat", turns_policy(**{**FAST, "min_workers": 2}))
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
        standin.cluster.add_autoscaler("hpa", "chat-hpa", DEPLOYMENT)
    run_commander()
    wait_until(lambda: ledger(r, "chat", "refused"), 15, "the refusal in the ledger")
    passes(r, 5)
    (refused,) = ledger(r, "chat", "refused")  # once, not every pass
    assert "HorizontalPodAutoscaler chat-hpa targets Deployment fleet-worker-chat" in refused.reason
    assert refused.why["refused"] and refused.why["desired"] == 2
    assert not ledger(r, "chat", "scale-up") and replicas(standin) == 0
    assert standin.cluster.requests["PATCH scale"] == 0

    with standin.cluster.lock:
        del standin.cluster.hpas["chat-hpa"]
    wait_until(lambda: len(live_workers(r, "chat")) == 2, 30, "two workers once the HPA is gone")
    assert [(e.from_count, e.to_count) for e in ledger(r, "chat", "scale-up")] == [(0, 2)]


def test_a_pod_pending_past_the_limit_is_one_no_capacity_entry_and_is_not_retried(standin: StandIn,
                                                                                   run_commander, r):
    write_policy(r, "chat", turns_policy(**{**FAST, "min_workers": 2, "pending_timeout_s": 1}))
    with standin.cluster.lock:
        standin.cluster.nodes, standin.cluster.capacity = ("node-1",), 1  # room for one pod
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
    run_commander()
    wait_until(lambda: ledger(r, "chat", "no-capacity"), 20, "a no-capacity entry")
    passes(r, 10)
    (entry,) = ledger(r, "chat", "no-capacity")
    with standin.cluster.lock:
        pending = [n for n, p in standin.cluster.pods.items() if not p["spec"]["nodeName"]]
    assert entry.victims == pending and len(pending) == 1
    assert "Unschedulable: 0/1 nodes are available" in entry.reason and "pending_timeout_s=1" in entry.reason
    # it still counts as starting: the commander does not pile more pods on a full cluster
    assert replicas(standin) == 2
    assert [(e.from_count, e.to_count) for e in ledger(r, "chat", "scale-up")] == [(0, 2)]

    with standin.cluster.lock:
        standin.cluster.capacity = 2  # the cluster autoscaler brought room
    wait_until(lambda: len(live_workers(r, "chat")) == 2, 30, "the Pending pod to run")
    assert len(ledger(r, "chat", "no-capacity")) == 1


def test_burst_scales_up_then_quiet_scales_in_the_pods_the_commander_chose(standin: StandIn, run_commander,
                                                                           r, redis_server):
    write_policy(r, "chat", turns_policy(**FAST))
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
    run_commander()
    (first,) = [w.worker for w in wait_until(lambda: live_workers(r, "chat"), 20, "the first worker")]
    # Kubernetes times pods to the second: a burst pod created in the first pod's second is as
    # old as it, and the commander's reception (the oldest) is then the one with the smaller
    # name, at random (this test failed 1 run in 2 on a fast start). The premise, "the first pod
    # is the oldest", needs the burst to come in a later second.
    with standin.cluster.lock:
        created = standin.cluster.pods[first]["metadata"]["creationTimestamp"]
    born = calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ"))
    wait_until(lambda: time.time() >= born + 1, 5, "the second after the first pod's")

    with Fleet(redis_server.url) as fleet:
        handles = fleet.submit_many([(f"b{i:02d}", "burst") for i in range(40)])
        write_policy(r, "chat", turns_policy(**{**FAST, "min_workers": 4}))  # hold the pods the burst brings
        replies = answered_once(r, fleet, handles, timeout=90)
    ups = [e for e in ledger(r, "chat", "scale-up") if e.from_count >= 1]
    assert ups and max(e.to_count for e in ups) == 4, ledger(r, "chat")
    served_by = Counter(rep.worker for rep in replies)
    assert len(served_by) >= 2 and set(served_by) - {first}, served_by  # new pods served turns

    # the first pod's container crashes and restarts (an OOM kill, say): it is the most recently
    # ready pod now, the one the ReplicaSet would delete first on its own; but it is the tier's
    # reception (the oldest pod), which the commander keeps
    with standin.cluster.lock:
        standin.cluster.crash(first)
    standin.wait_for(lambda c: restarts(c, first) == 1 and ready(c, first) and rs_order(c)[0] == first, 30,
                     "the restarted pod Ready again (registered and reading), the ReplicaSet's first pick")

    write_policy(r, "chat", turns_policy(**FAST))  # quiet: back to min_workers=1, idle workers first
    wait_until(lambda: [w.worker for w in live_workers(r, "chat")] == [first]
               and replicas(standin) == len(standin.cluster.pods) == 1, 40, "scale-in to the one first pod")
    downs = ledger(r, "chat", "reclaim-idle", "consolidate")
    assert downs and all(e.action == "reclaim-idle" for e in downs)
    chosen = [victim for e in downs for victim in e.victims]
    # the ReplicaSet deleted exactly the commander's victims (in its own order when it met them at once)
    assert sorted(standin.cluster.rs_deleted) == sorted(chosen) and first not in chosen
    assert all(standin.cluster.ended[pod] == Ended(0, killed=False, restarts=0) for pod in chosen)
    assert not ledger(r, "chat", "worker-exited", "substituted", "refused")  # no takeover, no surprise


def restarts(cluster: Cluster, pod: str) -> int:
    statuses = cluster.pods[pod]["status"]["containerStatuses"]
    return int(statuses[0]["restartCount"]) if statuses else 0


def ready(cluster: Cluster, pod: str) -> bool:
    conditions = cluster.pods[pod]["status"]["conditions"]
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def rs_order(cluster: Cluster) -> list[str]:
    """The pods, in the order the ReplicaSet would delete them (deletion costs as they are)."""
    active = [p for p in cluster.pods.values() if not p["metadata"].get("deletionTimestamp")]
    return [p["metadata"]["name"] for p in deletion_order(active)]
