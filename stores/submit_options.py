"""What a submit takes from its tier's policy: the ready shard count, the ``WAIT`` after its
writes (``replica_acks``), and the groups its users are split into.

A client reads them in one round trip (:func:`read_submit_options`) and again every
``OPTIONS_TTL_S``; it never validates the whole policy, and reads leniently (see
:func:`submit_options_of`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from protocol import keys
from protocol.codec import as_str
from protocol.groups import assign, pool_name, validate_group
from protocol.ids import InvalidId
from protocol.policy import MAX_REPLICA_ACK_TIMEOUT_MS, MAX_REPLICA_ACKS
from protocol.policy_legacy import flat_view
from stores.bad_state import readable
from stores.replicas import ReplicaWait
from stores.roundtrips import Op, Pipelined, operation

OPTIONS_TTL_S = 5.0  # a client reads the tier's submit options again after this long


@dataclass(frozen=True)
class SubmitOptions:
    """What a submit takes from the tier's policy: the ready shard count, and the ``WAIT``
    after the submit's writes (``replica_acks``; None: no WAIT is sent)."""

    shards: int = 1
    wait: ReplicaWait | None = None
    groups: tuple[tuple[str, float], ...] = ()  # the tier's groups and weights (protocol.groups)
    rejected: frozenset[str] = frozenset()  # groups the commander rejected: weight 0 at submit
    retention_ms: int = 0  # an inbox expires this long after its last submit (0: never)


def queue_options_probe(pipe: Any, tier: str) -> None:
    """The tier's policy key, its last good copy and its rejected groups (one slot, the policy
    key's): :func:`submit_options_of` reads them."""
    pipe.get(keys.policy(tier))
    pipe.get(keys.policy_good(tier))
    pipe.hgetall(keys.groups_rejected(tier))  # (HGETALL: the documented ACL grants it, not HKEYS)


def _policy_fields(raw: Any, good: Any) -> dict[str, Any]:
    """The fields of the policy JSON ``raw``, else of ``good`` (the last valid one), else {}."""
    for blob in (raw, good):
        if not blob:
            continue
        try:
            fields = json.loads(blob)
        except (ValueError, RecursionError):
            continue
        if isinstance(fields, dict):
            return fields
    return {}


def _int_in(fields: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    n = fields.get(name, default)
    return n if isinstance(n, int) and not isinstance(n, bool) and low <= n <= high else default


def submit_options_of(raw: Any, good: Any, rejected: Iterable[Any] = ()) -> SubmitOptions:
    """The submit options of the policy JSON ``raw`` (else of ``good``). Lenient on purpose: a
    submit that uses a stale or odd value is still served (every worker of the tier reads every
    shard that exists, up to ``keys.MAX_READY_SHARDS``); an odd replica count means no WAIT; a
    turn sent to a group the user does not belong to is handed to the right one by the worker
    that meets it."""
    fields = flat_view(_policy_fields(raw, good))
    shards = _int_in(fields, "ready_shards", 1, 1, keys.MAX_READY_SHARDS)
    acks = _int_in(fields, "replica_acks", 0, 0, MAX_REPLICA_ACKS)
    timeout_ms = _int_in(fields, "replica_ack_timeout_ms", 100, 1, MAX_REPLICA_ACK_TIMEOUT_MS)
    return SubmitOptions(shards, ReplicaWait(acks, timeout_ms) if acks else None, _groups_of(fields),
                         frozenset(as_str(g, errors="replace") for g in rejected), _retention_ms(fields))


def _retention_ms(fields: dict[str, Any]) -> int:
    """``retention_days`` in ms; 0 (none) unless it is a number in the policy's bounds."""
    durability = fields.get("durability")
    days = durability.get("retention_days", 0) if isinstance(durability, dict) else 0
    if isinstance(days, bool) or not isinstance(days, (int, float)) or not 0 <= days <= 36_500:
        return 0
    return round(days * 86_400_000)


def _groups_of(fields: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """The (name, weight) of the policy's groups; () unless every one is well formed."""
    out: list[tuple[str, float]] = []
    groups = fields.get("groups")
    for g in groups if isinstance(groups, list) else ():
        name, weight = (g.get("name"), g.get("weight", 0)) if isinstance(g, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(weight, (int, float)) or isinstance(weight, bool):
            return ()
        try:
            out.append((validate_group(name), max(0.0, float(weight))))
        except InvalidId:
            return ()
    return tuple(out) if any(w > 0 for _, w in out) else ()


def split_by_pool(tier: str, built: list[Any], opts: SubmitOptions) -> list[tuple[str, list[Any]]]:
    """``built`` turns (``(Turn, payload)``) split by the pool each user's group is (by the hash
    against the weights; a pin is the worker's to honour: it hands the user over), in order: a
    user's turns all go to one pool, in their order. A tier without groups: one pool, itself."""
    if not opts.groups:
        return [(tier, built)]
    parts: dict[str, list[Any]] = {}
    for item in built:
        pool = pool_name(tier, assign(item[0].user, opts.groups, None, opts.rejected))
        parts.setdefault(pool, []).append(item)
    return list(parts.items())


def ready_shards_of(raw: Any, good: Any) -> int:
    """``ready_shards`` of :func:`submit_options_of`: 1..``keys.MAX_READY_SHARDS``, 1 when unnamed."""
    return submit_options_of(raw, good).shards


@operation
def read_submit_options(tier: str) -> Op[SubmitOptions]:
    """The tier's :class:`SubmitOptions`, in one round trip."""
    raw, good, rejected = yield Pipelined(lambda pipe: queue_options_probe(pipe, tier), raise_on_error=False)
    # a key of another type reads as absent: the submit goes on with the defaults
    return submit_options_of(readable(raw), readable(good), readable(rejected, {}))
