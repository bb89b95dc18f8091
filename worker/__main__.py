"""``python -m worker --tier T`` (also ``fleet worker``): run one worker process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable

from protocol.flags import Parser, add_flags, settings_from_flags
from stores.roles import process_url
from worker.app import Worker, freeze_startup_heap
from worker.settings import WorkerSettings
from worker.watchdog import Watchdog


def add_arguments(p: argparse.ArgumentParser, *, tier_required: bool = False,
                  redis_url: bool = True) -> None:
    """The worker's options: one flag per field of ``WorkerSettings`` (shared with ``fleet
    worker``, which requires ``--tier`` and has ``--redis-url`` of its own)."""
    add_flags(p, WorkerSettings, skip=() if redis_url else ("redis_url",),
              required=("tier",) if tier_required else ())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="fleet worker", description="Run one Fleet worker process.")
    add_arguments(p)
    return p.parse_args(argv)


def set_process_title(tier: str, worker_id: str) -> None:
    """Name this process ``fleet-worker <tier> <worker-id>`` in ``ps`` and ``top``: a forked
    worker would otherwise show its template's command line, the same for every worker."""
    import setproctitle

    setproctitle.setproctitle(f"fleet-worker {tier} {worker_id}")


def run(args: argparse.Namespace) -> int:
    """Run a worker until it is drained (SIGTERM/SIGINT or a drain command)."""
    settings = settings_from_flags(WorkerSettings, args, "fleet worker")
    if settings is None:
        return 2
    # the worker's role (stores.roles): its URL's own credentials unless its password is known
    settings = settings.model_copy(update={"redis_url": process_url(settings.redis_url, "fleet-worker")})
    set_process_title(settings.tier, settings.worker_id)
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {settings.worker_id} %(message)s")
    worker = Worker(settings, on_ready=freeze_startup_heap)
    serve = worker.run
    if settings.pod_name or settings.health_port is not None:
        from worker.pod import Pod  # (aiohttp is imported only where it serves)

        serve = Pod(worker).run
    with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
        watchdog = Watchdog(settings.stuck_after_s)  # a loop stuck this long ends the process
        watchdog.start(runner.get_loop())
        try:
            code = runner.run(serve())
        finally:
            watchdog.stop()
    print(f"{settings.worker_id}: {worker.store.batcher.stats.summary()}", file=sys.stderr)  # (bench_peers)
    return code


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop for ``uvloop`` (and for ``auto`` when it is installed), else asyncio's (None)."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
