"""A worker in a pod (worker/pod.py, worker/settings.py): its id and registry entry from the
downward API, an entry older readers still decode, and its readiness and liveness answers."""

from __future__ import annotations

import fakeredis
import msgpack
import pytest

from protocol.codec import decode, encode
from protocol.models import WorkerInfo
from worker.app import Worker
from worker.pod import Pod
from worker.settings import WorkerSettings


def test_the_pod_name_is_the_worker_id_and_the_node_its_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_WORKER_POD_NAME", "fleet-worker-chat-5f7c9d8b6-x2x9q")
    monkeypatch.setenv("FLEET_WORKER_NODE_NAME", "node-7")
    s = WorkerSettings(tier="chat")
    assert s.worker_id == "fleet-worker-chat-5f7c9d8b6-x2x9q" and s.host == "node-7"
    assert s.placement == {"runtime": "kubernetes", "pod": s.worker_id, "node": "node-7"}
    assert WorkerSettings(tier="chat", worker_id="w1").worker_id == "w1"  # a given id still wins
    monkeypatch.delenv("FLEET_WORKER_POD_NAME")
    monkeypatch.delenv("FLEET_WORKER_NODE_NAME")
    plain = WorkerSettings(tier="chat")
    assert plain.placement == {} and plain.worker_id.startswith("chat-")


def test_a_process_workers_entry_is_what_it_was_before_pods_existed() -> None:
    info = WorkerInfo(worker="w1", tier="chat", pid=1, host="h", started=1.0)
    body = msgpack.unpackb(encode(info))
    assert "pod" not in body and "node" not in body  # an older reader (extra fields forbidden) decodes it
    pod = WorkerInfo(worker="p", tier="chat", pid=1, host="n", started=1.0, runtime="kubernetes", pod="p",
                     node="n")
    assert decode(WorkerInfo, encode(pod)) == pod


@pytest.fixture
def pod(monkeypatch: pytest.MonkeyPatch) -> Pod:
    monkeypatch.setenv("FLEET_WORKER_POD_NAME", "pod-1")
    return Pod(Worker(WorkerSettings(tier="chat", heartbeat_ttl_ms=5000), r=fakeredis.FakeAsyncRedis()))


def test_ready_only_registered_reading_and_not_draining(pod: Pod) -> None:
    worker = pod.worker
    assert pod.readiness() == (False, "starting: not registered yet")
    worker.state = "ready"
    assert pod.readiness()[0]
    worker.redis_away = True
    assert pod.readiness() == (False, "the last read of the ready stream failed")
    worker.redis_away = False
    worker.drain("drain command")
    assert pod.readiness() == (False, "draining")
    assert not worker.terminated.is_set()  # a command: it will wait for its SIGTERM
    worker.drain("SIGTERM")
    assert worker.terminated.is_set()


def test_alive_while_the_heartbeat_loop_turns_whether_or_not_redis_answers(pod: Pod) -> None:
    ok, why = pod.liveness()
    assert ok and "last reached Redis never" in why  # just started: its start is its first attempt
    pod.worker.heartbeat.tried -= 4.0
    assert pod.liveness()[0]
    pod.worker.heartbeat.tried -= 2.0  # no attempt within the heartbeat's TTL: wedged
    ok, why = pod.liveness()
    assert not ok and why.startswith("no heartbeat attempted for 6.")
    pod.lingering = True  # drained and out of the registry, waiting for SIGTERM
    assert pod.liveness() == (True, "stopping")
