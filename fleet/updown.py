"""``fleet up`` / ``fleet down``: the whole fleet on one machine with one command.

``up``: a Redis (``--redis-url``/``REDIS_URL``, else a local redis-server under ``.fleet/``,
else an embedded in-memory server with a warning), a default ``chat`` tier, and the
commander as a detached process; it returns once the chat tier has its ``min_workers``
registered and heartbeating. ``down``: stop the commander (it drains its workers), kill
whatever is left after the timeout, stop the Redis ``up`` started. Both are idempotent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import time
from typing import Any

import psutil
import redis

from fleet import local
from protocol.codec import CodecError
from protocol.models import CommanderInfo
from stores.commanders import commander_entries, deregister_commander
from stores.connection import connect_sync, redact_url
from stores.policies import ensure_policy, read_policy
from stores.records import read_records
from stores.registry import read_registry

DEFAULT_TIER = "chat"
UP_TIMEOUT_S = 30.0
DOWN_TIMEOUT_S = 60.0
WORKER_STOP_S = 10.0  # leftover workers after the commander: SIGTERM, then SIGKILL after this


class FleetError(RuntimeError):
    """A failure of ``up``/``down``, told in one line."""


# --- argparse ------------------------------------------------------------------------------
def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: use a number of seconds in (0, 3600]")
    return value


def add_up_down_arguments(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``up``, ``down`` and ``env`` (``--redis-url``/``--json`` do not clobber the
    global ones)."""
    up = subparsers.add_parser("up", help="start Redis, the commander and a chat tier here",
                               description=cmd_up.__doc__)
    up.add_argument("--redis-url", default=argparse.SUPPRESS,
                    help="use this Redis (default: $REDIS_URL, else a local one under .fleet/)")
    up.add_argument("--appendfsync", choices=["always", "everysec"], default="always",
                    help="the local redis-server's AOF fsync: always (default; an accepted turn "
                         "survives a crash) or everysec (~3x turns/s; a crash can lose the "
                         "last second)")
    up.add_argument("--timeout", type=_positive_seconds, default=UP_TIMEOUT_S,
                    help=f"seconds to wait for the chat workers (default {UP_TIMEOUT_S:.0f})")
    up.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                    help="print the result as JSON")
    up.set_defaults(func=cmd_up)
    down = subparsers.add_parser("down", help="stop everything `fleet up` started",
                                 description=cmd_down.__doc__)
    down.add_argument("--timeout", type=_positive_seconds, default=DOWN_TIMEOUT_S,
                      help="seconds to let the commander drain its workers before killing "
                           f"(default {DOWN_TIMEOUT_S:.0f})")
    down.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                      help="print the result as JSON")
    down.set_defaults(func=cmd_down)
    env = subparsers.add_parser("env", help="print `export REDIS_URL=...` for this fleet",
                                description=cmd_env.__doc__)
    env.set_defaults(func=cmd_env)


def cmd_up(args: argparse.Namespace) -> int:
    """Start Redis (unless one is given), the commander and the default chat tier."""
    return _run("up", _up, args)


def cmd_down(args: argparse.Namespace) -> int:
    """Stop the commander (draining its workers), leftovers, and the local Redis."""
    return _run("down", _down, args)


def cmd_env(args: argparse.Namespace) -> int:
    """Print the shell line that points this shell at the fleet: `eval "$(fleet env)"`."""
    try:
        sys.stdout.write(local.env_text(getattr(args, "redis_url", None)))
    except local.LocalRedisError as exc:
        print(f"fleet env: {exc}", file=sys.stderr)
        return 1
    return 0


def _run(name: str, fn: Any, args: argparse.Namespace) -> int:
    try:
        with local.state_lock():
            result = fn(args)
    except (FleetError, local.LocalRedisError, redis.RedisError, OSError, ValueError) as exc:
        print(f"fleet {name}: {_one_line(exc)}", file=sys.stderr)
        return 1
    _print(result, bool(getattr(args, "json", False)))
    return 0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, (FleetError, local.LocalRedisError)) else \
        f"{type(exc).__name__}: {text}"


# --- up --------------------------------------------------------------------------------------
def _up(args: argparse.Namespace) -> dict[str, Any]:
    state = local.read_state()
    if state and _alive(state.get("commander")):
        return {**_describe(state), "status": "already-up"}
    resumed = bool(state and _redis_reusable(state, args))
    if state and not resumed:
        _teardown(state, DOWN_TIMEOUT_S)  # a previous setup whose Redis is gone too
        local.clear_state()
    url, started_redis = (state["url"], False) if state and resumed else _redis_url(args)
    try:
        r = connect_sync(url, retries=2, socket_timeout=5)
        r.ping()
        min_workers = _ensure_default_tier(r)
    except (redis.RedisError, ValueError) as exc:
        if started_redis:
            local.stop_local_redis()
        if not resumed:
            local.clear_state()
        raise FleetError(f"cannot use Redis at {redact_url(url)}: {_one_line(exc)}") from exc
    # a resumed commander adopts the workers its predecessor left (run records, registry)
    pid = local.spawn_detached([sys.executable, "-m", "commander", "--stop-workers-on-exit",
                                "--metrics-port", "0", "--log-dir", str(local.logs_dir())],
                               "commander.log", local.child_env({"REDIS_URL": url}))
    state = local.update_state(url=url, commander=local.process_record(pid), started=time.time(),
                               home=str(local.fleet_home()))
    deadline = time.monotonic() + getattr(args, "timeout", UP_TIMEOUT_S)
    workers = _wait_for_workers(r, state, min_workers, deadline)
    metrics = _wait_for_metrics(r, state["commander"]["pid"], deadline)
    state = local.update_state(metrics_url=f"http://{metrics}/metrics" if metrics else None)
    return {**_describe(state), "status": "up", "resumed": resumed, "workers": workers}


def _redis_reusable(state: dict[str, Any], args: argparse.Namespace) -> bool:
    """A setup whose commander died: keep its Redis (and workers) if it still serves."""
    requested = getattr(args, "redis_url", None) or os.environ.get("REDIS_URL")
    if not isinstance(state.get("url"), str) or requested not in (None, state["url"]):
        return False
    own = state.get("redis") or {}
    return _alive(own) if own.get("pid") else own.get("kind") == "external"


def _redis_url(args: argparse.Namespace) -> tuple[str, bool]:
    """(url, whether we started a local Redis for it)."""
    url = getattr(args, "redis_url", None) or os.environ.get("REDIS_URL")
    if url:
        local.update_state(url=url, redis={"kind": "external"})
        return url, False
    url, _pid = local.start_local_redis(appendfsync=getattr(args, "appendfsync", "always"))
    return url, True


def _ensure_default_tier(r: redis.Redis) -> int:
    """Write the default chat policy if the tier has none; return its ``min_workers``."""
    ensure_policy(r, DEFAULT_TIER)
    return read_policy(r, DEFAULT_TIER).policy.min_workers


def _wait_for_workers(r: redis.Redis, state: dict[str, Any], want: int,
                      deadline: float) -> list[str]:
    log = local.logs_dir() / "commander.log"
    while True:
        ready = _ready_workers(r, DEFAULT_TIER)
        if len(ready) >= want:
            return ready
        if not _alive(state["commander"]):
            raise FleetError(f"the commander exited at start: {_last_line(log)} (log: {log})")
        if time.monotonic() > deadline:
            raise FleetError(
                f"timed out waiting for {want} {DEFAULT_TIER} worker(s) "
                f"({len(ready)} ready); left running: see {log}, `fleet down` stops it")
        time.sleep(0.1)


def _wait_for_metrics(r: redis.Redis, pid: int, deadline: float) -> str:
    """The ``host:port`` of our commander's /metrics ("" if it serves none), from its entry in
    ``fleet:commanders`` (written once per pass); "" if it has not registered by ``deadline``."""
    while time.monotonic() <= deadline:
        for info in _commanders(r):
            if info.pid == pid and info.host == socket.gethostname():
                return info.metrics
        time.sleep(0.1)
    return ""


def _commanders(r: redis.Redis) -> list[CommanderInfo]:
    return [entry for _cid, entry in commander_entries(r) if not isinstance(entry, CodecError)]


def _ready_workers(r: redis.Redis, tier: str) -> list[str]:
    """Registered workers of ``tier`` whose heartbeat is alive."""
    return [info.worker for info in read_registry(r).live(tier)]


# --- down ------------------------------------------------------------------------------------
def _down(args: argparse.Namespace) -> dict[str, Any]:
    state = local.read_state()
    if not state:
        leftovers = _stop_recorded_workers(WORKER_STOP_S)
        return {"status": "not-up", "workers_stopped": leftovers}
    result = _teardown(state, getattr(args, "timeout", DOWN_TIMEOUT_S))
    alive = _still_alive(state)
    if alive:
        raise FleetError(f"still running after fleet down: {', '.join(alive)}; run it again")
    local.clear_state()
    return {**_describe(state), **result, "status": "down"}


def _teardown(state: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Commander (drains its workers), leftover workers, local Redis; in that order.

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
        r = connect_sync(url, retries=1, socket_timeout=3)
        found = [{"kind": "commander", "id": c.commander, "pid": c.pid, "host": c.host,
                  "started": c.started, "what": f"{c.role} commander"}
                 for c in _commanders(r) if c.pid != sup.get("pid") or c.host != socket.gethostname()]
        found += [{"kind": "worker", "id": w.worker, "pid": w.pid, "host": w.host,
                   "started": w.started, "what": f"{w.tier} worker"} for w in read_registry(r).live()]
    except redis.RedisError:
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


def _forget_commander_entry(url: str, sup: dict[str, Any]) -> None:
    """A killed commander could not unregister from an external Redis: do it for it."""
    try:
        r = connect_sync(url, retries=1, socket_timeout=3)
        for cid, info in commander_entries(r):
            if isinstance(info, CodecError):
                continue
            if info.pid == sup.get("pid") and info.host == socket.gethostname():
                deregister_commander(r, cid)
    except redis.RedisError:
        pass


def _still_alive(state: dict[str, Any]) -> list[str]:
    alive = []
    for name in ("commander", "redis"):
        part = state.get(name) or {}
        if part.get("pid") and local.pid_alive(part["pid"], part.get("create_time")):
            alive.append(f"{name} pid {part['pid']}")
    alive += [f"worker {rec.get('worker')} pid {rec['pid']}" for rec in _live_records()]
    return alive


# --- output ----------------------------------------------------------------------------------
def _alive(part: dict[str, Any] | None) -> bool:
    return bool(part and part.get("pid") and local.pid_alive(part["pid"], part.get("create_time")))


def _describe(state: dict[str, Any]) -> dict[str, Any]:
    redis_part = dict(state.get("redis") or {})
    return {
        "home": str(local.fleet_home()),
        "url": redact_url(state.get("url", "")),
        "redis": {k: v for k, v in redis_part.items() if k != "create_time"},
        "commander": {"pid": (state.get("commander") or {}).get("pid"),
                       "log": str(local.logs_dir() / "commander.log")},
        "metrics_url": state.get("metrics_url"),
    }


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, sort_keys=True))
        return
    status = result["status"]
    if status == "not-up":
        stray = result["workers_stopped"]
        print("fleet is not up" + (f" (stopped {stray} stray workers)" if stray else ""))
        return
    headline = {"up": "fleet is up", "already-up": "fleet is already up", "down": "fleet is down"}
    print(headline[status] + (" (commander restarted, workers adopted)"
                              if result.get("resumed") else ""))
    print(f"  state       {result['home']}")
    print(f"  redis       {result['url']} ({_redis_text(result['redis'])})")
    print(f"  commander   pid {result['commander']['pid']} (log {result['commander']['log']})")
    if status != "down":
        print(f"  metrics     {result.get('metrics_url') or 'not served'}")
    if status == "up":
        workers = result.get("workers") or []
        names = ", ".join(workers) or "-"
        print(f"  tier {DEFAULT_TIER}   {len(workers)} worker(s) ready: {names}")
    if status != "down":
        print('  this shell  eval "$(fleet env)"   (sets REDIS_URL, for redis-cli -u and Fleet())')
    if status == "down":
        killed = " (killed: it did not stop in time)" if result.get("commander_killed") else ""
        print(f"  stopped the commander{killed}; {result['workers_running']} worker(s) drained")
        for line in result.get("others_stopped") or []:
            print(f"  also stopped {line} (started apart, on this fleet's Redis)")
        for line in result.get("left") or []:
            print(f"  left running: {line} (not started by fleet up)")


def _redis_text(part: dict[str, Any]) -> str:
    kind = part.get("kind", "external")
    if kind == "redis-server":
        fsync = part.get("appendfsync", "everysec")
        risk = ": a crash can lose the last second of turns" if fsync == "everysec" else ""
        return f"redis-server pid {part.get('pid')}, data in {part.get('dir')}, appendfsync {fsync}{risk}"
    if kind == "embedded":
        return f"embedded fakeredis pid {part.get('pid')}, NOT durable"
    return "external, not managed by fleet"


def _last_line(path: Any) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][-300:] if lines else "no output"
