"""An in-process stand-in of the Kubernetes API server, for the ``kubernetes`` runtime's tests.

It serves, over real HTTP on a loopback port (an aiohttp app on an event loop of its own thread),
the endpoints the runtime calls through the official client, with their semantics:

- ``GET /apis/apps/v1/namespaces/{ns}/deployments[?labelSelector=]`` and ``.../deployments/{name}``;
  ``POST .../deployments`` and ``PATCH .../deployments/{name}``, validated as the API server
  validates a Deployment (``standin_writes.py``);
- ``GET`` and ``PATCH .../deployments/{name}/scale``: an ``autoscaling/v1`` Scale; a merge,
  strategic-merge or JSON patch; a ``metadata.resourceVersion`` in the patch is a precondition
  (409 Conflict when the object moved on); 415 for another content type;
- ``GET /api/v1/namespaces/{ns}/pods[?labelSelector=]``, ``GET`` and ``PATCH .../pods/{name}``
  (labels and annotations only: the rest of a pod is immutable here, 422);
- ``GET /apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers`` and
  ``GET /apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects`` (404 when "KEDA is not installed");

and runs the controllers of ``cluster.py`` (ReplicaSet, scheduler, kubelet with real ``fleet
worker`` processes) every ``tick_s``, with readiness probes (``GET /readyz`` on each container's
health port every ``probe_period_s``; one answer flips the condition: failure and success
thresholds of 1).

What it does not model: watches, authentication and RBAC, admission, server-side apply, field
managers, ``generation``/``observedGeneration`` rollouts (a Deployment is one ReplicaSet,
template changes do nothing), liveness and startup probes, minReadySeconds, PodDisruptionBudgets
and evictions, the LogarithmicScaleDown gate (ready times compare plainly), resource requests
(capacity is a pod count per node), node failures, and the API's eventual consistency across
several servers (every read here sees every write before it).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.k8s.cluster import Cluster
from tests.k8s.semantics import PATCH_TYPES, apply_patch, match_labels, selects, status_error
from tests.k8s.standin_writes import created, created_budget, json_body, patched


def public(obj: Any) -> Any:
    """An object as the API serves it: without the stand-in's own ``_`` fields."""
    if isinstance(obj, dict):
        return {k: public(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [public(v) for v in obj]
    return obj


class StandIn:
    """The API server, its controllers and its nodes, for one namespace."""

    def __init__(self, cluster: Cluster, tick_s: float = 0.05, probe_period_s: float = 0.2) -> None:
        self.cluster, self.tick_s, self.probe_period_s = cluster, tick_s, probe_period_s
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> str:
        """Serve on a free loopback port; return the URL (``Configuration.host``)."""
        self._thread = threading.Thread(target=self._main, name="k8s-standin", daemon=True)
        self._thread.start()
        self._started.wait(10)
        if self._error is not None or not self.url:
            raise RuntimeError(f"the stand-in did not start: {self._error!r}")
        return self.url

    def stop(self) -> None:
        """Stop serving and SIGKILL every pod's processes (by their process group)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(15)
        with self.cluster.lock:
            self.cluster.kill_all()

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start() and to the test
            self._error = exc
            self._started.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        runner = web.AppRunner(self._app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self._started.set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as http:
            tasks = [asyncio.create_task(self._every(self.tick_s, self._tick)),
                     asyncio.create_task(self._every(self.probe_period_s, lambda: self._probe(http)))]
            await self._stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()

    async def _every(self, period: float, fn: Callable[[], Any]) -> None:
        while True:
            result = fn()
            if asyncio.iscoroutine(result):
                await result
            await asyncio.sleep(period)

    def _tick(self) -> None:
        with self.cluster.lock:
            self.cluster.tick()

    async def _probe(self, http: aiohttp.ClientSession) -> None:
        with self.cluster.lock:
            targets = [(name, box.port) for name, box in self.cluster.containers.items()
                       if box.proc is not None and box.proc.poll() is None and box.port]
        answers = await asyncio.gather(*(self._ready(http, port) for _, port in targets))
        with self.cluster.lock:
            for (name, _port), ready in zip(targets, answers, strict=True):
                self.cluster.set_ready(name, ready)

    @staticmethod
    async def _ready(http: aiohttp.ClientSession, port: int) -> bool:
        try:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    # --- the tests' side -----------------------------------------------------------------
    def wait_for(self, predicate: Callable[[Cluster], Any], timeout: float, what: str) -> Any:
        """Block until ``predicate(cluster)`` (checked under the lock at each change) is truthy."""
        deadline = time.monotonic() + timeout
        with self.cluster.lock:
            while True:
                value = predicate(self.cluster)
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0 or self._error is not None:
                    raise AssertionError(f"timed out after {timeout}s waiting for {what}: "
                                         f"{self.describe()}")
                self.cluster.lock.wait(min(left, 0.5))

    def describe(self) -> str:
        """The pods in one line each (for a failure message)."""
        rows = []
        for name, pod in self.cluster.pods.items():
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])
            rows.append(f"{name} {pod['status']['phase']} node={pod['spec']['nodeName'] or '-'} "
                        f"ready={ready} deleting={bool(pod['metadata'].get('deletionTimestamp'))}")
        return "; ".join(rows) or "no pods"

    # --- the API -------------------------------------------------------------------------
    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._gate])
        apps = "/apis/apps/v1/namespaces/{ns}/deployments"
        pods = "/api/v1/namespaces/{ns}/pods"
        app.router.add_get(apps, self._list(lambda c: c.deployments, "DeploymentList", "apps/v1"))
        app.router.add_get(apps + "/{name}", self._get(lambda c: c.deployments, "deployments"))
        app.router.add_post(apps, self._create_deployment)
        app.router.add_patch(apps + "/{name}", self._patch_deployment)
        app.router.add_get(apps + "/{name}/scale", self._get_scale)
        app.router.add_patch(apps + "/{name}/scale", self._patch_scale)
        app.router.add_get(pods, self._list(lambda c: c.pods, "PodList", "v1"))
        app.router.add_get(pods + "/{name}", self._get(lambda c: c.pods, "pods"))
        app.router.add_patch(pods + "/{name}", self._patch_pod)
        app.router.add_get("/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
                           self._list(lambda c: c.hpas, "HorizontalPodAutoscalerList", "autoscaling/v2"))
        app.router.add_get("/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects", self._scaled_objects)
        app.router.add_post("/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", self._create_budget)
        app.router.add_delete("/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{name}",
                              self._deleting(lambda c: c.budgets, "poddisruptionbudgets.policy"))
        app.router.add_delete(apps + "/{name}", self._deleting(lambda c: c.deployments, "deployments.apps"))
        return app

    @web.middleware
    async def _gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Count every request by verb and resource ("GET pods", "PATCH scale"); answer 403, as
        RBAC does, for those in ``cluster.forbidden``."""
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else request.path
        kind = [part for part in path.split("/") if part and not part.startswith("{")][-1]
        call = f"{request.method} {kind}"
        with self.cluster.lock:
            self.cluster.requests[call] += 1
            forbidden = call in self.cluster.forbidden
        if forbidden:
            user = f"system:serviceaccount:{self.cluster.namespace}:fleet-commander"
            return status_error(403, "Forbidden",
                                f'{kind} is forbidden: User "{user}" cannot {request.method.lower()} it')
        response: web.StreamResponse = await handler(request)
        return response

    def _list(self, objects: Callable[[Cluster], dict[str, dict[str, Any]]], kind: str,
              api_version: str) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.Response:
            try:
                selector = request.query.get("labelSelector")
                with self.cluster.lock:
                    mine = request.match_info["ns"] == self.cluster.namespace
                    items = [public(o) for o in objects(self.cluster).values()
                             if mine and selects(selector, o["metadata"].get("labels"))]
                    version = self.cluster.version()
            except ValueError as exc:
                return status_error(400, "BadRequest", str(exc))
            return web.json_response({"apiVersion": api_version, "kind": kind,
                                      "metadata": {"resourceVersion": version}, "items": items})
        return handle

    def _get(self, objects: Callable[[Cluster], dict[str, dict[str, Any]]],
             resource: str) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.Response:
            with self.cluster.lock:
                obj = self._find(request, objects(self.cluster))
                body = public(obj) if obj is not None else None
            if body is None:
                return _not_found(resource, request.match_info["name"])
            return web.json_response(body)
        return handle

    def _find(self, request: web.Request, objects: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
        if request.match_info["ns"] != self.cluster.namespace:
            return None
        return objects.get(request.match_info["name"])

    async def _scaled_objects(self, request: web.Request) -> web.Response:
        if not self.cluster.keda:
            return web.Response(status=404, text="404 page not found\n")
        return await self._list(lambda c: c.scaled_objects, "ScaledObjectList", "keda.sh/v1alpha1")(request)

    def _scale_of(self, deployment: dict[str, Any]) -> dict[str, Any]:
        meta = deployment["metadata"]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
                             "resourceVersion": meta["resourceVersion"],
                             "creationTimestamp": meta["creationTimestamp"]},
                "spec": {"replicas": deployment["spec"]["replicas"]},
                "status": {"replicas": deployment["status"]["replicas"],
                           "selector": match_labels(deployment["spec"]["selector"]["matchLabels"])}}

    async def _get_scale(self, request: web.Request) -> web.Response:
        with self.cluster.lock:
            deployment = self._find(request, self.cluster.deployments)
            body = self._scale_of(deployment) if deployment is not None else None
        if body is None:
            return _not_found("deployments.apps", request.match_info["name"])
        return web.json_response(body)

    async def _patch_scale(self, request: web.Request) -> web.Response:
        def commit(deployment: dict[str, Any], scale: dict[str, Any]) -> web.Response | None:
            replicas = scale.get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                return status_error(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}")
            deployment["spec"]["replicas"] = replicas
            deployment["metadata"]["generation"] += 1
            return None

        return await self._patch(request, self.cluster.deployments, "deployments.apps", self._scale_of,
                                 commit)

    async def _create_deployment(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        with self.cluster.lock:
            namespace = request.match_info["ns"]
            name = str((body.get("metadata") or {}).get("name") or "") if isinstance(body, dict) else ""
            if namespace != self.cluster.namespace:
                return status_error(404, "NotFound", f'namespaces "{namespace}" not found')
            if name in self.cluster.deployments:
                return status_error(409, "AlreadyExists", f'deployments.apps "{name}" already exists')
            made = created(body, namespace, self.cluster.meta(name))
            if isinstance(made, web.Response):
                return made
            self.cluster.deployments[name] = made
            self.cluster.lock.notify_all()
            return web.json_response(public(made), status=201)

    def _deleting(self, objects: Callable[[Cluster], dict[str, dict[str, Any]]],
                  kind: str) -> Callable[[web.Request], Any]:
        """DELETE of one object: gone at once (a Deployment's pods are deleted with it, as the
        garbage collector does), answered with a Status; 404 if there is none."""
        async def handle(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            with self.cluster.lock:
                found = objects(self.cluster).pop(name, None) \
                    if request.match_info["ns"] == self.cluster.namespace else None
                if found is None:
                    return status_error(404, "NotFound", f'{kind} "{name}" not found')
                if found.get("kind") == "Deployment":
                    for pod in self.cluster.of(found):
                        self.cluster.delete_pod(pod["metadata"]["name"])
                self.cluster.deleted.append(name)
                self.cluster.lock.notify_all()
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Success",
                                      "details": {"name": name, "kind": kind.split(".")[0]}})
        return handle

    async def _create_budget(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        with self.cluster.lock:
            made = created_budget(body, request.match_info["ns"], self.cluster)
            if isinstance(made, web.Response):
                return made
            self.cluster.budgets[made["metadata"]["name"]] = made
            return web.json_response(public(made), status=201)

    async def _patch_deployment(self, request: web.Request) -> web.Response:
        def commit(deployment: dict[str, Any], after: dict[str, Any]) -> web.Response | None:
            why = patched(deployment, after)
            return status_error(422, "Invalid", why) if why is not None else None

        return await self._patch(request, self.cluster.deployments, "deployments.apps", public, commit)

    async def _patch_pod(self, request: web.Request) -> web.Response:
        def commit(pod: dict[str, Any], patched: dict[str, Any]) -> web.Response | None:
            changed = _mutable_only(public(pod), patched)
            if changed is not None:
                return status_error(422, "Invalid", f"Pod {pod['metadata']['name']!r} is invalid: "
                                    f"{changed}: field is immutable")
            for key in ("labels", "annotations"):
                pod["metadata"][key] = dict(patched["metadata"].get(key) or {})
            return None

        return await self._patch(request, self.cluster.pods, "pods", public, commit)

    async def _patch(self, request: web.Request, objects: dict[str, dict[str, Any]], resource: str,
                     view: Callable[[dict[str, Any]], dict[str, Any]],
                     commit: Callable[[dict[str, Any], dict[str, Any]], web.Response | None]) -> web.Response:
        """A PATCH of ``view(object)`` (the object, or its Scale): the patch applied, the
        resourceVersion precondition checked, ``commit`` validating and storing it."""
        patch, error = await _read_patch(request)
        if error is not None:
            return error
        with self.cluster.lock:
            obj = self._find(request, objects)
            if obj is None:
                return _not_found(resource, request.match_info["name"])
            before = view(obj)
            try:
                patched = apply_patch(before, request.content_type, patch)
            except (ValueError, KeyError, TypeError) as exc:
                return status_error(422, "Invalid", f"the patch does not apply: {exc}")
            refused = _conflict(before, patched, resource, obj["metadata"]["name"]) or commit(obj, patched)
            if refused is not None:
                return refused
            obj["metadata"]["resourceVersion"] = self.cluster.version()
            self.cluster.lock.notify_all()
            return web.json_response(view(obj))


async def _read_patch(request: web.Request) -> tuple[Any, web.Response | None]:
    if request.content_type not in PATCH_TYPES:
        return None, status_error(415, "UnsupportedMediaType",
                                  f"the body of the request was in an unknown format - accepted media "
                                  f"types include: {', '.join(PATCH_TYPES)}")
    try:
        return json.loads(await request.read()), None
    except ValueError as exc:
        return None, status_error(400, "BadRequest", f"the patch is not JSON: {exc}")


def _conflict(current: dict[str, Any], patched: dict[str, Any], resource: str,
              name: str) -> web.Response | None:
    """A resourceVersion in the patch that is not the object's: 409, as the API server answers."""
    wanted = (patched.get("metadata") or {}).get("resourceVersion")
    if wanted is None or wanted == current["metadata"]["resourceVersion"]:
        return None
    return status_error(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": the object '
                        "has been modified; please apply your changes to the latest version and try again")


def _mutable_only(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """The first field a pod patch changed beyond labels and annotations, or None."""
    for key in set(before) | set(after):
        if key != "metadata" and before.get(key) != after.get(key):
            return key
    meta_before, meta_after = before["metadata"], after["metadata"]
    for key in set(meta_before) | set(meta_after):
        mutable = key in ("labels", "annotations", "resourceVersion")
        if not mutable and meta_before.get(key) != meta_after.get(key):
            return f"metadata.{key}"
    return None


def _not_found(resource: str, name: str) -> web.Response:
    return status_error(404, "NotFound", f'{resource} "{name}" not found')


def read_log(cluster: Cluster, pod: str) -> str:
    """A pod's container log (every incarnation), for a failure message."""
    path = Path(cluster.workdir) / f"{pod}.log"
    return path.read_text(errors="replace") if path.exists() else ""
