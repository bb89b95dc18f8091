"""``fleet up`` / ``fleet down``: the whole fleet on one machine with one command.

``up``: a Redis (``--redis-url``/``REDIS_URL``, else a local redis-server under ``.fleet/``,
else an embedded in-memory server with a warning), a default ``chat`` tier, and the
commander as a detached process; it returns once the chat tier has its ``min_workers``
registered and heartbeating. ``down``: stop the commander (it drains its workers), kill
whatever is left after the timeout, stop the Redis ``up`` started. Both are idempotent.

``up`` also starts a relay (``fleet relay``: deferred jobs into RQ) whenever the ``rq`` extra
is installed, whatever the tiers' policies say now: a handler may start deferring, or an rq
tier appear, by a policy edit at any time after ``up``, and an idle relay costs one process
blocked on a stream read plus a sweep every few seconds. Without the extra there is no relay
(and no ``ctx.defer`` to relay): ``up`` says so.

``up`` records each process in the state file as it starts it. Ctrl-C at any moment stops what
that run started (a second Ctrl-C cannot cut the cleanup short) and says so in one line, exit
130; a Redis a run left that no state names is refused by the next ``up`` and stopped by ``down``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import sys
import time
from typing import Any

import redis

from fleet import local
from fleet.teardown import (  # WORKER_STOP_S re-exported: it was defined here
    WORKER_STOP_S,
    _commanders,
    _live_records,
    _still_alive,
    _stop_commander,
    _stop_recorded_workers,
    _teardown,
    stop_unnamed_redis,
)
from stores import functions
from stores.connection import connect_sync, ping, redact_url
from stores.policies import ensure_policy, read_policy
from stores.registry import read_registry

DEFAULT_TIER = "chat"
UP_TIMEOUT_S = 30.0
DOWN_TIMEOUT_S = 60.0


EXIT_INTERRUPTED = 130


class FleetError(RuntimeError):
    """A failure of ``up``/``down``, told in one line."""


class Interrupted(Exception):
    """Ctrl-C during ``up``: what the run started is stopped; the message says what."""


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
    up.add_argument("--rq-url", default=argparse.SUPPRESS,
                    help="RQ's Redis, one node, for the relay, the commander and the rq tiers' "
                         "workers (default: $FLEET_RQ_URL, else Fleet's own; needed when that is a "
                         "Redis Cluster)")
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
    except Interrupted as exc:
        print(f"fleet {name}: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # before up started anything (or during down: run it again)
        print(f"fleet {name}: interrupted" + ("; nothing was started" if name == "up" else
                                              f"; `fleet {name}` again finishes it"), file=sys.stderr)
        return EXIT_INTERRUPTED
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
    """Bring the fleet up; on Ctrl-C, stop what this run started (``Interrupted`` says what)."""
    before = local.read_state() or {}
    try:
        return _bring_up(args)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cleanup runs to its end
        raise Interrupted(_undo(before)) from None


def _undo(before: dict[str, Any]) -> str:
    """Stop the processes this run started (those the state names that ``before`` did not),
    with the workers its commander started; the message says what was stopped and what is left."""
    now = local.read_state() or {}
    new = [name for name in ("redis", "commander", "relay")
           if (now.get(name) or {}).get("pid") and now.get(name) != before.get(name)]
    if not new:
        return "interrupted; nothing was started"
    stopped = [f"{_part_name(now, name)} pid {now[name]['pid']}" for name in new]
    if "redis" in new or not before.get("url") or now.get("url") != before.get("url"):
        result = _teardown(now, DOWN_TIMEOUT_S)
        local.clear_state()
        left = _still_alive(now)
    else:  # a resumed setup: its Redis (and the state naming it) stays as it was
        result = {"workers_stopped": 0}
        if "commander" in new and _stop_commander(now["commander"], DOWN_TIMEOUT_S):
            result["workers_stopped"] = _stop_recorded_workers(WORKER_STOP_S)
        if "relay" in new:
            local.terminate(now["relay"]["pid"], now["relay"].get("create_time"), WORKER_STOP_S)
        local.update_state(commander=before.get("commander"), relay=before.get("relay"))
        left = [f"the Redis of the earlier setup ({redact_url(now.get('url', ''))}): `fleet down` stops it"]
    workers = result.get("workers_running") or result.get("workers_stopped") or 0
    stopped += [f"{workers} worker(s)"] if workers else []
    return (f"interrupted; stopped what this run started: {', '.join(stopped)}"
            + (f"; still running: {'; '.join(left)}" if left else ""))


def _part_name(state: dict[str, Any], name: str) -> str:
    return str((state.get("redis") or {}).get("kind", "redis")) if name == "redis" else name


def _bring_up(args: argparse.Namespace) -> dict[str, Any]:
    state = local.read_state()
    if state and _alive(state.get("commander")):
        return {**_describe(state), "status": "already-up"}
    resumed = bool(state and _redis_reusable(state, args))
    found = _left_running(state) if state and resumed else []
    if state and not resumed:
        _teardown(state, DOWN_TIMEOUT_S)  # a previous setup whose Redis is gone too
        local.clear_state()
    url, started_redis = (state["url"], False) if state and resumed else _redis_url(args)
    try:
        r = connect_sync(local.own_url(url), retries=2, socket_timeout=5)
        ping(r)
        if started_redis:  # its own server: the functions library loaded, and saved for a restart
            functions.install(r)
            r.save()
        min_workers = _ensure_default_tier(r)
    except (redis.RedisError, ValueError) as exc:
        if started_redis:
            local.stop_local_redis()
        if not resumed:
            local.clear_state()
        raise FleetError(f"cannot use Redis at {redact_url(url)}: {_one_line(exc)}") from exc
    # a resumed commander adopts the workers its predecessor left (run records, registry)
    env = local.child_env(_urls_env(url, args))
    with local.interrupt_held():
        pid = local.spawn_detached([sys.executable, "-m", "commander", "--stop-workers-on-exit",
                                    "--metrics-port", "0", "--log-dir", str(local.logs_dir())],
                                   "commander.log", env)
        state = local.update_state(url=url, commander=local.process_record(pid), started=time.time(),
                                   home=str(local.fleet_home()))
    with local.interrupt_held():
        state = local.update_state(relay=_start_relay(state, env))
    deadline = time.monotonic() + getattr(args, "timeout", UP_TIMEOUT_S)
    workers = _wait_for_workers(r, state, min_workers, deadline)
    _check_relay(state)
    metrics = _wait_for_metrics(r, state["commander"]["pid"], deadline)
    state = local.update_state(metrics_url=f"http://{metrics}/metrics" if metrics else None,
                               monitor_url=f"http://{metrics}/" if metrics else None)
    return {**_describe(state), "status": "up", "resumed": resumed, "found": found, "workers": workers}


def _left_running(state: dict[str, Any]) -> list[str]:
    """What an earlier ``fleet up`` left running (its commander gone): reused by this one."""
    found = [f"{_part_name(state, name)} pid {state[name]['pid']}" for name in ("redis", "relay")
             if _alive(state.get(name))]
    workers = len(_live_records())
    return found + ([f"{workers} worker(s)"] if workers else [])


def _urls_env(url: str, args: argparse.Namespace) -> dict[str, str]:
    """``REDIS_URL``, and ``FLEET_RQ_URL`` if ``--rq-url`` or the environment names RQ's Redis:
    the commander (its rq tiers, and their RQ workers) and the relay read both."""
    rq_url = getattr(args, "rq_url", None) or os.environ.get("FLEET_RQ_URL")
    return {"REDIS_URL": url, **({"FLEET_RQ_URL": rq_url} if rq_url else {})}


def _start_relay(state: dict[str, Any], env: dict[str, str]) -> dict[str, Any] | None:
    """A resumed setup's live relay, else a new one; None without the ``rq`` extra."""
    if _alive(state.get("relay")):
        return dict(state["relay"])
    if importlib.util.find_spec("rq") is None:
        return None
    pid = local.spawn_detached([sys.executable, "-m", "fleet.cli", "relay"], "relay.log", env)
    return local.process_record(pid)


def _check_relay(state: dict[str, Any]) -> None:
    """The relay ``up`` started is still running once the workers are (else: its last words)."""
    if state.get("relay") and not _alive(state["relay"]):
        log = local.logs_dir() / "relay.log"
        raise FleetError(f"the relay exited at start: {_last_line(log)} (log: {log}); "
                         "`fleet down` stops the rest")


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


def _ready_workers(r: redis.Redis, tier: str) -> list[str]:
    """Registered workers of ``tier`` whose heartbeat is alive."""
    return [info.worker for info in read_registry(r).live(tier)]


# --- down ------------------------------------------------------------------------------------
def _down(args: argparse.Namespace) -> dict[str, Any]:
    state = local.read_state()
    if not state:
        leftovers = _stop_recorded_workers(WORKER_STOP_S)
        return {"status": "not-up", "workers_stopped": leftovers, "servers_stopped": stop_unnamed_redis()}
    result = _teardown(state, getattr(args, "timeout", DOWN_TIMEOUT_S))
    result["others_stopped"] = [*result.get("others_stopped", []),
                                *(f"{line}, which no fleet state named" for line in stop_unnamed_redis())]
    alive = _still_alive(state)
    if alive:
        raise FleetError(f"still running after fleet down: {', '.join(alive)}; run it again")
    local.clear_state()
    return {**_describe(state), **result, "status": "down"}


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
        "relay": ({"pid": state["relay"].get("pid"), "log": str(local.logs_dir() / "relay.log")}
                  if state.get("relay") else None),
        "metrics_url": state.get("metrics_url"),
        "monitor_url": state.get("monitor_url"),  # the monitor page: the same address, path /
    }


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, sort_keys=True))
        return
    status = result["status"]
    if status == "not-up":
        stray = result["workers_stopped"]
        print("fleet is not up" + (f" (stopped {stray} stray workers)" if stray else ""))
        for line in result.get("servers_stopped") or []:
            print(f"  stopped {line}, which no fleet state named (a `fleet up` that did not finish)")
        return
    headline = {"up": "fleet is up", "already-up": "fleet is already up", "down": "fleet is down"}
    print(headline[status] + (" (commander restarted, workers adopted)"
                              if result.get("resumed") else ""))
    print(f"  state       {result['home']}")
    if result.get("found"):
        print(f"  found       {', '.join(result['found'])}, left by an earlier `fleet up`: reused")
    print(f"  redis       {result['url']} ({_redis_text(result['redis'])})")
    print(f"  commander   pid {result['commander']['pid']} (log {result['commander']['log']})")
    relay = result.get("relay")
    if status != "down":
        print(f"  relay       pid {relay['pid']} (log {relay['log']})" if relay else
              "  relay       not started: the rq extra is not installed (no deferred jobs)")
        print(f"  metrics     {result.get('metrics_url') or 'not served'}")
        print(f"  monitor     {result.get('monitor_url') or 'not served'}")
    if status == "up":
        workers = result.get("workers") or []
        names = ", ".join(workers) or "-"
        print(f"  tier {DEFAULT_TIER}   {len(workers)} worker(s) ready: {names}")
    if status != "down":
        print('  this shell  eval "$(fleet env)"   (sets REDIS_URL, for redis-cli -u and Fleet())')
    if status == "down":
        killed = " (killed: it did not stop in time)" if result.get("commander_killed") else ""
        print(f"  stopped the commander{killed}; {result['workers_running']} worker(s) drained"
              + ("; the relay" if relay else ""))
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
