"""``fleet down``'s teardown: stop the commander (it drains its workers), the workers left in
the run records, and the commanders and workers started apart on this host; and the checks of
what is still alive afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from typing import Any

import psutil
import redis
from redis.exceptions import RedisClusterException

from commander.runtime.process.run_records import read_records
from fleet import local
from protocol.codec import CodecError
from protocol.models import CommanderInfo
from stores.commanders import commander_entries, deregister_commander
from stores.connection import connect_sync
from stores.registry import read_registry

WORKER_STOP_S = 10.0  # leftover workers after the commander: SIGTERM, then SIGKILL after this


def _commanders(r: redis.Redis) -> list[CommanderInfo]:
    return [entry for _cid, entry in commander_entries(r) if not isinstance(entry, CodecError)]


def _teardown(state: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Commander (drains its workers), leftover workers, the relay, local Redis; in that order.

    On the Redis ``up`` started, the commanders and workers started apart (a standby, a
    ``fleet worker``) on this host are stopped too: the standbys first, so that none takes
    over and starts a worker, and their workers last. On an external Redis they are left
    alone (a standby there is meant to take over) and listed in ``left``.
    """
    result: dict[str, Any] = {"workers_running": len(_live_records()), "others_stopped": [],
                              "left": []}
    sup = state.get("commander") or {}
    own_redis = bool((state.get("redis") or {}).get("pid"))
    if own_redis:
        result["others_stopped"] += _stop_others(state["url"], sup, "commander")
    result["commander_killed"] = _stop_commander(sup, timeout)
    result["workers_stopped"] = _stop_recorded_workers(WORKER_STOP_S)
    relay = state.get("relay") or {}  # after the workers: it relays what their last turns deferred
    if relay.get("pid"):
        result["relay_killed"] = not local.terminate(relay["pid"], relay.get("create_time"), WORKER_STOP_S)
    if own_redis:
        result["others_stopped"] += _stop_others(state["url"], sup, "worker")
        local.stop_local_redis()
    elif state.get("url"):
        _forget_commander_entry(state["url"], sup)
        result["left"] = [_line(p) for p in _others(state["url"], sup, local_only=False)]
    return result


def _others(url: str, sup: dict[str, Any], kind: str | None = None,
            local_only: bool = True) -> list[dict[str, Any]]:
    """Commanders other than ours and live workers registered in Redis (of ``kind``, if
    given), as ``{"kind", "id", "pid", "host", "what"}``; on this host only if ``local_only``,
    checked to be the very process that registered."""
    try:
        r = connect_sync(local.own_url(url), retries=1, socket_timeout=3)
        found = [{"kind": "commander", "id": c.commander, "pid": c.pid, "host": c.host,
                  "started": c.started, "what": f"{c.role} commander"}
                 for c in _commanders(r) if c.pid != sup.get("pid") or c.host != socket.gethostname()]
        found += [{"kind": "worker", "id": w.worker, "pid": w.pid, "host": w.host,
                   "started": w.started, "what": f"{w.tier} worker"} for w in read_registry(r).live()]
    except (redis.RedisError, RedisClusterException):
        return []
    found = [p for p in found if kind in (None, p["kind"])]
    if local_only:
        found = [p for p in found if _local_create_time(p) is not None]
    return found


def _local_create_time(proc: dict[str, Any]) -> float | None:
    """The creation time of ``proc``'s pid if it is that process, on this host, else None."""
    if proc["host"] != socket.gethostname():
        return None
    try:
        created = psutil.Process(proc["pid"]).create_time()
    except psutil.Error:
        return None
    # it registered after it was created (imports and a fork take a while, not minutes)
    return created if proc["started"] - 120 <= created <= proc["started"] + 1 else None


def _stop_others(url: str, sup: dict[str, Any], kind: str) -> list[str]:
    """Stop (SIGTERM, then SIGKILL) the processes of ``kind`` started apart on this host."""
    procs = _others(url, sup, kind)
    for proc in procs:
        local.terminate(proc["pid"], _local_create_time(proc), WORKER_STOP_S)
    return [_line(p) for p in procs]


def _line(proc: dict[str, Any]) -> str:
    return f"{proc['what']} {proc['id']} pid {proc['pid']} on {proc['host']}"


def _stop_commander(sup: dict[str, Any], timeout: float) -> bool:
    """SIGTERM the commander and wait while it drains; SIGKILL it after ``timeout``.

    Returns whether it had to be killed (its workers are then stopped from the run records).
    """
    pid, create_time = sup.get("pid"), sup.get("create_time")
    if not pid or not local.pid_alive(pid, create_time):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    if local.wait_gone(pid, create_time, timeout):
        return False
    local.terminate(pid, create_time, 0)
    return True


def _live_records() -> list[dict[str, Any]]:
    records = []
    for rec in read_records(local.run_dir(), quiet=True):
        if local.pid_alive(rec["pid"], rec.get("create_time")):
            records.append(rec)
        else:
            rec["path"].unlink(missing_ok=True)
    return records


def _stop_recorded_workers(timeout: float) -> int:
    """SIGTERM (drain) every recorded live worker, SIGKILL after ``timeout``; how many."""
    records = _live_records()
    for rec in records:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(rec["pid"], signal.SIGTERM)
    for rec in records:
        if not local.wait_gone(rec["pid"], rec.get("create_time"), timeout):
            local.terminate(rec["pid"], rec.get("create_time"), 0)
        if not local.pid_alive(rec["pid"], rec.get("create_time")):
            rec["path"].unlink(missing_ok=True)
    return len(records)


def stop_unnamed_redis(timeout: float = 10.0) -> list[str]:
    """Stop the servers that hold the local Redis's data folder though no state names them (a
    ``fleet up`` that did not finish): SIGTERM (it writes its append-only file), then SIGKILL."""
    stopped = []
    for proc in local.data_dir_holders():
        try:
            name, created = proc.name(), proc.create_time()
        except psutil.Error:
            continue
        local.terminate(proc.pid, created, timeout)
        stopped.append(f"{name} pid {proc.pid}")
    return stopped


def _forget_commander_entry(url: str, sup: dict[str, Any]) -> None:
    """A killed commander could not unregister from an external Redis: do it for it."""
    try:
        r = connect_sync(local.own_url(url), retries=1, socket_timeout=3)
        for cid, info in commander_entries(r):
            if isinstance(info, CodecError):
                continue
            if info.pid == sup.get("pid") and info.host == socket.gethostname():
                deregister_commander(r, cid)
    except (redis.RedisError, RedisClusterException):
        pass


def _still_alive(state: dict[str, Any]) -> list[str]:
    alive = []
    for name in ("commander", "relay", "redis"):
        part = state.get(name) or {}
        if part.get("pid") and local.pid_alive(part["pid"], part.get("create_time")):
            alive.append(f"{name} pid {part['pid']}")
    alive += [f"worker {rec.get('worker')} pid {rec['pid']}" for rec in _live_records()]
    return alive
