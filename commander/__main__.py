"""``python -m commander`` (also ``fleet commander``): run the autoscaling commander."""

from __future__ import annotations

import argparse
import inspect
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from commander.commander import Commander
from commander.runtime.process import ProcessRuntime
from commander.settings import CommanderSettings
from protocol.flags import Parser, add_flags, settings_from_flags
from stores.connection import connect_sync, resolve_url

log = logging.getLogger("fleet.commander")


def add_arguments(p: argparse.ArgumentParser, *, redis_url: bool = False) -> None:
    """The commander's options: one flag per field of ``CommanderSettings`` (shared with ``fleet
    commander``, whose ``--redis-url`` is the fleet's own)."""
    add_flags(p, CommanderSettings, skip=() if redis_url else ("redis_url",))


def settings_from(args: argparse.Namespace) -> CommanderSettings | None:
    """Flags override the environment (FLEET_COMMANDER_*), which overrides the defaults. None,
    with one line on stderr, if they are not valid."""
    return settings_from_flags(CommanderSettings, args, "fleet commander")


def _runtime(settings: CommanderSettings, url: str) -> ProcessRuntime:
    kwargs: dict[str, Any] = {}
    if "spawn_mode" in inspect.signature(ProcessRuntime).parameters:
        kwargs["spawn_mode"] = settings.spawn_mode
    return ProcessRuntime(url, Path(settings.log_dir), **kwargs)


def _metrics(settings: CommanderSettings) -> Any | None:
    if settings.metrics_port is None:
        return None
    try:
        from commander.metrics import Metrics
    except ImportError:
        log.warning("commander.metrics is unavailable: no /metrics")
        return None
    metrics = Metrics()
    host, port = metrics.serve(settings.metrics_host, settings.metrics_port, settings.metrics_token)
    log.info("serving /metrics on http://%s:%d/metrics", host, port)
    metrics.address = f"{host}:{port}"  # shown in fleet:commanders (fleet top, fleet status)
    return metrics


def run(args: argparse.Namespace) -> int:
    """Run a commander until SIGTERM/SIGINT."""
    settings = settings_from(args)
    if settings is None:
        return 2
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {settings.commander_id} %(message)s")
    url = resolve_url(settings.redis_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    metrics = _metrics(settings)
    runtime = _runtime(settings, url)
    try:
        # few client retries: an outage reaches the loop, whose own backoff a SIGTERM interrupts
        r = connect_sync(url, retries=3, socket_timeout=10)
        return Commander(r, runtime, settings, metrics).run(stop)
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
