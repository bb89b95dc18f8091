"""``python -m worker --tier T`` (also ``fleet worker``): run one worker process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pydantic import ValidationError

from worker.app import Worker
from worker.settings import WorkerSettings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fleet worker", description="Run one Fleet worker process.")
    p.add_argument("--tier", default=None, help="tier to serve (default: chat)")
    p.add_argument("--worker-id", default=None, help="unique id (default: <tier>-<random>)")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else the local fleet")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def set_process_title(tier: str, worker_id: str) -> None:
    """Name this process ``fleet-worker <tier> <worker-id>`` in ``ps`` and ``top``: a forked
    worker would otherwise show its template's command line, the same for every worker."""
    import setproctitle

    setproctitle.setproctitle(f"fleet-worker {tier} {worker_id}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {k: v for k, v in {"tier": args.tier, "worker_id": args.worker_id,
                                   "redis_url": args.redis_url}.items() if v is not None}
    try:
        settings = WorkerSettings(**overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        print(f"fleet worker: {'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}", file=sys.stderr)
        return 2
    set_process_title(settings.tier, settings.worker_id)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {settings.worker_id} %(message)s")
    return asyncio.run(Worker(settings).run())


if __name__ == "__main__":
    sys.exit(main())
