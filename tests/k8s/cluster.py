"""The stand-in's control plane and nodes: objects, the ReplicaSet controller, a scheduler with a
capacity, and a kubelet whose containers are real processes: the container's command, ``fleet``
being the console script (``fleet worker``, ``fleet rq-worker``).

Everything here runs under ``Cluster.lock`` (a ``threading.Condition``: tests wait on it for a
state, never sleep), driven by ``tick`` from the stand-in's event loop; the probes run apart
(``StandIn``) and report back through ``set_ready``.

What a tick does, in the controllers' order:

- **ReplicaSet**: a Deployment's active pods (not terminating, not Failed/Succeeded) against its
  ``spec.replicas``: too few, it creates Pending pods (``<deployment>-<hash>-<5 chars>``); too
  many, it deletes the first of ``semantics.deletion_order`` (graceful deletion, below) and
  records its choice in ``rs_deleted``.
- **scheduler**: an unscheduled pod older than ``schedule_delay_s`` gets the least loaded node
  with room (``capacity`` pods per node, terminating ones included until they are gone), else
  ``PodScheduled=False``, reason ``Unschedulable``.
- **kubelet**: a scheduled pod's container is started (the pod is Running, not ready until its
  readiness probe answers 200, and not ready again only after the probe's ``failureThreshold``
  failures in a row, 3 unless the container says, as a kubelet counts them (a single slow answer
  on a loaded machine does not flip it); one without a probe, ``fleet rq-worker``'s, is Ready
  while it runs); a container that exits while its pod is not terminating is restarted (restartPolicy
  Always: at once the first time, then after 10 s, 20 s, ... as CrashLoopBackOff); graceful
  deletion sends SIGTERM, then SIGKILL to the container's process group after
  ``terminationGracePeriodSeconds``; the pod object goes when its container has exited (at once
  for a pod with none), and ``ended`` says how.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import signal
import string
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import free_port
from tests.k8s.semantics import deletion_order

RS_HASH = "5f7c9d8b6"
_ALPHABET = string.ascii_lowercase + string.digits


def rfc3339(ts: float) -> str:
    """The API's time format: seconds, UTC."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


@dataclass
class Container:
    """The kubelet's side of one pod: its process, the port of its probes, its deadlines."""

    log: Path
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    kill_at: float | None = None  # monotonic: SIGKILL then (terminating)
    restart_at: float = 0.0  # monotonic: not restarted before
    killed: bool = False
    probe_failures: int = 0  # the readiness probe's failures in a row


@dataclass(frozen=True)
class Ended:
    """How a deleted pod's last container ended."""

    exit_code: int | None
    killed: bool
    restarts: int


@dataclass
class Cluster:
    """Objects and controllers of one namespace (see the module's doc)."""

    namespace: str
    workdir: Path
    pod_env: dict[str, str]
    command: list[str]
    capacity: int | None = None  # pods per node; None: no limit
    nodes: tuple[str, ...] = ("node-1", "node-2")
    schedule_delay_s: float = 0.1
    lock: threading.Condition = field(default_factory=threading.Condition)
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    hpas: dict[str, dict[str, Any]] = field(default_factory=dict)
    scaled_objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    budgets: dict[str, dict[str, Any]] = field(default_factory=dict)  # PodDisruptionBudgets by name
    deleted: list[str] = field(default_factory=list)  # the names DELETE removed, in order
    keda: bool = True  # False: the ScaledObject resource is not installed (404)
    containers: dict[str, Container] = field(default_factory=dict)
    rs_deleted: list[str] = field(default_factory=list)  # the ReplicaSet's choices, in order
    ended: dict[str, Ended] = field(default_factory=dict)
    requests: Counter[str] = field(default_factory=Counter)  # "GET pods", "PATCH scale", ...
    forbidden: set[str] = field(default_factory=set)  # such calls get 403 (a Role without the verb)
    _rv: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    # --- objects -------------------------------------------------------------------------
    def version(self) -> str:
        return str(next(self._rv))

    def meta(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        now = time.time()
        return {"name": name, "namespace": self.namespace, "uid": secrets.token_hex(8),
                "resourceVersion": self.version(), "creationTimestamp": rfc3339(now),
                "labels": dict(labels or {}), "_created": now}

    def add_deployment(self, name: str, tier: str, replicas: int = 0, grace_s: int = 30,
                       env: dict[str, str] | None = None, command: list[str] | None = None,
                       group: str | None = None, image: str = "fleet:1") -> None:
        """A worker Deployment of ``tier`` (of its ``group``: the group label, and
        ``FLEET_WORKER_GROUP`` as the manifests set it); ``command`` (default ``fleet worker
        --tier <tier>``) is its container's, ``fleet`` being the console script; only ``fleet
        worker`` has a readiness probe."""
        labels = {"app.kubernetes.io/component": "worker", "fleet.dev/tier": tier}
        env = dict(env or {})
        if group is not None:
            labels["fleet.dev/group"] = group
            env["FLEET_WORKER_GROUP"] = group
        container: dict[str, Any] = {"name": "worker", "image": image,
                                     "command": command or ["fleet", "worker", "--tier", tier],
                                     "env": [{"name": k, "value": v} for k, v in env.items()]}
        if container["command"][1] == "worker":
            container.update(ports=[{"name": "health", "containerPort": 8081}],
                             readinessProbe={"httpGet": {"path": "/readyz", "port": "health"}})
        self.deployments[name] = {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {**self.meta(name, labels), "generation": 1},
            "spec": {"replicas": replicas, "selector": {"matchLabels": dict(labels)},
                     "template": {"metadata": {"labels": dict(labels)},
                                  "spec": {"terminationGracePeriodSeconds": grace_s,
                                           "containers": [container]}}},
            "status": {"replicas": 0, "readyReplicas": 0}}
        self.lock.notify_all()

    def add_autoscaler(self, kind: str, name: str, target: str) -> None:
        """An HPA (``kind="hpa"``) or a KEDA ScaledObject targeting Deployment ``target``."""
        ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": target}
        if kind == "hpa":
            self.hpas[name] = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                               "metadata": self.meta(name), "spec": {"scaleTargetRef": ref,
                                                                     "minReplicas": 1, "maxReplicas": 5}}
        else:
            self.scaled_objects[name] = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                                         "metadata": self.meta(name),
                                         "spec": {"scaleTargetRef": {"name": target}}}

    def of(self, deployment: dict[str, Any]) -> list[dict[str, Any]]:
        """The Deployment's pods (its ReplicaSet's)."""
        rs = f"{deployment['metadata']['name']}-{RS_HASH}"
        return [p for p in self.pods.values()
                if any(o["name"] == rs for o in p["metadata"].get("ownerReferences") or ())]

    # --- the controllers -----------------------------------------------------------------
    def tick(self) -> None:
        """One round of every controller (under the lock)."""
        now = time.monotonic()
        for deployment in list(self.deployments.values()):
            self._replicaset(deployment)
        self._schedule(now)
        for name in list(self.pods):
            self._kubelet(name, now)
        for deployment in self.deployments.values():
            pods = self.of(deployment)
            deployment["status"] = {"replicas": len(pods), "readyReplicas": sum(map(_ready, pods))}
        self.lock.notify_all()

    def _replicaset(self, deployment: dict[str, Any]) -> None:
        active = [p for p in self.of(deployment) if not p["metadata"].get("deletionTimestamp")
                  and p["status"]["phase"] not in ("Succeeded", "Failed")]
        diff = deployment["spec"]["replicas"] - len(active)
        for _ in range(max(0, diff)):
            self._create_pod(deployment)
        for pod in deletion_order(active)[:max(0, -diff)]:
            self.rs_deleted.append(pod["metadata"]["name"])
            self.delete_pod(pod["metadata"]["name"])

    def _create_pod(self, deployment: dict[str, Any]) -> None:
        rs = f"{deployment['metadata']['name']}-{RS_HASH}"
        name = f"{rs}-{''.join(secrets.choice(_ALPHABET) for _ in range(5))}"
        template = deployment["spec"]["template"]
        labels = {**template["metadata"]["labels"], "pod-template-hash": RS_HASH}
        meta = {**self.meta(name, labels), "annotations": {},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs,
                                     "controller": True}]}
        self.pods[name] = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                           "spec": {**template["spec"], "nodeName": ""},
                           "status": {"phase": "Pending", "conditions": [], "containerStatuses": []}}
        self.containers[name] = Container(log=self.workdir / f"{name}.log")

    def delete_pod(self, name: str, grace_s: int | None = None) -> None:
        """Graceful deletion (the ReplicaSet's, or ``kubectl delete pod [--grace-period]``): SIGTERM
        now, SIGKILL after the grace period (the pod's own by default); the object goes once its
        container has exited."""
        pod = self.pods[name]
        if pod["metadata"].get("deletionTimestamp"):
            return
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30) if grace_s is None else grace_s
        pod["metadata"].update(deletionTimestamp=rfc3339(time.time()), deletionGracePeriodSeconds=grace,
                               resourceVersion=self.version())
        box = self.containers[name]
        box.kill_at = time.monotonic() + grace
        if box.proc is not None and box.proc.poll() is None:
            box.proc.send_signal(signal.SIGTERM)

    def _schedule(self, now: float) -> None:
        load = Counter(p["spec"]["nodeName"] for p in self.pods.values() if p["spec"]["nodeName"])
        for pod in self.pods.values():
            if pod["spec"]["nodeName"] or pod["metadata"].get("deletionTimestamp"):
                continue
            if time.time() - pod["metadata"]["_created"] < self.schedule_delay_s:
                continue
            room = [n for n in self.nodes if self.capacity is None or load[n] < self.capacity]
            if not room:
                _condition(pod, "PodScheduled", "False", "Unschedulable",
                           f"0/{len(self.nodes)} nodes are available: {len(self.nodes)} Insufficient cpu.")
                continue
            node = min(room, key=lambda n: (load[n], n))
            load[node] += 1
            pod["spec"]["nodeName"] = node
            _condition(pod, "PodScheduled", "True")
            pod["metadata"]["resourceVersion"] = self.version()

    def _kubelet(self, name: str, now: float) -> None:
        pod, box = self.pods[name], self.containers[name]
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        exited = box.proc is not None and box.proc.poll() is not None
        if deleting and (box.proc is None or exited):
            self._finalize(name)
            return
        if deleting:
            if box.kill_at is not None and now >= box.kill_at and not box.killed:
                box.killed = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(box.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
            return
        if exited:
            self._container_exited(pod, box, now)
        if pod["spec"]["nodeName"] and box.proc is None and now >= box.restart_at:
            self._start_container(pod, box)

    def _container_exited(self, pod: dict[str, Any], box: Container, now: float) -> None:
        assert box.proc is not None
        code, box.proc = box.proc.returncode, None
        statuses = pod["status"]["containerStatuses"]
        restarts = statuses[0]["restartCount"] + 1 if statuses else 1
        box.restart_at = now + (0.0 if restarts == 1 else min(10.0 * 2 ** (restarts - 2), 300.0))
        pod["status"]["containerStatuses"] = [{
            "name": "worker", "ready": False, "restartCount": restarts,
            "state": {"waiting": {"reason": "CrashLoopBackOff" if restarts > 1 else "ContainerCreating"}},
            "lastState": {"terminated": {"exitCode": code}}}]
        _condition(pod, "Ready", "False")
        pod["metadata"]["resourceVersion"] = self.version()

    def _start_container(self, pod: dict[str, Any], box: Container) -> None:
        name, (container,) = pod["metadata"]["name"], pod["spec"]["containers"]
        probed = "readinessProbe" in container  # else Ready while it runs, as a kubelet has it
        box.port, box.probe_failures = (free_port() if probed else 0), 0
        health = {"FLEET_WORKER_HEALTH_PORT": str(box.port), "FLEET_WORKER_HEALTH_HOST": "127.0.0.1"}
        declared = container.get("env") or []
        env = {**self.pod_env, **{e["name"]: e["value"] for e in declared if "value" in e},
               "FLEET_WORKER_POD_NAME": name, "FLEET_WORKER_NODE_NAME": pod["spec"]["nodeName"],
               **(health if probed else {})}
        with box.log.open("ab") as out:
            box.proc = subprocess.Popen([*self.command, *container["command"][1:]], env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        statuses = pod["status"]["containerStatuses"]
        restarts = statuses[0]["restartCount"] if statuses else 0
        pod["status"]["phase"] = "Running"
        running = {"startedAt": rfc3339(time.time())}
        pod["status"]["containerStatuses"] = [{"name": "worker", "ready": not probed,
                                               "restartCount": restarts, "state": {"running": running}}]
        if not probed:
            _condition(pod, "Ready", "True")
        pod["metadata"]["resourceVersion"] = self.version()

    def _finalize(self, name: str) -> None:
        pod, box = self.pods.pop(name), self.containers.pop(name)
        statuses = pod["status"]["containerStatuses"]
        code = box.proc.returncode if box.proc is not None else None
        self.ended[name] = Ended(code, box.killed, statuses[0]["restartCount"] if statuses else 0)

    def set_ready(self, name: str, ready: bool) -> None:
        """A readiness probe's answer (200 or not) for a pod whose container runs: Ready at the
        first success, not Ready at the ``failureThreshold``-th failure in a row."""
        pod, box = self.pods.get(name), self.containers.get(name)
        if pod is None or box is None:
            return
        box.probe_failures = 0 if ready else box.probe_failures + 1
        (container,) = pod["spec"]["containers"]
        if not ready and box.probe_failures < container["readinessProbe"].get("failureThreshold", 3):
            return
        if _ready(pod) == ready:
            return
        _condition(pod, "Ready", "True" if ready else "False")
        for cs in pod["status"]["containerStatuses"]:
            cs["ready"] = ready
        pod["metadata"]["resourceVersion"] = self.version()
        self.lock.notify_all()

    def crash(self, name: str) -> None:
        """SIGKILL a pod's container (an OOM kill, say): the kubelet restarts it."""
        box = self.containers[name]
        assert box.proc is not None and box.proc.poll() is None, f"pod {name} runs no container"
        os.killpg(box.proc.pid, signal.SIGKILL)

    def kill_all(self) -> None:
        """SIGKILL every container's process group and wait for them (teardown)."""
        for box in self.containers.values():
            if box.proc is not None and box.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(box.proc.pid, signal.SIGKILL)
        for box in self.containers.values():
            if box.proc is not None:
                box.proc.wait(timeout=10)


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])


def _condition(pod: dict[str, Any], kind: str, status: str, reason: str = "", message: str = "") -> None:
    conditions = pod["status"]["conditions"]
    for cond in conditions:
        if cond["type"] == kind:
            if cond["status"] != status:
                cond.update(status=status, lastTransitionTime=rfc3339(time.time()), _since=time.time())
            cond.update(reason=reason, message=message)
            return
    conditions.append({"type": kind, "status": status, "reason": reason, "message": message,
                       "lastTransitionTime": rfc3339(time.time()), "_since": time.time()})
