"""The API server's and the ReplicaSet controller's rules the stand-in follows, written apart from
the runtime's own code (``commander/runtime/kubernetes/model.py``) so that one cannot mirror the other's
mistakes: label selectors, merge and JSON patches, ``Status`` errors, and the order in which a
ReplicaSet deletes pods on a scale-down.

The order is ``ActivePodsWithRanks.Less`` of kubernetes ``pkg/controller/controller_utils.go``:

1. unassigned < assigned (no ``spec.nodeName`` first);
2. Pending < Unknown < Running;
3. not ready < ready;
4. lower ``controller.kubernetes.io/pod-deletion-cost`` < higher (an unparsable one counts 0);
5. doubled up < not: more active pods of the ReplicaSet on the same node first;
6. both ready: the more recently ready first (an empty time first); the stand-in compares the
   times plainly, as with the LogarithmicScaleDown gate off (on, it compares their log2 buckets);
7. more container restarts first;
8. empty creation time < newer < older.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Mapping
from typing import Any

from aiohttp import web

COST = "controller.kubernetes.io/pod-deletion-cost"
_PHASE = {"Pending": 0, "Unknown": 1, "Running": 2}
_SET_RE = re.compile(r"^\s*(!?)([A-Za-z0-9_./-]+)\s*(?:(in|notin)\s*\(([^)]*)\))?\s*$")
_EQ_RE = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(==|=|!=)\s*([A-Za-z0-9_.-]*)\s*$")


# --- label selectors ---------------------------------------------------------------------
def _terms(selector: str) -> list[str]:
    """Split on the commas that are not inside ``in (a, b)``."""
    terms, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    terms.append(current)
    return [t for t in terms if t.strip()]


def _term_matches(term: str, labels: Mapping[str, str]) -> bool:
    eq = _EQ_RE.match(term)
    if eq:
        key, op, value = eq.groups()
        return (labels.get(key) == value) if op in ("=", "==") else labels.get(key) != value
    st = _SET_RE.match(term)
    if not st:
        raise ValueError(f"unable to parse requirement: {term!r}")
    negated, key, op, values = st.groups()
    if op is None:
        return (key not in labels) if negated else (key in labels)
    choices = {v.strip() for v in values.split(",")}
    return (labels.get(key) in choices) if op == "in" else labels.get(key) not in choices


def selects(selector: str | None, labels: Mapping[str, str] | None) -> bool:
    """Whether a label selector (equality and set-based terms) matches ``labels``."""
    return all(_term_matches(t, labels or {}) for t in _terms(selector or ""))


def match_labels(selector: Mapping[str, str]) -> str:
    """A ``matchLabels`` map as a selector string (a Scale's ``status.selector``)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


# --- patches -------------------------------------------------------------------------------
def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` deletes, anything else replaces. (A strategic
    merge patch is the same for the maps and scalars the runtime patches.)"""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _step(node: Any, part: str) -> Any:
    """One step of a JSON pointer: a key of an object, an index of an array."""
    if isinstance(node, list):
        if not part.isdigit() or int(part) >= len(node):
            raise ValueError(f"no index {part!r} in an array of {len(node)}")
        return int(part)
    if not isinstance(node, dict):
        raise ValueError(f"cannot step into a {type(node).__name__} at {part!r}")
    return part


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 on objects and arrays (by index): ``add`` (to an object), ``replace``,
    ``remove``, ``test``."""
    out = copy.deepcopy(doc)
    if not isinstance(ops, list):
        raise ValueError("a JSON patch is a list of operations")
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = out
        for part in parents:
            node = node[_step(node, part)]
        kind = op["op"]
        key = _step(node, last) if isinstance(node, list) or kind != "add" else last
        if kind in ("add", "replace"):
            if kind == "replace" and isinstance(node, dict) and key not in node:
                raise ValueError(f"replace of a missing {op['path']}")
            node[key] = op["value"]
        elif kind == "remove":
            del node[key]
        elif kind == "test":
            if (node[key] if isinstance(node, list) or key in node else None) != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        else:
            raise ValueError(f"unsupported op {kind!r}")
    return out


PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json",
               "application/json-patch+json")


def apply_patch(doc: dict[str, Any], content_type: str, patch: Any) -> dict[str, Any]:
    """Apply a patch of the given content type (one of ``PATCH_TYPES``)."""
    if content_type == "application/json-patch+json":
        result = json_patch(doc, patch)
    else:
        result = merge_patch(doc, patch)
    if not isinstance(result, dict):
        raise ValueError("the patched object is not an object")
    return result


def status_error(code: int, reason: str, message: str) -> web.Response:
    """A ``Status`` failure, as the API server answers one."""
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)


# --- the ReplicaSet's deletion order ----------------------------------------------------------
def _cost(pod: Mapping[str, Any]) -> int:
    raw = (pod["metadata"].get("annotations") or {}).get(COST)
    try:
        value = int(raw) if raw is not None else 0
    except ValueError:
        return 0
    return value if -(2**31) <= value < 2**31 else 0


def _ready_since(pod: Mapping[str, Any]) -> float | None:
    for cond in pod["status"].get("conditions") or ():
        if cond["type"] == "Ready" and cond["status"] == "True":
            return float(cond.get("_since", 0.0))
    return None


def _restarts(pod: Mapping[str, Any]) -> int:
    return max((cs.get("restartCount", 0) for cs in pod["status"].get("containerStatuses") or ()), default=0)


def _after_or_zero(t1: float, t2: float) -> bool:
    if not t1 or not t2:
        return not t1
    return t1 > t2


def _less(a: Mapping[str, Any], b: Mapping[str, Any], rank: Mapping[str, int]) -> bool:  # noqa: C901
    na, nb = a["spec"].get("nodeName") or "", b["spec"].get("nodeName") or ""
    if na != nb and (not na or not nb):
        return not na
    pa, pb = _PHASE.get(a["status"].get("phase"), 0), _PHASE.get(b["status"].get("phase"), 0)
    if pa != pb:
        return pa < pb
    ra, rb = _ready_since(a), _ready_since(b)
    if (ra is None) != (rb is None):
        return ra is None
    if _cost(a) != _cost(b):
        return _cost(a) < _cost(b)
    if rank[a["metadata"]["name"]] != rank[b["metadata"]["name"]]:
        return rank[a["metadata"]["name"]] > rank[b["metadata"]["name"]]
    if ra is not None and rb is not None and ra != rb:
        return _after_or_zero(ra, rb)
    if _restarts(a) != _restarts(b):
        return _restarts(a) > _restarts(b)
    ca, cb = a["metadata"].get("_created", 0.0), b["metadata"].get("_created", 0.0)
    if ca != cb:
        return _after_or_zero(ca, cb)
    return False


def deletion_order(active: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ReplicaSet's pods, in the order it deletes them on a scale-down."""
    on_node: dict[str, int] = {}
    for pod in active:
        node = pod["spec"].get("nodeName") or ""
        on_node[node] = on_node.get(node, 0) + 1
    rank = {p["metadata"]["name"]: on_node[p["spec"].get("nodeName") or ""] for p in active}

    def compare(a: dict[str, Any], b: dict[str, Any]) -> int:
        return -1 if _less(a, b, rank) else 1 if _less(b, a, rank) else 0

    return sorted(active, key=functools.cmp_to_key(compare))
