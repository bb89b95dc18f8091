"""The API calls of the ``kubernetes`` runtime, on the official client (the ``k8s`` extra).

Why this client: it is the Kubernetes project's own, kept in step with every release, and its
blocking API fits the commander, a blocking loop of passes (an asyncio client would need a loop
of its own in the commander's thread). Every call asks for the raw response
(``_preload_content=False``) and reads the JSON the API server sent: the runtime works on
the API's own documents, whatever generation of the client's model classes is installed.

The calls on one Deployment and on budgets serve groups (``group_deployments.py``): a group's
Deployment made from a copy of its tier's, with its PodDisruptionBudget, its image set when the
group's changes, and both deleted once the group is gone from the policy for good (only what
the runtime made itself).

The calls, and so the RBAC the commander's ServiceAccount needs in the workers' namespace:

=================================  ============================  ==========
call                               resource                      verb
=================================  ============================  ==========
``deployments``                    apps deployments              list
``deployment``                     apps deployments              get
``create_deployment``              apps deployments              create
``set_image``                      apps deployments              patch
``delete_deployment``              apps deployments              delete
``create_budget``                  policy poddisruptionbudgets   create
``delete_budget``                  policy poddisruptionbudgets   delete
``read_scale``                     apps deployments/scale        get
``write_scale``                    apps deployments/scale        patch
``pods``                           pods                          list
``annotate``                       pods                          patch
``scalers``                        autoscaling                   list
                                   horizontalpodautoscalers
``scalers``                        keda.sh scaledobjects         list
=================================  ============================  ==========

A 404 on ScaledObjects means KEDA is not installed: none. Any other error is raised
(``ApiException``, or urllib3's for a connection: ``API_ERRORS``) for the runtime to handle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from commander.runtime.kubernetes.model import (
    DELETION_COST,
    WORKERS_SELECTOR,
    Deployment,
    Pod,
    deployment_of,
    pod_of,
    scalers_of,
)

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
TIMEOUT = (3.05, 15.0)  # (connect, read) seconds of every call: a stuck API must not stall a pass
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)  # ValueError: bad JSON
__all__ = ["API_ERRORS", "TIMEOUT", "ApiException", "KubeApi", "api_client", "default_namespace", "describe"]


def describe(exc: BaseException) -> str:
    """One line for an API error."""
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason or ''}".strip()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """A client from ``kubeconfig`` (its current context), else the pod's in-cluster config."""
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    configuration = client.Configuration()
    config.load_incluster_config(client_configuration=configuration)
    return client.ApiClient(configuration)


def default_namespace(kubeconfig: str | None = None, namespace_file: Path = NAMESPACE_FILE) -> str:
    """The kubeconfig context's namespace, else the pod's own (the ServiceAccount's file), else
    ``default``."""
    if kubeconfig:
        _contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
        namespace = ((active or {}).get("context") or {}).get("namespace")
        if namespace:
            return str(namespace)
    if namespace_file.is_file():
        return namespace_file.read_text().strip() or "default"
    return "default"


def _body(response: Any) -> dict[str, Any]:
    """The JSON document of a raw response (and its connection back to the pool)."""
    try:
        body = json.loads(response.data)
    finally:
        response.release_conn()
    if not isinstance(body, dict):
        raise ValueError(f"the API answered {type(body).__name__}, not an object")
    return body


def _done_unless(call: Any, *args: Any, already: int) -> None:
    """Make a write call; the API's ``already`` status (409: it exists, 404: it is gone) means
    the write's effect is there already, and counts as done."""
    try:
        _body(call(*args, _preload_content=False, _request_timeout=TIMEOUT))
    except ApiException as exc:
        if exc.status != already:
            raise


class KubeApi:
    """The calls the runtime makes, in one namespace, on one ``ApiClient``."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.autoscaling = client.AutoscalingV2Api(api)
        self.policy = client.PolicyV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def close(self) -> None:
        self.api.close()

    def deployments(self) -> list[Deployment]:
        """Every worker Deployment of the namespace (label ``app.kubernetes.io/component=worker``)."""
        body = _body(self.apps.list_namespaced_deployment(
            self.namespace, label_selector=WORKERS_SELECTOR, _preload_content=False,
            _request_timeout=TIMEOUT))
        return [d for d in map(deployment_of, body.get("items") or ()) if d is not None]

    def pods(self) -> list[Pod]:
        """Every worker pod of the namespace."""
        body = _body(self.core.list_namespaced_pod(
            self.namespace, label_selector=WORKERS_SELECTOR, _preload_content=False,
            _request_timeout=TIMEOUT))
        return [p for p in map(pod_of, body.get("items") or ()) if p is not None]

    def deployment(self, name: str) -> dict[str, Any]:
        """One Deployment's JSON (a group's Deployment is made from a copy of it)."""
        return _body(self.apps.read_namespaced_deployment(
            name, self.namespace, _preload_content=False, _request_timeout=TIMEOUT))

    def create_deployment(self, body: dict[str, Any]) -> Deployment | None:
        """Create a Deployment from its JSON; return it as the API made it."""
        return deployment_of(_body(self.apps.create_namespaced_deployment(
            self.namespace, body, _preload_content=False, _request_timeout=TIMEOUT)))

    def create_budget(self, body: dict[str, Any]) -> None:
        """Create a PodDisruptionBudget from its JSON (``clone.budget_for``); one of that name
        existing already (a 409) is taken as made."""
        _done_unless(self.policy.create_namespaced_pod_disruption_budget, self.namespace, body, already=409)

    def delete_deployment(self, name: str) -> None:
        """Delete a Deployment (its ReplicaSets and pods go with it, by the garbage collector)."""
        _done_unless(self.apps.delete_namespaced_deployment, name, self.namespace, already=404)

    def delete_budget(self, name: str) -> None:
        """Delete a PodDisruptionBudget."""
        _done_unless(self.policy.delete_namespaced_pod_disruption_budget, name, self.namespace, already=404)

    def set_image(self, name: str, ops: list[dict[str, Any]]) -> Deployment | None:
        """Apply a JSON patch (``clone.image_patch``: a ``test`` of the container's name, then
        a ``replace`` of its image) to a Deployment; return it as patched."""
        return deployment_of(_body(self.apps.patch_namespaced_deployment(
            name, self.namespace, ops, _preload_content=False, _request_timeout=TIMEOUT)))

    def read_scale(self, deployment: str) -> tuple[int, str]:
        """The Deployment's ``spec.replicas`` through its ``/scale``, with its resourceVersion."""
        body = _body(self.apps.read_namespaced_deployment_scale(
            deployment, self.namespace, _preload_content=False, _request_timeout=TIMEOUT))
        return int((body.get("spec") or {}).get("replicas") or 0), str(body["metadata"]["resourceVersion"])

    def write_scale(self, deployment: str, replicas: int, resource_version: str) -> int:
        """Set ``spec.replicas`` through ``/scale``, only if it is still at ``resource_version``
        (else 409 Conflict: someone wrote it since it was read). Returns the new count."""
        patch = {"metadata": {"resourceVersion": resource_version}, "spec": {"replicas": replicas}}
        body = _body(self.apps.patch_namespaced_deployment_scale(
            deployment, self.namespace, patch, _preload_content=False, _request_timeout=TIMEOUT))
        return int((body.get("spec") or {}).get("replicas") or 0)

    def annotate(self, pod: str, cost: int) -> None:
        """Set the pod's ``controller.kubernetes.io/pod-deletion-cost``."""
        patch = {"metadata": {"annotations": {DELETION_COST: str(cost)}}}
        _body(self.core.patch_namespaced_pod(pod, self.namespace, patch, _preload_content=False,
                                             _request_timeout=TIMEOUT))

    def scalers(self) -> dict[str, list[str]]:
        """Deployment name -> the HPAs and KEDA ScaledObjects of the namespace that target it."""
        hpas = _body(self.autoscaling.list_namespaced_horizontal_pod_autoscaler(
            self.namespace, _preload_content=False, _request_timeout=TIMEOUT)).get("items") or []
        try:
            scaled = _body(self.custom.list_namespaced_custom_object(
                "keda.sh", "v1alpha1", self.namespace, "scaledobjects", _preload_content=False,
                _request_timeout=TIMEOUT)).get("items") or []
        except ApiException as exc:
            if exc.status != 404:  # 404: KEDA's resource is not installed in this cluster
                raise
            scaled = []
        return scalers_of(hpas, scaled)
