"""``python -m commander`` (also ``fleet commander``): run the autoscaling commander."""

from __future__ import annotations

import argparse
import inspect
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from commander.commander import Commander
from commander.runtime.process import ProcessRuntime
from commander.settings import CommanderSettings
from stores.connection import connect_sync, resolve_url

log = logging.getLogger("fleet.commander")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The commander's options (shared with ``fleet commander``)."""
    p.add_argument("--commander-id", default=None, help="unique id (default: cmd-<host>-<random>)")
    p.add_argument("--interval", type=float, default=None, help="seconds between passes (0.5)")
    p.add_argument("--spawn-mode", choices=["fork", "exec"], default=None,
                   help="fork workers from a pre-imported template (fast, default) or exec them")
    p.add_argument("--log-dir", default=None, help="worker logs (default .fleet/logs)")
    p.add_argument("--metrics-host", default=None, help="bind address of /metrics (127.0.0.1)")
    p.add_argument("--metrics-port", type=int, default=None, help="port of /metrics (9464; 0: any)")
    p.add_argument("--no-metrics", action="store_true", help="serve no /metrics")
    p.add_argument("--stop-workers-on-exit", action="store_true",
                   help="drain every worker when this commander exits (used by `fleet up`)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def settings_from(args: argparse.Namespace) -> CommanderSettings:
    """Flags override the environment (FLEET_COMMANDER_*), which overrides the defaults."""
    given: dict[str, Any] = {
        "redis_url": getattr(args, "redis_url", None), "commander_id": args.commander_id,
        "interval_s": args.interval, "spawn_mode": args.spawn_mode, "log_dir": args.log_dir,
        "metrics_host": args.metrics_host, "metrics_port": args.metrics_port}
    overrides = {k: v for k, v in given.items() if v is not None}
    if args.no_metrics:
        overrides["metrics_port"] = None
    if args.stop_workers_on_exit:
        overrides["stop_workers_on_exit"] = True
    return CommanderSettings(**overrides)


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
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        err = exc.errors()[0]
        print(f"fleet commander: {'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
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
    p = _Parser(prog="fleet commander", description="Run the Fleet commander (autoscaler).")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else the local fleet")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
