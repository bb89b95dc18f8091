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

import redis

from fleet import local
from protocol import keys
from protocol.codec import CodecError, decode
from protocol.models import CommanderInfo
from protocol.policy import Policy
from stores.connection import connect_sync
from stores.policies import read_policy, write_policy
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


def add_up_down_arguments(subparsers: argparse._SubParsersAction) -> None:
    """Register ``up`` and ``down`` (``--redis-url``/``--json`` do not clobber global ones)."""
    up = subparsers.add_parser("up", help="start Redis, the commander and a chat tier here",
                               description=cmd_up.__doc__)
    up.add_argument("--redis-url", default=argparse.SUPPRESS,
                    help="use this Redis (default: $REDIS_URL, else a local one under .fleet/)")
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


def cmd_up(args: argparse.Namespace) -> int:
    """Start Redis (unless one is given), the commander and the default chat tier."""
    return _run("up", _up, args)


def cmd_down(args: argparse.Namespace) -> int:
    """Stop the commander (draining its workers), leftovers, and the local Redis."""
    return _run("down", _down, args)


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
    resumed = bool(state) and _redis_reusable(state, args)
    if state and not resumed:
        _teardown(state, DOWN_TIMEOUT_S)  # a previous setup whose Redis is gone too
        local.clear_state()
    url, started_redis = (state["url"], False) if resumed else _redis_url(args)
    try:
        r = connect_sync(url, retries=2, socket_timeout=5)
        r.ping()
        min_workers = _ensure_default_tier(r)
    except (redis.RedisError, ValueError) as exc:
        if started_redis:
            local.stop_local_redis()
        if not resumed:
            local.clear_state()
        raise FleetError(f"cannot use Redis at {local.redact_url(url)}: {_one_line(exc)}") from exc
    # a resumed commander adopts the workers its predecessor left (run records, registry)
    pid = local.spawn_detached([sys.executable, "-m", "commander", "--stop-workers-on-exit",
                                "--metrics-port", "0", "--log-dir", str(local.logs_dir())],
                               "commander.log", local.child_env({"REDIS_URL": url}))
    state = local.update_state(url=url, commander=local.process_record(pid), started=time.time(),
                               home=str(local.fleet_home()))
    workers = _wait_for_workers(r, state, min_workers, getattr(args, "timeout", UP_TIMEOUT_S))
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
    url, _pid = local.start_local_redis()
    return url, True


def _ensure_default_tier(r: redis.Redis) -> int:
    """Write the default chat policy if the tier has none; return its ``min_workers``."""
    if r.get(keys.policy(DEFAULT_TIER)) is None:
        write_policy(r, DEFAULT_TIER, Policy())
    else:
        r.sadd(keys.TIERS, DEFAULT_TIER)
    return read_policy(r, DEFAULT_TIER).policy.min_workers


def _wait_for_workers(r: redis.Redis, state: dict[str, Any], want: int,
                      timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    log = local.logs_dir() / "commander.log"
    while True:
        ready = _ready_workers(r, DEFAULT_TIER)
        if len(ready) >= want:
            return ready
        if not _alive(state["commander"]):
            raise FleetError(f"the commander exited at start: {_last_line(log)} (log: {log})")
        if time.monotonic() > deadline:
            raise FleetError(
                f"timed out after {timeout:.0f}s waiting for {want} {DEFAULT_TIER} worker(s) "
                f"({len(ready)} ready); left running: see {log}, `fleet down` stops it")
        time.sleep(0.1)


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
    """Commander (drains its workers), leftover workers, local Redis; in that order."""
    result: dict[str, Any] = {"workers_running": len(_live_records())}
    sup = state.get("commander") or {}
    result["commander_killed"] = _stop_commander(sup, timeout)
    result["workers_stopped"] = _stop_recorded_workers(WORKER_STOP_S)
    if (state.get("redis") or {}).get("pid"):
        local.stop_local_redis()
    elif state.get("url"):
        _forget_commander_entry(state["url"], sup)
    return result


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
    for path in sorted(local.run_dir().glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            pid, create_time = int(rec["pid"]), rec.get("create_time")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if local.pid_alive(pid, create_time):
            records.append({**rec, "pid": pid, "path": path})
        else:
            path.unlink(missing_ok=True)
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
        for cid, blob in r.hgetall(keys.COMMANDERS).items():
            try:
                info = decode(CommanderInfo, blob)
            except CodecError:
                continue
            if info.pid == sup.get("pid") and info.host == socket.gethostname():
                r.hdel(keys.COMMANDERS, cid)
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
        "url": local.redact_url(state.get("url", "")),
        "redis": {k: v for k, v in redis_part.items() if k != "create_time"},
        "commander": {"pid": (state.get("commander") or {}).get("pid"),
                       "log": str(local.logs_dir() / "commander.log")},
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
    print(f"  redis       {result['url']} ({_redis_text(result['redis'])})")
    print(f"  commander   pid {result['commander']['pid']} (log {result['commander']['log']})")
    if status == "up":
        workers = result.get("workers") or []
        names = ", ".join(workers) or "-"
        print(f"  tier {DEFAULT_TIER}   {len(workers)} worker(s) ready: {names}")
    if status == "down":
        killed = " (killed: it did not stop in time)" if result.get("commander_killed") else ""
        print(f"  stopped the commander{killed}; {result['workers_running']} worker(s) drained")


def _redis_text(part: dict[str, Any]) -> str:
    kind = part.get("kind", "external")
    if kind == "redis-server":
        return f"redis-server pid {part.get('pid')}, data in {part.get('dir')}"
    if kind == "embedded":
        return f"embedded fakeredis pid {part.get('pid')}, NOT durable"
    return "external, not managed by fleet"


def _last_line(path: Any) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][-300:] if lines else "no output"
