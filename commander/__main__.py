"""``python -m commander`` (also ``fleet commander``): run the autoscaling commander."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis

from commander.commander import Commander, tune_gc
from commander.metrics import Metrics
from commander.monitor.access import access_of, refusal
from commander.runtime import ProcessRuntime, Runtime
from commander.settings import CommanderSettings
from protocol.flags import Parser, add_flags, settings_from_flags
from stores import functions
from stores.connection import ClusterModeError, connect_rq, connect_sync, resolve_url
from stores.retry import TRANSIENT, Backoff
from stores.roles import process_url

log = logging.getLogger("fleet.commander")
_BACKOFF = Backoff(base=0.1, cap=5.0)  # waiting for a Redis away at start, as the loop waits
T = TypeVar("T")


def add_arguments(p: argparse.ArgumentParser, *, redis_url: bool = False) -> None:
    """The commander's options: one flag per field of ``CommanderSettings`` (shared with ``fleet
    commander``, whose ``--redis-url`` is the fleet's own)."""
    add_flags(p, CommanderSettings, skip=() if redis_url else ("redis_url",))


def settings_from(args: argparse.Namespace) -> CommanderSettings | None:
    """Flags override the environment (FLEET_COMMANDER_*), which overrides the defaults. None,
    with one line on stderr, if they are not valid."""
    return settings_from_flags(CommanderSettings, args, "fleet commander")


def _runtime(settings: CommanderSettings, url: str, worker_url: str) -> Runtime | None:
    """The runtime the settings name (its workers connect with ``worker_url``); None (logged)
    if it cannot be set up."""
    if settings.runtime == "kubernetes":
        return _kubernetes(settings, url)
    return ProcessRuntime(worker_url, Path(settings.log_dir), spawn_mode=settings.spawn_mode,
                          rq_url=settings.rq_url, client=connect_sync(url, retries=2, socket_timeout=5),
                          group_runtimes=settings.group_runtimes, check_timeout_s=settings.check_timeout_s())


def _kubernetes(settings: CommanderSettings, url: str) -> Runtime | None:
    try:
        from commander.runtime import KubeApi, KubernetesRuntime, api_client, default_namespace
    except ImportError as exc:
        log.error("the kubernetes runtime needs the official client: pip install 'fleet[k8s]' (%s)", exc)
        return None
    try:
        client = api_client(settings.k8s_kubeconfig)
        namespace = settings.k8s_namespace or default_namespace(settings.k8s_kubeconfig)
    except Exception as exc:  # noqa: BLE001 - the client's ConfigException, a bad or missing file
        where = settings.k8s_kubeconfig or "the in-cluster config (is this a pod with a ServiceAccount?)"
        log.error("cannot configure the Kubernetes client from %s: %s", where, exc)
        return None
    log.info("kubernetes runtime: worker Deployments of namespace %s", namespace)
    return KubernetesRuntime(KubeApi(client, namespace), connect_sync(url, retries=2, socket_timeout=5),
                             poll_s=settings.k8s_poll_s, group_runtimes=settings.group_runtimes)


def _serve(metrics: Metrics, port: int, commander: Commander, settings: CommanderSettings, url: str,
           rq: redis.Redis | None) -> None:
    """Serve /metrics, /healthz and the monitor (page and API) on the metrics address.

    The monitor reads Redis on a client of its own, with short timeouts, so a viewer never
    takes a connection the commander's loop is waiting for."""
    from commander.monitor.api import Monitor

    client = connect_sync(url, retries=1, socket_timeout=5)
    monitor = Monitor(board=commander.board, leading=lambda: commander.leading,
                      commander_id=settings.commander_id, r=client, rq=rq)
    host, port = metrics.serve(settings.metrics_host, port, access_of(settings), monitor=monitor)
    log.info("serving /metrics on http://%s:%d/metrics and the monitor on http://%s:%d/",
             host, port, host, port)


def _until_redis_answers(step: Callable[[], T], stop: threading.Event) -> T | None:
    """``step``'s result, retried with the loop's backoff while Redis is away at start (a
    SIGTERM interrupts the wait); None on a stop first."""
    failures = 0
    while not stop.is_set():
        try:
            return step()
        except TRANSIENT as exc:
            failures += 1
            delay = _BACKOFF.compute(failures)
            log.warning("Redis unavailable at start (%s); retrying in %.1fs", exc, delay)
            stop.wait(delay)
    return None


def _connect(url: str, stop: threading.Event) -> redis.Redis | None:
    """The commander's client; None on a usage error (logged) or a stop before it connected.

    A cluster client connects at once (it must learn the slots): a cluster that is away at
    start is waited for here, with the loop's backoff, as an outage is waited for in the loop.
    """
    try:
        # few client retries: an outage reaches the loop, whose own backoff a SIGTERM interrupts
        return _until_redis_answers(lambda: connect_sync(url, retries=3, socket_timeout=10), stop)
    except ClusterModeError as exc:
        log.error("%s", exc)
        return None


def _library_ready(r: redis.Redis, stop: threading.Event) -> bool:
    """Wait for this version's functions library (``functions.wait_for_library``), and for a
    Redis away at start as :func:`_connect` does; False on a stop first."""
    return bool(_until_redis_answers(lambda: functions.wait_for_library(r, stop), stop))


def run(args: argparse.Namespace) -> int:
    """Run a commander until SIGTERM/SIGINT."""
    settings = settings_from(args)
    if settings is None:
        return 2
    why = None if settings.metrics_port is None else refusal(settings.metrics_host, access_of(settings))
    if why is not None:
        print(f"fleet commander: {why}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {settings.commander_id} %(message)s")
    tune_gc()
    # the commander's own role (stores.roles); its workers get the worker URL
    url = process_url(settings.redis_url, "fleet-commander")
    worker_url = settings.worker_redis_url or resolve_url(settings.redis_url)
    stop = threading.Event()
    def _stop(*_: object) -> None:
        stop.set()
        functions.interrupt_waits()  # a call waiting for the functions library gives up

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    # first: a bad FLEET_REDIS_CLUSTER, or a cluster away at start, is met here, not in the
    # runtime's own client (a single node's client connects lazily: this returns at once)
    r = _connect(url, stop)
    if r is None:
        return 0 if stop.is_set() else 2
    if not _library_ready(r, stop):
        return 0
    runtime = _runtime(settings, url, worker_url)
    if runtime is None:
        return 2
    metrics = None if settings.metrics_port is None else Metrics()
    rq = connect_rq(settings.rq_url) if settings.rq_url else None  # (lazy: no round trip here)
    try:
        commander = Commander(r, runtime, settings, metrics, rq=rq)
        if metrics is not None and settings.metrics_port is not None:
            _serve(metrics, settings.metrics_port, commander, settings, url, rq)
        return commander.run(stop)
    finally:
        runtime.close()
        if metrics is not None:
            metrics.stop()


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="fleet commander", description="Run the Fleet commander (autoscaler).")
    add_arguments(p, redis_url=True)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
