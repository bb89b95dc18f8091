"""The fixed-count supervisor: keep ``min_workers`` live workers per tier, no autoscaling.

Every ``interval_s`` it reaps exited workers, then for each tier (those in ``fleet:tiers``,
``chat`` always, and any tier it still runs workers of) reads the policy and converges:
spawn the missing, retire the extras by drain. A worker that dies is replaced; a tier whose
workers keep dying is backed off (capped, jittered) instead of being respawned in a tight
loop. When Redis is down the last known policies are kept and nothing is torn down.

SIGTERM/SIGINT: drain every worker (killed after its tier's ``drain_timeout_s``), remove
the ``fleet:supervisor`` entry, exit 0. The autoscaling commander reuses the runtime, not
this loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from commander.runtime import Runtime, WorkerHandle, WorkerState
from commander.runtime.process import ProcessRuntime
from protocol import keys
from protocol.policy import Policy
from stores.connection import connect_sync, resolve_url
from stores.policies import list_tiers, read_policy

log = logging.getLogger("fleet.supervisor")

ALWAYS_TIERS = ("chat",)
STABLE_AFTER_S = 30.0  # a worker that lived this long and then died is a fresh failure
STALE_SUPERVISOR_S = 15.0  # a supervisor entry not refreshed for this long is a dead one


class AlreadyRunning(RuntimeError):
    """Another live supervisor is registered on this Redis."""


def backoff_delay(failures: int, u: float, base: float = 0.5, cap: float = 30.0) -> float:
    """Capped exponential backoff with jitter: ``u`` in [0, 1) picks from [d/2, d]."""
    if failures <= 0:
        return 0.0
    delay = min(cap, base * 2 ** min(failures - 1, 30))
    return delay * (0.5 + 0.5 * u)


def registered_handlers() -> list[str] | None:
    """Handler names a policy may use; None (no check) if the worker package is unusable."""
    try:
        from worker.handlers import registered_names

        return list(registered_names())
    except Exception as exc:  # a broken plugin must not stop supervision
        if not getattr(registered_handlers, "warned", False):
            log.warning("handler registry unavailable (%s): policies are not checked against it",
                        exc)
            registered_handlers.warned = True  # type: ignore[attr-defined]
        return None


@dataclass
class SupervisorSettings:
    """One settings object for the supervisor process."""

    url: str
    log_dir: Path
    interval_s: float = 0.5
    always_tiers: tuple[str, ...] = ALWAYS_TIERS
    register_every_s: float = 5.0


@dataclass
class _TierState:
    policy: Policy = field(default_factory=Policy)
    known: bool = False  # has a policy key / is in fleet:tiers / is always run
    error: str | None = None  # the last policy rejection logged
    failures: int = 0
    last_failure: float = 0.0  # monotonic
    not_before: float = 0.0  # monotonic: no spawn before this (crash-loop backoff)


class Supervisor:
    """Keeps each tier at its policy's ``min_workers`` through a runtime."""

    def __init__(self, r: redis.Redis, runtime: Runtime, settings: SupervisorSettings,
                 handlers: Callable[[], Iterable[str] | None] = registered_handlers,
                 rng: Callable[[], float] = random.random) -> None:
        self.r, self.runtime, self.settings = r, runtime, settings
        self.handlers, self.rng = handlers, rng
        self.tiers: dict[str, _TierState] = {}
        self.started = time.time()
        self.host = socket.gethostname()
        self._registered_at = 0.0
        self._redis_down_since: float | None = None

    # --- one pass --------------------------------------------------------------------
    def tick(self) -> None:
        """Reap, then converge every tier. Never raises: errors are logged and backed off."""
        try:
            for handle in self.runtime.reap():
                self._on_exit(handle)
        except Exception:
            log.exception("reaping workers failed")
        redis_ok = self._refresh_tiers()
        for tier in sorted(self._tiers_to_run()):
            state = self.tiers.setdefault(tier, _TierState())
            try:
                if redis_ok:
                    self._refresh_policy(tier, state)
                self.converge(tier, state)
                self._note_health(tier, state)
            except Exception as exc:
                self._fail(tier, state, f"{type(exc).__name__}: {exc}")
        if redis_ok:
            self._register_if_due()

    def converge(self, tier: str, state: _TierState) -> None:
        """Spawn or retire so that ``tier`` has exactly its desired number of live workers."""
        desired = state.policy.min_workers if state.known else 0
        live = self.runtime.live(tier)
        if len(live) < desired:
            if time.monotonic() < state.not_before:
                return
            ids = self.runtime.spawn(tier, desired - len(live))
            log.info("tier %s: %d live, want %d: spawned %s", tier, len(live), desired,
                     ", ".join(ids))
        elif len(live) > desired:
            # starting workers first: they hold no work yet
            extras = sorted(live, key=lambda h: (h.state is WorkerState.RUNNING, h.worker_id))
            for handle in extras[: len(live) - desired]:
                reason = f"tier {tier} has {len(live)} live workers, min_workers is {desired}"
                self.runtime.retire(handle.worker_id, reason, state.policy.drain_timeout_s)
            log.info("tier %s: %d live, want %d: draining %s", tier, len(live), desired,
                     ", ".join(h.worker_id for h in extras[: len(live) - desired]))

    # --- inputs ----------------------------------------------------------------------
    def _tiers_to_run(self) -> set[str]:
        running = {h.tier for h in self.runtime.list() if h.state is not WorkerState.EXITED}
        known = {t for t, s in self.tiers.items() if s.known}
        return known | running | set(self.settings.always_tiers)

    def _refresh_tiers(self) -> bool:
        """Re-read ``fleet:tiers``; False (and the last known tiers kept) if Redis is down."""
        try:
            listed = set(list_tiers(self.r))
        except redis.RedisError as exc:
            self._redis_down(exc)
            return False
        if self._redis_down_since is not None:
            log.info("Redis is reachable again after %.0fs",
                     time.monotonic() - self._redis_down_since)
            self._redis_down_since = None
        for tier in listed | set(self.settings.always_tiers) | set(self.tiers):
            self.tiers.setdefault(tier, _TierState()).known = (
                tier in listed or tier in self.settings.always_tiers)
        return True

    def _refresh_policy(self, tier: str, state: _TierState) -> None:
        read = read_policy(self.r, tier, self.handlers())
        if read.error != state.error:
            if read.error:
                log.warning("tier %s: policy rejected (%s); running on the %s policy", tier,
                            read.error, read.source)
            else:
                log.info("tier %s: policy accepted", tier)
            state.error = read.error
        if read.policy.min_workers != state.policy.min_workers:
            log.info("tier %s: min_workers %d -> %d", tier, state.policy.min_workers,
                     read.policy.min_workers)
        state.policy = read.policy

    def _redis_down(self, exc: Exception) -> None:
        now = time.monotonic()
        if self._redis_down_since is None:
            self._redis_down_since = now
            log.warning("Redis unreachable (%s): keeping the workers and the last known policies",
                        exc)

    # --- failures --------------------------------------------------------------------
    def _note_health(self, tier: str, state: _TierState) -> None:
        """Forget past failures once the tier has run at full strength for a while."""
        if not state.failures or time.monotonic() - state.last_failure < STABLE_AFTER_S:
            return
        live = self.runtime.live(tier)
        if all(h.state is WorkerState.RUNNING for h in live):
            state.failures = 0

    def _backoff(self, state: _TierState) -> float:
        state.failures += 1
        state.last_failure = time.monotonic()
        delay = backoff_delay(state.failures, self.rng())
        state.not_before = state.last_failure + delay
        return delay

    def _on_exit(self, handle: WorkerHandle) -> None:
        if handle.retire_reason is not None:
            return  # we asked for it
        state = self.tiers.setdefault(handle.tier, _TierState())
        lived = time.time() - handle.started
        if lived >= STABLE_AFTER_S:
            state.failures = 0  # it served for a while: a fresh failure, not a crash loop
        delay = self._backoff(state)
        log.warning("worker %s (tier %s) died after %.1fs (exit code %s): replacing it in %.1fs",
                    handle.worker_id, handle.tier, lived, handle.exit_code, delay)

    def _fail(self, tier: str, state: _TierState, error: str) -> None:
        delay = self._backoff(state)
        log.error("tier %s: %s (attempt %d, next in %.1fs)", tier, error, state.failures, delay)

    # --- registration ----------------------------------------------------------------
    def register(self) -> None:
        """Record this supervisor in ``fleet:supervisor``; refuse if another one is alive."""
        current = {k.decode(): v.decode() for k, v in self.r.hgetall(keys.SUPERVISOR).items()}
        if current and not self._is_ours(current) and self._looks_alive(current):
            raise AlreadyRunning(f"another supervisor is running: pid {current.get('pid')} on "
                                 f"{current.get('host')} ({current.get('url', '?')})")
        self._write_entry()

    def _write_entry(self) -> None:
        from fleet.local import redact_url

        self.r.hset(keys.SUPERVISOR, mapping={
            "pid": str(os.getpid()), "host": self.host, "started": f"{self.started:.3f}",
            "ts": f"{time.time():.3f}", "url": redact_url(self.settings.url),
            "runtime": getattr(self.runtime, "name", "?"), "log_dir": str(self.settings.log_dir)})
        self._registered_at = time.monotonic()

    def _register_if_due(self) -> None:
        if time.monotonic() - self._registered_at >= self.settings.register_every_s:
            self._write_entry()  # also recreates it after a Redis restart

    def _is_ours(self, entry: dict[str, str]) -> bool:
        return entry.get("pid") == str(os.getpid()) and entry.get("host") == self.host

    def _looks_alive(self, entry: dict[str, str]) -> bool:
        try:
            if entry.get("host") == self.host:  # the pid, and not a reuse of it
                proc = psutil.Process(int(entry["pid"]))
                return proc.status() != psutil.STATUS_ZOMBIE and \
                    proc.create_time() <= float(entry["started"]) + 1.0
            return time.time() - float(entry["ts"]) < STALE_SUPERVISOR_S
        except (psutil.Error, KeyError, ValueError):
            return False

    def unregister(self) -> None:
        """Remove the ``fleet:supervisor`` entry if it is still ours."""
        with self.r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(keys.SUPERVISOR)
                entry = {k.decode(): v.decode() for k, v in pipe.hgetall(keys.SUPERVISOR).items()}
                pipe.multi()
                if self._is_ours(entry):
                    pipe.delete(keys.SUPERVISOR)
                pipe.execute()
            except redis.WatchError:
                pass  # someone else wrote it: it is not ours any more

    # --- lifecycle -------------------------------------------------------------------
    def run(self, stop: threading.Event) -> int:
        """Adopt, loop until ``stop`` is set, then drain everything. Returns the exit code."""
        for handle in self.runtime.adopt():
            log.info("adopted %s (tier %s, pid %d)", handle.worker_id, handle.tier, handle.pid)
        while not stop.is_set():
            began = time.monotonic()
            self.tick()
            stop.wait(max(0.0, self.settings.interval_s - (time.monotonic() - began)))
        self.shutdown()
        return 0

    def shutdown(self) -> None:
        """Drain every worker (killing the slow ones), then unregister."""
        handles = [h for h in self.runtime.list() if h.state is not WorkerState.EXITED]
        log.info("stopping: draining %d workers", len(handles))
        stopped = self.runtime.stop_all()
        killed = [h.worker_id for h in stopped if h.killed]
        if killed:
            log.warning("killed after their drain timeout: %s", ", ".join(killed))
        try:
            self.unregister()
        except redis.RedisError as exc:
            log.warning("could not remove the supervisor entry: %s", exc)
        log.info("stopped")


def run_supervisor(url: str | None = None, log_dir: Path | str | None = None, *,
                   runtime: Runtime | None = None, stop: threading.Event | None = None,
                   interval_s: float = 0.5) -> int:
    """Run the supervisor until SIGTERM/SIGINT (or ``stop``); returns the exit code."""
    from fleet.local import logs_dir, redact_url

    url = resolve_url(url)
    settings = SupervisorSettings(url=url, log_dir=Path(log_dir or logs_dir()).resolve(),
                                  interval_s=interval_s)
    r = connect_sync(url, retries=2, socket_timeout=5)
    runtime = runtime or ProcessRuntime(url, settings.log_dir, client=r)
    sup = Supervisor(r, runtime, settings)
    stop = stop or threading.Event()
    _install_signal_handlers(stop)
    try:
        _register_when_reachable(sup, stop)
    except AlreadyRunning as exc:
        log.error("%s", exc)
        return 1
    log.info("supervisor pid %d on %s, Redis %s, logs in %s", os.getpid(), sup.host,
             redact_url(url), settings.log_dir)
    return sup.run(stop)


def _register_when_reachable(sup: Supervisor, stop: threading.Event) -> None:
    failures = 0
    while not stop.is_set():
        try:
            sup.register()
            return
        except redis.RedisError as exc:
            failures += 1
            delay = backoff_delay(failures, random.random(), cap=5.0)
            log.warning("Redis not reachable yet (%s): retrying in %.1fs", exc, delay)
            stop.wait(delay)


def _install_signal_handlers(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # embedded (tests): the caller sets ``stop``

    def on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():
            log.info("%s: already stopping", signal.Signals(signum).name)
        else:
            log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def main(argv: list[str] | None = None) -> int:
    """``python -m commander.supervisor``."""
    p = argparse.ArgumentParser(prog="python -m commander.supervisor",
                                description="Keep each tier at its policy's min_workers.")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else the local fleet")
    p.add_argument("--log-dir", default=None, help="worker logs (default: $FLEET_HOME/logs)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between passes")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    if not 0.05 <= args.interval <= 60:
        p.error("--interval must be between 0.05 and 60 seconds")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return run_supervisor(args.redis_url, args.log_dir, interval_s=args.interval)


if __name__ == "__main__":
    sys.exit(main())
