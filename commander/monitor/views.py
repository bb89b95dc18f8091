"""What the monitor page shows, as plain JSON-ready data: pure functions of what was read.

Inputs are the commander's last pass (``board.Seen``), the tier chart's samples, ledger
entries and store rows; no Redis, no clock (``now`` comes in). Numbers are rounded here so the
page's payload stays small at hundreds of workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from commander.evaluator import Row, memory_limit_bytes, occupancy_of_rows, rates_of_rows, row_memory
from commander.monitor.board import Sample, Seen, TierSeen
from commander.snapshot import WorkerView
from protocol.deferral import validate_queue
from protocol.groups import Group, pool_name, split_pool, validate_pool
from protocol.ids import validate_tier, validate_user_id
from protocol.models import LedgerEvent, WorkerInfo
from protocol.policy import Policy
from stores.ledger import CorruptEvent, Entry, event_json

SCALE_ACTIONS = frozenset({"scale-up", "scale-down", "reclaim-idle", "consolidate", "recycle"})
POPULATION_COLUMNS = ("user", "turns", "handler_ms", "chars_in", "chars_out", "errors", "last_active_ts")
WORKERS_PAGE = 100  # workers in one page of the list, by default
WORKERS_PAGE_MAX = 1_000  # and at most
MAX_IDS = 1_000  # dead letters (or failed jobs) one retry, purge or requeue request may name
_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # RQ's job ids: letters, digits, _ and -


class BadRequest(ValueError):
    """A request the API refuses, with the one-line reason (a 400)."""


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# --- tiers ------------------------------------------------------------------------------
def tier_json(seen: TierSeen, dead_letters: int | None = None, tiers: Mapping[str, TierSeen] | None = None,
              policies: Mapping[str, Policy] | None = None) -> dict[str, Any]:
    """One tier's panel: counts vs desired and target, bounds, signals, the policy in force;
    with ``tiers`` (every row of the pass) and ``policies`` (grouped tiers' own policies, which
    have the groups), a group pool's groups (``groups_json``)."""
    return {**_counts(seen, dead_letters), **groups_json(seen, tiers or {}, policies or {})}


def groups_json(seen: TierSeen, tiers: Mapping[str, TierSeen],
                policies: Mapping[str, Policy]) -> dict[str, Any]:
    """For a row of a grouped tier (a group's pool; the tier's own while its workers drain): its
    tier's ``groups`` (each one's share of new users, weight, canary mark, ready workers and
    rejection) and ``canary``; a pool's own ``group`` too (``removed`` once the policy no longer
    names it). Empty for a tier without groups. A rejected group's users go to the others, so
    its share is 0 whatever its weight, as assignment has it."""
    tier, group = split_pool(seen.tier)
    policy = policies.get(tier) or (None if group else seen.policy)
    if policy is None or not policy.rollout.groups:
        return {}
    rollout = policy.rollout
    rejected = {g.name: getattr(tiers.get(pool_name(tier, g.name)), "group_rejected", None)
                for g in rollout.groups}
    live = {g.name: 0.0 if rejected[g.name] else g.weight for g in rollout.groups}
    total = sum(live.values())

    def one(g: Group) -> dict[str, Any]:
        pool = tiers.get(pool_name(tier, g.name))
        return {"group": g.name, "pool": pool_name(tier, g.name), "weight": g.weight,
                "share": round(100 * live[g.name] / total, 1) if total else 0.0,
                "canary": rollout.canary == g.name, "rejected": rejected[g.name],
                "ready": None if pool is None else sum(w.state == "ready" for w in pool.snapshot.workers)}

    out: dict[str, Any] = {"groups": [one(g) for g in rollout.groups], "canary": rollout.canary}
    if group:
        mine = next((g for g in rollout.groups if g.name == group), None)
        out["group"] = {**one(mine), "tier": tier} if mine is not None else {
            "group": group, "pool": seen.tier, "tier": tier, "removed": True}
    return out


def _counts(seen: TierSeen, dead_letters: int | None) -> dict[str, Any]:
    snap, plan, policy = seen.snapshot, seen.plan, seen.policy
    workers = snap.workers
    return {
        "tier": seen.tier,
        "ts": seen.ts,
        "workers": len(workers),  # every state, as the worker list has them
        "not_fresh": sum(1 for w in workers if not w.fresh),  # no recent report: occupancy unknown
        "ready": sum(1 for w in workers if w.state == "ready"),
        "starting": seen.starting,
        "draining": sum(1 for w in workers if w.state == "draining"),
        "desired": plan.desired,
        "target": plan.target,
        "min_workers": policy.min_workers,
        "max_workers": policy.max_workers,
        "backlog": snap.backlog,
        "active_users": snap.active_users,
        "rps": _r(snap.rps),
        "pressure": snap.pressure_events,
        "busy_slots": sum(w.busy for w in workers),
        "slots": sum(w.total for w in workers),
        "proposals": dict(plan.proposals),
        "clamp": plan.clamp,
        "held": plan.held,
        "reason": plan.reason,
        "policy_source": seen.source,
        "policy_error": seen.error,
        "policy": policy.model_dump(mode="json"),
        "dead_letters": dead_letters,
    }


def leader_json(holder: str | None, commanders: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Who leads (from the lease ``<commander>|<epoch>``) and where its monitor is."""
    leader, _, epoch = (holder or "").rpartition("|")
    leader = leader or (holder or "")
    url = next((c.get("monitor_url") for c in commanders
                if c.get("commander") == leader and c.get("monitor_url")), None)
    return {"leader": leader or None, "epoch": int(epoch) if epoch.isdigit() else None, "leader_url": url}


# --- workers ----------------------------------------------------------------------------
def row_percent(row: Row, limit: float | None) -> int:
    """One row's own occupancy (the max of its components at its instant, not averaged), in percent."""
    parts = (row.cpu, row_memory(row, limit), row.instant)
    return round(max((p for p in parts if p is not None), default=0.0) * 100)


def _window_json(window: Sequence[Row], limit: float | None, now: float) -> dict[str, Any]:
    latest = window[-1]
    occ = occupancy_of_rows(window, limit)
    rates = rates_of_rows(window)
    per_turn = None
    if rates is not None and rates.turns_per_s > 0:
        per_turn = rates.handler_busy / rates.turns_per_s
    return {
        "cpu": _r(occ.cpu), "memory": _r(occ.memory), "slots_use": _r(occ.slots),
        "users": latest.users, "active_users": latest.active_users, "rss": latest.rss,
        "turns_per_s": _r(rates.turns_per_s if rates else None),
        "errors_per_s": _r(rates.errors_per_s if rates else None),
        "handler_s_per_turn": _r(per_turn, 4),
        "report_age_s": _r(max(0.0, now - latest.ts), 1),
        "history": [row_percent(r, limit) for r in window],
        "history_span_s": _r(latest.ts - window[0].ts, 1),
    }


def worker_json(view: WorkerView, tier: str, window: Sequence[Row], info: WorkerInfo | None,
                limit: float | None, now: float) -> dict[str, Any]:
    """One worker row: occupancy and its components, its history over the evaluator's
    window (occupancy in percent, one value per report), rates, age, pid/host, state."""
    row: dict[str, Any] = {
        "worker": view.id, "tier": tier, "state": view.state, "fresh": view.fresh,
        "reception": view.is_reception, "occupancy": _r(view.occupancy), "busy": view.busy,
        "total": view.total, "age_s": _r(max(0.0, now - view.started), 1) if view.started else None,
        "pid": info.pid if info else None, "host": info.host if info else None,
    }
    if window:
        row.update(_window_json(window, limit, now))
    else:
        row["history"] = []
    return row


def problems_json(seen: Seen, commanders: Mapping[str, Any]) -> list[dict[str, str]]:
    """What the overview shows above the tiers: the leader's crash-looping pools (a worker that
    keeps exiting at start, with its last error) and the handlers live workers cannot load."""
    out = []
    leader = str(commanders.get("leader") or "").rpartition("|")[0]
    for c in commanders.get("list") or []:
        if c.get("commander") == leader:
            out += [{"kind": "crash-loop", "where": str(pool), "text": f"tier {pool} crash loop: {why}"}
                    for pool, why in sorted((c.get("crash_loop") or {}).items())]
    broken: dict[str, tuple[str, list[str]]] = {}
    for worker, (info, alive) in sorted(seen.registry.items()):
        for name, error in sorted(info.handler_errors.items()) if alive else ():
            broken.setdefault(name, (error, []))[1].append(worker)
    out += [{"kind": "handler-unavailable", "where": name,
             "text": f"handler {name} unavailable on {len(ws)} worker{'s' if len(ws) != 1 else ''} "
                     f"({', '.join(ws[:3])}{', ...' if len(ws) > 3 else ''}): {error}"}
            for name, (error, ws) in sorted(broken.items())]
    return out


def worker_order(seen: Seen, tier: str | None = None) -> list[tuple[TierSeen, WorkerView]]:
    """The workers of the last pass (of ``tier`` if given), by tier then id: the list's order."""
    return [(t, view) for name, t in sorted(seen.tiers.items()) if tier is None or name == tier
            for view in sorted(t.snapshot.workers, key=lambda v: v.id)]


def workers_page(seen: Seen, now: float, tier: str | None = None, offset: int = 0,
                 limit: int = WORKERS_PAGE) -> dict[str, Any]:
    """One page of the worker list (``worker_order``): ``limit`` rows from ``offset``, with the
    selection's ``total`` and ``next_offset`` (None on the last page). Only the page's rows are
    built, so its cost and size do not grow with the fleet."""
    order = worker_order(seen, tier)
    rows = []
    for t, view in order[offset:offset + limit]:
        limit_bytes = memory_limit_bytes(t.policy.scale_rules())
        info = seen.registry.get(view.id, (None, False))[0]
        rows.append(worker_json(view, t.tier, seen.windows.get(view.id, ()), info, limit_bytes, now))
    after = offset + limit
    return {"tier": tier, "offset": offset, "limit": limit, "total": len(order),
            "next_offset": after if after < len(order) else None, "workers": rows}


# --- the tier chart ---------------------------------------------------------------------
def _event_points(events: Iterable[Entry], before: float) -> list[list[Any]]:
    """Ledger scale events before ``before`` as chart points ``[ts, workers, desired]``."""
    points = []
    for _id, e in events:
        if isinstance(e, LedgerEvent) and e.action in SCALE_ACTIONS and e.ts < before:
            desired = e.why.get("desired") if isinstance(e.why.get("desired"), int) else e.to_count
            points.append([round(e.ts, 1), e.to_count, desired])
    return points


def chart_json(tier: str, samples: Sequence[Sample], events: Iterable[Entry], since: float,
               now: float) -> dict[str, Any]:
    """Workers and demand over ``[since, now]``: the commander's own samples while it led,
    and before them the ledger's scale events (their count after the change and the desired
    count that drove it), so a new leader's chart still shows the hour."""
    first = samples[0].ts if samples else now
    return {
        "tier": tier, "since": since, "now": now,
        "columns": ["ts", "ready", "starting", "draining", "desired", "target", "active_users",
                    "backlog", "rps", "busy_slots"],
        "samples": [[round(s.ts, 1), s.ready, s.starting, s.draining, s.desired, s.target, s.active_users,
                     s.backlog, round(s.rps, 2), s.busy_slots] for s in samples if s.ts >= since],
        "ledger_columns": ["ts", "workers", "desired"],
        "ledger": _event_points(events, first),
    }


# --- ledger, dead letters, population ---------------------------------------------------
def ledger_json(entries: Iterable[Entry]) -> list[dict[str, Any]]:
    """Ledger entries newest first, as ``fleet events --json`` prints them."""
    return [event_json(i, e) for i, e in reversed(list(entries))]


def corrupt_count(entries: Iterable[Entry]) -> int:
    """How many entries did not decode."""
    return sum(1 for _i, e in entries if isinstance(e, CorruptEvent))


def dead_letter_json(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Dead-letter rows (``DeadLetterRow.to_json()``) with their JSON preview decoded."""
    out = []
    for row in rows:
        row = dict(row)
        if isinstance(row.get("payload"), str):
            with contextlib.suppress(ValueError):  # not JSON: shown as the text it is
                row["payload"] = json.loads(row["payload"])
        out.append(row)
    return out


def retry_summary(outcomes: Sequence[Mapping[str, Any]], shown: int = 3) -> str:
    """One line on a retry (``Retried.to_json()`` outcomes): how many of the dead letters asked
    for were re-enqueued, and why the first ``shown`` others were not. Only outcome ``retried``
    counts: an id the page still showed after it was purged or retried elsewhere is ``unknown``,
    and nothing was submitted for it."""
    done = sum(1 for x in outcomes if x.get("outcome") == "retried")
    text = f"retried {done} of {len(outcomes)}"
    others = [x for x in outcomes if x.get("outcome") != "retried"]
    if others:
        why = ", ".join(f"{x.get('id')} ({x.get('reason') or x.get('outcome')})" for x in others[:shown])
        more = f" and {len(others) - shown} more" if len(others) > shown else ""
        text += f"; not retried: {why}{more}"
    return text


def plain(obj: Any) -> Any:
    """A store's value as JSON-ready data: ``to_json()``, a pydantic model or a dataclass."""
    if hasattr(obj, "to_json"):
        return obj.to_json()
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def population(rows: Iterable[Mapping[str, Any]], q: str = "", sort: str = "turns",
               limit: int = 500) -> list[Mapping[str, Any]]:
    """Users filtered by ``q`` (a substring of the user id), sorted by ``sort`` (a column;
    ``-col`` or a number column sorts high first, ``user`` alphabetically)."""
    key = sort.lstrip("-")
    if key not in POPULATION_COLUMNS:
        raise BadRequest(f"unknown sort column {key!r}: use one of {', '.join(POPULATION_COLUMNS)}")
    wanted = q.strip().lower()
    found = [row for row in rows if wanted in str(row.get("user", "")).lower()]
    high_first = key != "user" or sort.startswith("-")

    def value(row: Mapping[str, Any]) -> tuple[int, Any]:
        v = row.get(key)
        return (0, v) if isinstance(v, int | float | str) else (-1, 0)  # missing values last

    if key == "user":
        found.sort(key=lambda row: str(row.get("user", "")), reverse=high_first)
    else:
        found.sort(key=value, reverse=True)
        if not high_first:
            found.reverse()
    return found[:limit]


def dead_letter_request(body: Any) -> tuple[str, list[str] | None]:
    """``{tier, ids: [...]}`` or ``{tier, all: true}`` -> (tier, ids or None for all)."""
    return _selection(body, "tier", validate_tier, "dead letters'", "a stream entry id", _stream_id)


def requeue_request(body: Any) -> tuple[str, list[str] | None]:
    """``{queue, ids: [...]}`` or ``{queue, all: true}`` -> (an RQ queue, job ids or None for all)."""
    return _selection(body, "queue", validate_queue, "failed jobs'", "an RQ job id",
                      lambda i: bool(_JOB_ID.fullmatch(i)))


def _selection(body: Any, key: str, valid: Callable[[Any], str], whose: str, what: str,
               id_ok: Callable[[str], bool]) -> tuple[str, list[str] | None]:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object {{{key}, ids}} or {{{key}, all: true}}")
    try:
        name = valid(body.get(key))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if body.get("all") is True:
        if body.get("ids"):
            raise BadRequest("give ids or all: true, not both")
        return name, None
    ids = body.get("ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"give the {whose} ids (a non-empty list) or all: true")
    if len(ids) > MAX_IDS:
        raise BadRequest(f"at most {MAX_IDS} ids per request")
    for i in ids:
        if not isinstance(i, str) or not id_ok(i):
            raise BadRequest(f"not {what}: {str(i)[:40]!r}")
    return name, list(ids)


def _stream_id(text: str) -> bool:
    ms, dash, seq = text.partition("-")
    return ms.isdigit() and (not dash or seq.isdigit()) and len(text) <= 41


def user_param(user: str) -> str:
    """A user id from the URL, validated (a 400 otherwise)."""
    try:
        return validate_user_id(user)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def tier_param(tier: str | None, *, required: bool = False, pools: bool = False) -> str | None:
    """A tier from the query string, validated (a 400 otherwise); with ``pools``, a group's pool
    (``chat.green``: a row of its own, with its workers, chart and ledger) too."""
    if tier in (None, ""):
        if required:
            raise BadRequest("give a tier: ?tier=<name>")
        return None
    try:
        return validate_pool(tier) if pools else validate_tier(tier)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def queue_param(queue: str | None) -> str:
    """An RQ queue from the query string, validated (a 400 otherwise)."""
    if not queue:
        raise BadRequest("give a queue: ?queue=<name>")
    try:
        return validate_queue(queue)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def offset_param(value: str | None) -> int:
    """A place in a list from the query string: a whole number, 0 or more (a 400 otherwise)."""
    if value in (None, ""):
        return 0
    if not (value.isascii() and value.isdigit()):
        raise BadRequest(f"offset must be a whole number, 0 or more, not {value[:20]!r}")
    return int(value)


def count_param(value: str | None, default: int, cap: int) -> int:
    """A positive count from the query string, capped."""
    if value in (None, ""):
        return default
    if not (value.isascii() and value.isdigit()) or int(value) <= 0:
        raise BadRequest(f"count must be a positive integer, not {value[:20]!r}")
    return min(int(value), cap)

