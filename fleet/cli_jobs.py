"""``fleet relay``, ``fleet rq-worker`` and ``fleet jobs failed|requeue`` (the async tiers).
They need the ``rq`` extra (``pip install 'fleet[rq]'``); without it each says so."""

from __future__ import annotations

import argparse
import os
from typing import Any

import redis

from fleet.cli_base import EXIT_USAGE, CliError, Parser, cli_client, count_arg, print_result

RQ_MISSING = "needs RQ, the rq extra: pip install 'fleet[rq]'"


def _need_rq() -> None:
    try:
        import rq  # noqa: F401
    except ImportError:
        raise CliError(RQ_MISSING, EXIT_USAGE) from None


def _rq_client(args: argparse.Namespace) -> redis.Redis:
    """RQ's Redis: ``--rq-url``, else ``$FLEET_RQ_URL``, else Fleet's own."""
    url = getattr(args, "rq_url", None) or os.environ.get("FLEET_RQ_URL")
    if url:
        try:
            return redis.Redis.from_url(url)
        except ValueError as exc:
            raise CliError(f"bad --rq-url: {exc}", EXIT_USAGE) from None
    return cli_client(args)


def cmd_relay(args: argparse.Namespace) -> int:
    _need_rq()
    from pydantic import ValidationError

    from worker.rq.relay import run

    try:
        return run(args)
    except ValidationError as exc:  # a value the settings refuse (--batch 0, ...)
        err = exc.errors()[0]
        raise CliError(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}", EXIT_USAGE) from None


def cmd_rq_worker(args: argparse.Namespace) -> int:
    _need_rq()
    from protocol.deferral import validate_queue
    from worker.rq.rq_worker import run

    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    if not queues:
        raise CliError("--queues names no queue", EXIT_USAGE)
    for q in queues:
        try:
            validate_queue(q)
        except ValueError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    return run(args)


def cmd_jobs_failed(args: argparse.Namespace) -> int:
    _need_rq()
    from stores.rqview import failed_rows

    rows = failed_rows(_rq_client(args), args.queue, args.count)

    def text(rows: list[dict[str, Any]]) -> str:
        lines = [f"{row['id']}  {row['description']}  {row['error']}" for row in rows]
        return "\n".join(lines) or f"no failed jobs in queue {args.queue!r}"

    print_result(rows, args.json, text)
    return 0


def cmd_jobs_requeue(args: argparse.Namespace) -> int:
    _need_rq()
    from stores import rqjobs

    if bool(args.ids) == bool(args.all):
        raise CliError("name the job ids to requeue, or --all (not both)", EXIT_USAGE)
    try:
        done = rqjobs.requeue(_rq_client(args), args.queue, None if args.all else args.ids)
    except KeyError as exc:
        raise CliError(str(exc.args[0]), 1) from None
    print_result(done, args.json, lambda ids: f"requeued {len(ids)} job(s) on {args.queue!r}")
    return 0


def _load_relay_arguments(p: argparse.ArgumentParser) -> None:
    _need_rq()
    from worker.rq.relay import add_arguments

    add_arguments(p)


def _load_rq_worker_arguments(p: argparse.ArgumentParser) -> None:
    _need_rq()
    from worker.rq.rq_worker import add_arguments

    add_arguments(p)


def add_job_commands(sub: Any) -> None:
    """The async tiers' commands (``relay`` and ``rq-worker`` load their options, and RQ, only
    when they run: the core install has no RQ)."""
    rl = sub.add_parser("relay", help="move committed deferrals into RQ queues, each exactly once",
                        load=_load_relay_arguments)
    rl.set_defaults(func=cmd_relay)
    rw = sub.add_parser("rq-worker", help="run one RQ worker of Fleet's (registered jobs only)",
                        load=_load_rq_worker_arguments)
    rw.set_defaults(func=cmd_rq_worker)

    jb = sub.add_parser("jobs", help="deferred jobs in RQ: failed ones, and requeue them")
    jsub = jb.add_subparsers(dest="jobs_command", required=True, parser_class=Parser)
    f = jsub.add_parser("failed", help="failed jobs of a queue with their last traceback line")
    f.add_argument("--queue", default="writeback", help="RQ queue (default: writeback)")
    f.add_argument("--count", type=count_arg, default=20, help="show the newest N (default: 20)")
    f.add_argument("--rq-url", help="RQ's Redis (default: $FLEET_RQ_URL, else Fleet's)")
    f.add_argument("--json", action="store_true", help="a JSON array, tracebacks whole")
    f.set_defaults(func=cmd_jobs_failed)
    rq_ = jsub.add_parser("requeue", help="put failed jobs back in their queue: ID... or --all")
    rq_.add_argument("ids", nargs="*", metavar="ID")
    rq_.add_argument("--all", action="store_true", help="every failed job of the queue")
    rq_.add_argument("--queue", default="writeback", help="RQ queue (default: writeback)")
    rq_.add_argument("--rq-url", help="RQ's Redis (default: $FLEET_RQ_URL, else Fleet's)")
    rq_.add_argument("--json", action="store_true")
    rq_.set_defaults(func=cmd_jobs_requeue)
