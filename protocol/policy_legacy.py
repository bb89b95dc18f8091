"""The flat policy layout (every field at the top level, one model for both kinds) and where each
of its keys lives now, for a turns tier and for an rq tier.

Policies stored in that layout are read through :data:`FLAT_KEYS` (``protocol.policy.parse_policy``
calls :func:`from_flat`) and written back nested by the next ``fleet policy set``. A flat key
with no place in the tier's kind is dropped, as the flat model ignored it, except an rq tier's
job settings on a turns tier, which the flat model refused unless null.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TURNS, RQ = 0, 1  # the index of a kind's path in a FLAT_KEYS entry

# flat key -> (its dotted path in a turns policy, in an rq policy); None: no place in that kind
FLAT_KEYS: dict[str, tuple[str | None, str | None]] = {
    "kind": ("kind", "kind"),
    "handler": ("handler", None),
    "handler_options": ("handler_options", None),
    "concurrency": ("concurrency", None),
    "max_attempts": ("max_attempts", None),
    "min_workers": ("min_workers", "min_workers"),
    "max_workers": ("max_workers", "max_workers"),
    "ready_shards": ("ready_shards", None),
    "target_buffer": ("scaling.target_buffer", "scaling.target_buffer"),
    "max_step_up": ("scaling.max_step_up", "scaling.max_step_up"),
    "users_per_instance": ("scaling.users_per_instance", None),
    "active_window_s": ("scaling.active_window_s", None),
    "target_backlog_per_worker": ("scaling.target_backlog_per_worker",
                                  "scaling.target_backlog_per_worker"),
    "target_rps_per_worker": ("scaling.target_rps_per_worker", "scaling.target_rps_per_worker"),
    "target_wait_s": ("scaling.target_wait_s", "scaling.target_wait_s"),
    "admission_threshold": ("scaling.occupancy.admission_threshold", None),
    "reception_threshold": ("scaling.occupancy.reception_threshold", None),
    "compaction_margin": ("scaling.occupancy.compaction_margin", None),
    "memory_limit_mb": ("scaling.occupancy.memory_limit_mb", None),
    "scale_down_stabilization_s": ("scaling.scale_down_stabilization_s",
                                   "scaling.scale_down_stabilization_s"),
    "scale_in_hold": ("scaling.scale_in_hold", "scaling.scale_in_hold"),
    "report_interval_s": ("scaling.report_interval_s", None),
    "scale_up": ("controls.scale_up", "controls.scale_up"),
    "scale_down": ("controls.scale_down", "controls.scale_down"),
    "fallback": ("controls.fallback", "controls.fallback"),
    "schedules": ("controls.schedules", "controls.schedules"),
    "paused": ("controls.paused", "controls.paused"),
    "paused_scale_in": ("controls.paused_scale_in", "controls.paused_scale_in"),
    "disruption_budget": ("controls.disruption_budget", "controls.disruption_budget"),
    "no_scale_in_windows": ("controls.no_scale_in_windows", "controls.no_scale_in_windows"),
    "drain_timeout_s": ("controls.drain_timeout_s", "controls.drain_timeout_s"),
    "pending_timeout_s": ("controls.pending_timeout_s", "controls.pending_timeout_s"),
    "max_protection_s": ("controls.max_protection_s", "controls.max_protection_s"),
    "max_worker_age_s": ("controls.max_worker_age_s", "controls.max_worker_age_s"),
    "max_turns_per_worker": ("controls.max_turns_per_worker", "controls.max_turns_per_worker"),
    "replica_acks": ("durability.replica_acks", None),
    "replica_ack_timeout_ms": ("durability.replica_ack_timeout_ms", None),
    "groups": ("rollout.groups", None),
    "canary": ("rollout.canary", None),
    "rollout_guard": ("rollout.guard", None),
    "queues": (None, "queues"),
    "retry_max": (None, "jobs.retry_max"),
    "retry_interval_s": (None, "jobs.retry_interval_s"),
    "job_timeout_s": (None, "jobs.timeout_s"),
}

# flat keys a turns policy refused unless null, and why
RQ_ONLY: dict[str, str] = {
    "retry_max": "retry_max and retry_interval_s apply only to an rq tier (kind=rq)",
    "retry_interval_s": "retry_max and retry_interval_s apply only to an rq tier (kind=rq)",
    "job_timeout_s": "job_timeout_s applies only to an rq tier (kind=rq)",
}


def flat_path(key: str, kind: int) -> str | None:
    """The dotted path of flat ``key`` in a policy of ``kind`` (TURNS or RQ); None: it has none.
    Raises KeyError for a key the flat layout did not have."""
    return FLAT_KEYS[key][kind]


def set_path(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set ``doc[path[0]][path[1]]... = value``. The objects on the way are copied (so an object
    ``doc`` shares with another document is left as it was), or made where there is none (a
    value on the way that is not an object, such as a null fallback, is replaced by one)."""
    node = doc
    for part in path[:-1]:
        child = node.get(part)
        node[part] = child = dict(child) if isinstance(child, dict) else {}
        node = child
    node[path[-1]] = value


def get_path(doc: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """``doc[path[0]][path[1]]...``, or None where the path is missing or not an object."""
    node: Any = doc
    for part in path:
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def from_flat(raw: Mapping[str, Any], kind: int, own: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with every flat key that is not one of the kind's own top-level fields (``own``)
    moved to its path (over what the path held: ``{**policy_json, "paused": true}`` pauses), or
    dropped when the kind has none. Other keys are left for validation (an unknown one is
    refused there). Raises ValueError for an rq-only job setting on a turns tier."""
    out: dict[str, Any] = {k: v for k, v in raw.items() if k in own or k not in FLAT_KEYS}
    for key, value in raw.items():
        if key in own or key not in FLAT_KEYS:
            continue
        path = flat_path(key, kind)
        if path is None:
            if kind == TURNS and key in RQ_ONLY and value is not None:
                raise ValueError(RQ_ONLY[key])
            continue
        set_path(out, tuple(path.split(".")), value)
    return out


def flat_view(doc: Mapping[str, Any]) -> dict[str, Any]:
    """For a lenient reader of the raw JSON (a submit's options): ``doc`` with each flat key that
    is missing read from its turns path, so either layout gives the same names. Never raises."""
    out = dict(doc)
    for key, (path, _) in FLAT_KEYS.items():
        if key in out or path is None or "." not in path:
            continue
        node = get_path(doc, tuple(path.split(".")))
        if node is not None:
            out[key] = node
    return out
