"""The stand-in's writes of whole Deployments (``POST .../deployments``, ``PATCH .../deployments/{name}``),
validated as the API server validates an ``apps/v1`` Deployment, as far as the runtime's writes go:

- ``metadata.name`` a DNS-1123 subdomain; a namespace in the body that is not the request's (400);
  a name taken (409 AlreadyExists); label keys and values valid;
- ``spec.selector`` required and non-empty; it must select the pod template's labels
  (``matchLabels`` and ``matchExpressions``: In, NotIn, Exists, DoesNotExist), else 422
  "`selector` does not match template `labels`"; immutable on a patch (422);
- at least one container, each with a unique name and an image; ``replicas`` an int >= 0
  (unset: 1);
- the server's fields: ``uid``, ``resourceVersion``, ``creationTimestamp``, ``generation`` (1, then
  + 1 on each patch that changes the spec), ``status``; the rest of ``metadata`` from the body is
  kept (labels, annotations), server fields in the body are ignored on a create.

Not modelled: defaulting beyond ``replicas`` (strategy, revisionHistoryLimit, ...), the pod
spec's own validation (probes, ports, resources), and rollouts (a template change does nothing).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from tests.k8s.semantics import status_error

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_KEPT_META = ("name", "labels", "annotations")


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector (``matchLabels`` and ``matchExpressions``) selects ``labels``."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or ())
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}.get(op)
        if ok is None:
            raise ValueError(f"{op!r} is not a valid selector operator")
        if not ok:
            return False
    return True


def _labels_invalid(labels: Any, where: str) -> str | None:
    if not isinstance(labels, dict):
        return f"{where}: Invalid value: must be a map"
    for key, value in labels.items():
        name = str(key).rsplit("/", 1)[-1]
        if len(name) > 63 or not _LABEL_NAME.match(name):
            return f"{where}: Invalid value: {key!r}: name part must consist of alphanumeric characters"
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            return f"{where}: Invalid value: {value!r}: a valid label must be 63 characters or less"
    return None


def invalid(deployment: Mapping[str, Any]) -> str | None:
    """The first reason the API server would reject this Deployment, or None."""
    meta, spec = deployment.get("metadata") or {}, deployment.get("spec") or {}
    name = meta.get("name")
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        return f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain"
    template = spec.get("template") or {}
    template_labels = (template.get("metadata") or {}).get("labels") or {}
    for labels, where in ((meta.get("labels") or {}, "metadata.labels"),
                          (template_labels, "spec.template.metadata.labels")):
        if why := _labels_invalid(labels, where):
            return why
    selector = spec.get("selector")
    if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        return "spec.selector: Required value"
    try:
        if not selector_matches(selector, template_labels):
            return (f"spec.template.metadata.labels: Invalid value: {template_labels!r}: "
                    "`selector` does not match template `labels`")
    except (ValueError, KeyError) as exc:
        return f"spec.selector: Invalid value: {exc}"
    replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        return f"spec.replicas: Invalid value: {replicas!r}: must be greater than or equal to 0"
    containers = (template.get("spec") or {}).get("containers") or []
    if not containers:
        return "spec.template.spec.containers: Required value"
    names = [c.get("name") for c in containers]
    for i, c in enumerate(containers):
        if not c.get("name") or names.count(c.get("name")) > 1:
            return f"spec.template.spec.containers[{i}].name: Invalid value: {c.get('name')!r}"
        if not c.get("image"):
            return f"spec.template.spec.containers[{i}].image: Required value"
    return None


async def json_body(request: web.Request) -> Any:
    """A create's body, or the 400 the API server answers when it is no JSON."""
    try:
        return await request.json()
    except ValueError as exc:
        return status_error(400, "BadRequest", f"the body is not JSON: {exc}")


def created(body: Any, namespace: str, meta: dict[str, Any]) -> dict[str, Any] | web.Response:
    """The Deployment the API server stores for a create's ``body`` (``meta``: the server's
    metadata for its name), or the error it answers."""
    if not isinstance(body, dict) or body.get("kind") != "Deployment" or body.get("apiVersion") != "apps/v1":
        return status_error(400, "BadRequest", "the body is no apps/v1 Deployment")
    given = body.get("metadata") or {}
    if given.get("namespace") not in (None, namespace):
        return status_error(400, "BadRequest", "the namespace of the provided object does not match the "
                            "namespace sent on the request")
    if why := invalid(body):
        return status_error(422, "Invalid", f"Deployment.apps {given.get('name')!r} is invalid: {why}")
    spec = copy.deepcopy(body["spec"])
    spec.setdefault("replicas", 1)
    kept = {k: copy.deepcopy(given[k]) for k in _KEPT_META if k in given}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {**meta, **kept, "generation": 1}, "spec": spec,
            "status": {"replicas": 0, "readyReplicas": 0}}


def created_budget(body: Any, namespace: str, cluster: Any) -> dict[str, Any] | web.Response:
    """The PodDisruptionBudget the API server stores for a create's ``body``, or its error: one
    of minAvailable and maxUnavailable, a selector, a name not taken (``cluster.budgets``)."""
    if not isinstance(body, dict) or body.get("kind") != "PodDisruptionBudget" or \
            body.get("apiVersion") != "policy/v1":
        return status_error(400, "BadRequest", "the body is no policy/v1 PodDisruptionBudget")
    given, spec = body.get("metadata") or {}, body.get("spec") or {}
    name = str(given.get("name") or "")
    if namespace != cluster.namespace:
        return status_error(404, "NotFound", f'namespaces "{namespace}" not found')
    if name in cluster.budgets:
        return status_error(409, "AlreadyExists", f'poddisruptionbudgets.policy "{name}" already exists')
    if ("minAvailable" in spec) == ("maxUnavailable" in spec) or not spec.get("selector"):
        return status_error(422, "Invalid", f"PodDisruptionBudget.policy {name!r} is invalid: spec: one of "
                            "minAvailable and maxUnavailable, and a selector, are required")
    if why := _labels_invalid(given.get("labels"), "metadata.labels"):
        return status_error(422, "Invalid", f"PodDisruptionBudget.policy {name!r} is invalid: {why}")
    kept = {k: copy.deepcopy(given[k]) for k in _KEPT_META if k in given}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {**cluster.meta(name), **kept, "generation": 1}, "spec": copy.deepcopy(spec)}


def patched(current: dict[str, Any], after: dict[str, Any]) -> str | None:
    """Validate a patched Deployment against its current self and store it; or why not (422)."""
    name = current["metadata"]["name"]
    for key in ("name", "namespace", "uid", "creationTimestamp"):
        if (after.get("metadata") or {}).get(key) != current["metadata"].get(key):
            return f"Deployment.apps {name!r} is invalid: metadata.{key}: field is immutable"
    if (after.get("spec") or {}).get("selector") != current["spec"]["selector"]:
        return f"Deployment.apps {name!r} is invalid: spec.selector: field is immutable"
    if why := invalid(after):
        return f"Deployment.apps {name!r} is invalid: {why}"
    if after["spec"] != current["spec"]:
        current["spec"] = copy.deepcopy(after["spec"])
        current["metadata"]["generation"] += 1
    for key in ("labels", "annotations"):
        current["metadata"][key] = copy.deepcopy((after["metadata"].get(key)) or {})
    return None
