"""Reading the fleet's state for people and machines: tiers, workers, backlog, dead letters."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import redis

from protocol import keys
from protocol.codec import as_str
from protocol.groups import pool_name, split_pool
from protocol.models import WorkerInfo
from protocol.policy import RqPolicy, TurnsPolicy
from stores.backlog import TierBacklog, active_users, live_ids, read_backlog, unserved_by_tier
from stores.bad_state import DEFAULT, BadState
from stores.cluster import is_cluster
from stores.connection import connect_rq
from stores.deadletters import dead_letter_count, dead_letter_kinds, newest_dead_letters
from stores.group_assignment import read_pool_policy, rejected_groups, with_group_pools
from stores.leader_lease import lease_holder
from stores.policies import list_tiers, read_policy, read_policy_status
from stores.registry import Registry, read_registry


def backlog_json(b: TierBacklog) -> dict[str, int]:
    """What status shows of a tier's ready stream (``--json`` keys: add, never rename)."""
    return {"lag": b.undelivered,  # notifications no worker has read yet
            "pending": b.pending,  # delivered, not acked (live workers' jobs and orphans)
            "in_progress": b.in_progress,  # pending held by a live worker
            "backlog": b.backlog}  # turns no worker has started: lag + orphaned pending


def tier_backlog(r: redis.Redis, tier: str, live: Collection[str] | None = None) -> dict[str, int]:
    """One tier's backlog (``stores.backlog``); ``live`` worker ids (and their renew intervals)
    are read if not given."""
    if live is None:
        reg = read_registry(r)
        bound = unserved_by_tier(reg.workers, [tier])
        return backlog_json(read_backlog(r, [tier], live_ids(reg.workers), bound)[tier])
    return backlog_json(read_backlog(r, [tier], live)[tier])


PAGE_SIZE = 100  # workers in one page of the list, by default
MAX_PAGE_SIZE = 1_000  # and at most, unless every worker is asked for (``size=None``)
SHOWN_WHERE = 10  # worker ids named per unavailable handler (the rest counted)


@dataclass(frozen=True)
class WorkerPage:
    """Which workers the list shows: those of ``tier`` (a tier or a group's pool; None: every
    worker, the unreadable entries too), page ``page`` (from 1) of ``size`` (None: all of them),
    in the order by tier, then worker id."""

    tier: str | None = None
    page: int = 1
    size: int | None = PAGE_SIZE


def workers(r: redis.Redis, reg: Registry | None = None) -> list[dict[str, Any]]:
    """Every registered worker with liveness (heartbeat present); unreadable entries shown as such."""
    reg = read_registry(r) if reg is None else reg
    return worker_list(reg, WorkerPage(size=None), time.time())[0]


def _row(info: WorkerInfo, alive: bool, now: float) -> dict[str, Any]:
    return dict(info.model_dump(), alive=alive, age_s=round(now - info.started, 1))


def _unreadable_row(wid: str) -> dict[str, Any]:
    info = WorkerInfo(worker=wid, tier="?", pid=0, host="?", started=0)
    return dict(info.model_dump(), alive=False, age_s=0.0)


def worker_list(reg: Registry, page: WorkerPage, now: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One page of the registry's workers as rows (only its rows are built), and where it is:
    ``tier``, ``page``, ``page_size``, ``pages``, ``total`` (workers of the selection), ``first``
    (the first row's place, from 1; 0 for an empty page) and ``shown``. An unreadable entry is a
    row of tier ``?`` (listed without a tier filter)."""
    order = sorted((info.tier, wid) for wid, (info, _alive) in reg.workers.items()
                   if page.tier is None or info.tier == page.tier)
    if page.tier is None:
        order = sorted(order + [("?", wid) for wid in reg.unreadable])
    size = page.size or max(1, len(order))
    start = (page.page - 1) * size
    rows = [_row(*reg.workers[wid], now) if wid in reg.workers else _unreadable_row(wid)
            for _tier, wid in order[start:start + size]]
    paging = {"tier": page.tier, "page": page.page, "page_size": page.size, "pages": -(-len(order) // size),
              "total": len(order), "first": start + 1 if rows else 0, "shown": len(rows)}
    return rows, paging


def tier_counts(reg: Registry) -> dict[str, tuple[int, int]]:
    """Each tier's (or pool's) registered workers: (with a heartbeat, without one)."""
    alive: Counter[str] = Counter()
    dead: Counter[str] = Counter()
    for info, beating in reg.workers.values():
        (alive if beating else dead)[info.tier] += 1
    return {tier: (alive[tier], dead[tier]) for tier in alive.keys() | dead.keys()}


def handler_failures(reg: Registry) -> dict[str, dict[str, Any]]:
    """Handlers whose entry point failed to load on a live worker: name -> the first error seen,
    ``where``: the first ``SHOWN_WHERE`` worker ids (by id), ``where_total``: how many workers."""
    out: dict[str, dict[str, Any]] = {}
    for wid in sorted(reg.workers):
        info, alive = reg.workers[wid]
        for name, error in info.handler_errors.items() if alive else ():
            got = out.setdefault(name, {"error": error, "where": [], "where_total": 0})
            got["where_total"] += 1
            if len(got["where"]) < SHOWN_WHERE:
                got["where"].append(wid)
    return out


def snapshot(r: redis.Redis, handlers: list[str] | None = None,
             page: WorkerPage | None = None) -> dict[str, Any]:
    """Everything ``fleet status`` shows, as plain data; ``bad_state``: the bad entries of shared
    state met while reading it (kind, key, member, reason), skipped. Tiers carry their workers'
    counts; ``workers`` is one page of the list (``page``; ``workers_page`` says which, and
    ``workers_total`` how many the selection has), so the output's size does not grow with the
    fleet unless every worker is asked for."""
    bad = BadState()
    tiers = with_group_pools(r, sorted(set(list_tiers(r, bad)) | {"chat"}))  # chat, chat.blue, chat.green
    reg = read_registry(r, bad)
    ws, paging = worker_list(reg, page or WorkerPage(), time.time())
    counts = tier_counts(reg)
    backlogs = read_backlog(r, tiers, live_ids(reg.workers), unserved_by_tier(reg.workers, tiers))
    out: dict[str, Any] = {"tiers": {}, "workers": ws, "workers_total": paging["total"],
                           "workers_page": paging, "workers_unreadable": len(reg.unreadable),
                           "handler_failures": handler_failures(reg), **control_plane(r, bad=bad)}
    for tier in tiers:
        read = read_pool_policy(r, tier, handlers)
        if read.error is not None and read.missing_handler is None:  # (not a handler missing here)
            bad.note("policy", keys.policy(split_pool(tier)[0]), split_pool(tier)[1], read.error)
        turns = read.policy if isinstance(read.policy, TurnsPolicy) else None
        window = read.policy.scale_rules().scaling.active_window_s
        error, by = policy_verdict(r, *split_pool(tier), read.error)
        alive, dead = counts.get(tier, (0, 0))
        out["tiers"][tier] = {
            "policy_source": read.source,
            "policy_error": error,
            "policy_rejected_by": by,
            "min_workers": read.policy.min_workers,
            "max_workers": read.policy.max_workers,
            "handler": turns.handler if turns else None,  # (an rq tier runs RQ's jobs)
            "ready_shards": turns.ready_shards if turns else 1,
            "workers_alive": alive,
            "workers_dead": dead,  # registered, no heartbeat (gone; the commander forgets them)
            **backlog_json(backlogs[tier]),
            "dead_letters": dead_letter_count(r, tier),
            "dead_letter_kinds": dead_letter_kinds(r, tier),  # of the newest KIND_SCAN
            "active_users": active_users(r, tier, time.time() - window),
            "kind": read.policy.kind,
        }
        if isinstance(read.policy, RqPolicy):
            out["tiers"][tier].update(rq_status(r, tier, read.policy))
    _add_groups(r, out["tiers"])
    out["bad_state"] = [entry.as_json() for entry in bad.entries]
    return out


def rq_status(r: redis.Redis, tier: str, policy: RqPolicy) -> dict[str, Any]:
    """An rq tier's row: its RQ workers (``rq_workers``: each one's state, job in hand and age),
    queued jobs (its backlog), started ones (pending), failed ones and the oldest queued job's
    age, from RQ's registries. ``fleet status``, ``fleet top`` and the monitor page show it."""
    try:
        from stores import rqview
    except ImportError:  # the rq extra is not installed where `fleet status` runs
        return {"rq_error": "RQ is not installed here (the rq extra)"}
    rq = rq_redis(r)
    if rq is None:
        return {"rq_error": "Fleet's Redis is a Cluster and $FLEET_RQ_URL names no RQ Redis (one node)"}
    return rqview.tier_view(rq, policy.rq_queues(tier), time.time())


_RQ: dict[str, redis.Redis] = {}  # $FLEET_RQ_URL -> its client (fleet top reads every second)


def rq_redis(r: redis.Redis) -> redis.Redis | None:
    """RQ's Redis for the readers: ``$FLEET_RQ_URL``'s node, else Fleet's own unless that is a
    Cluster (None: RQ's keys are on no node known here)."""
    url = os.environ.get("FLEET_RQ_URL")
    if url:
        if url not in _RQ:
            _RQ[url] = connect_rq(url)
        return _RQ[url]
    return None if is_cluster(r) else r


def _add_groups(r: redis.Redis, rows: dict[str, dict[str, Any]]) -> None:
    """A grouped tier's row gets its weights and canary; each group's row its weight and, if the
    commander rejected the group, why."""
    for name in [n for n in rows if not split_pool(n)[1]]:
        rollout = read_policy(r, name).policy.rollout
        if not rollout.groups:
            continue
        rows[name].update(weights=dict(rollout.weights()), canary=rollout.canary)
        rejected = rejected_groups(r, name)
        for group, weight in rollout.weights():
            rows[pool_name(name, group)].update(weight=weight, group_rejected=rejected.get(group))


def policy_verdict(r: redis.Redis, tier: str, group: str,
                   own_error: str | None) -> tuple[str | None, str | None]:
    """Why the tier's key is rejected (for ``group``'s workers, if given), and by whom: this
    reader's own check first, else what the tier's (group's) workers or commander recorded (a
    handler installed here but not where they run is only seen by them)."""
    if own_error:
        return own_error, None
    status = read_policy_status(r, tier, group)
    if status.get("ok") == "0" and status.get("error"):
        return status["error"], status.get("by") or None
    return None, None


def control_plane(r: redis.Redis, events: int = 5, bad: BadState = DEFAULT) -> dict[str, Any]:
    """The commanders (leader and standbys), the lease holder, the leader's monitor page
    (``monitor_url``: ``http://host:port/``, None when it serves none) and the last ledger events."""
    from stores.commanders import read_commanders
    from stores.ledger import event_json, read_events

    leader = lease_holder(r)  # the lease says who leads; an entry's role is what it last said
    commanders = read_commanders(r, bad=bad)
    who = (leader or "").rpartition("|")[0]
    monitor = next((c.get("monitor_url") for c in commanders
                    if c.get("commander") == who and c.get("monitor_url")), None)
    return {"leader": leader or None, "commanders": commanders, "monitor_url": monitor,
            "events": [event_json(i, e) for i, e in read_events(r, None, events)]}


def dead_letters(r: redis.Redis, tier: str, count: int) -> list[dict[str, Any]]:
    """The newest ``count`` dead-letter entries of a tier, newest first; the kept turn (binary)
    is left out, ``retriable`` says whether there is one."""
    rows = newest_dead_letters(r, tier, count)
    return [{"id": i, **{as_str(k): as_str(v, errors="replace") for k, v in f.items() if k != b"turn"},
             "retriable": b"turn" in f} for i, f in rows]
