"""Reading the fleet's state for people and machines: tiers, workers, backlog, dead letters."""

from __future__ import annotations

import time
from typing import Any

import redis

from protocol import keys
from protocol.codec import CodecError, decode
from protocol.models import CommanderInfo, WorkerInfo
from stores.policies import list_tiers, read_policy
from stores.registry import read_registry


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def tier_backlog(r: redis.Redis, tier: str) -> dict[str, int]:
    """Notifications not yet delivered (lag) and delivered but not acked (pending)."""
    try:
        groups = r.xinfo_groups(keys.ready(tier))
    except redis.ResponseError:  # no stream yet
        return {"lag": 0, "pending": 0, "backlog": 0}
    group = next((g for g in groups if _s(g["name"]) == keys.GROUP), None)
    if group is None:
        length = int(r.xlen(keys.ready(tier)))
        return {"lag": length, "pending": 0, "backlog": length}
    lag = group.get("lag")
    lag = int(lag) if lag is not None else int(r.xlen(keys.ready(tier)))
    pending = int(group["pending"])
    return {"lag": lag, "pending": pending, "backlog": lag + pending}


def workers(r: redis.Redis) -> list[dict[str, Any]]:
    """Registered workers with liveness (heartbeat present); unreadable entries shown as such."""
    reg = read_registry(r)
    now = time.time()
    rows = [dict(info.model_dump(), alive=alive, age_s=round(now - info.started, 1))
            for info, alive in reg.workers.values()]
    rows += [dict(WorkerInfo(worker=wid, tier="?", pid=0, host="?", started=0).model_dump(),
                  alive=False, age_s=0.0) for wid in reg.unreadable]
    return rows


def snapshot(r: redis.Redis, handlers: list[str] | None = None) -> dict[str, Any]:
    """Everything ``fleet status`` shows, as plain data."""
    tiers = sorted(set(list_tiers(r)) | {"chat"})
    ws = workers(r)
    out: dict[str, Any] = {"tiers": {}, "workers": ws, **control_plane(r)}
    for tier in tiers:
        read = read_policy(r, tier, handlers)
        out["tiers"][tier] = {
            "policy_source": read.source,
            "policy_error": read.error,
            "min_workers": read.policy.min_workers,
            "max_workers": read.policy.max_workers,
            "handler": read.policy.handler,
            "workers_alive": sum(1 for w in ws if w["tier"] == tier and w["alive"]),
            **tier_backlog(r, tier),
            "dead_letters": int(r.xlen(keys.dead(tier))),
            "active_users": int(r.zcount(keys.active(tier), time.time() - read.policy.active_window_s,
                                         "+inf")),
        }
    return out


def control_plane(r: redis.Redis, events: int = 5) -> dict[str, Any]:
    """The commanders (leader and standbys), the lease holder and the last ledger events."""
    from fleet.events import event_json, read_events

    commanders = []
    for cid, blob in r.hgetall(keys.COMMANDERS).items():
        try:
            commanders.append(decode(CommanderInfo, blob).model_dump())
        except CodecError:
            commanders.append({"commander": _s(cid), "role": "unreadable entry"})
    leader = r.get(keys.LEADER)
    return {"leader": _s(leader) if leader else None, "commanders": commanders,
            "events": [event_json(i, e) for i, e in read_events(r, None, events)]}


def dead_letters(r: redis.Redis, tier: str, count: int) -> list[dict[str, str]]:
    """The newest ``count`` dead-letter entries of a tier, newest first."""
    rows = r.xrevrange(keys.dead(tier), count=count)
    return [{"id": _s(i), **{_s(k): _s(v) for k, v in f.items()}} for i, f in rows]
