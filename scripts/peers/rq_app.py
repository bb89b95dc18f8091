"""The turn as an RQ job, and an RQ worker process to run it.

``python -m scripts.peers.rq_app --url URL --kind simple|fork --name N`` runs one worker on
the ``fleet-peers`` queue: ``simple`` is ``SimpleWorker`` (the job runs in the worker
process), ``fork`` is RQ's default ``Worker`` (a work horse is forked for every job). SIGTERM
is RQ's warm shutdown. Jobs are enqueued with ``result_ttl=0``: the reply travels on Fleet's
reply key, so RQ keeps no result (the counterpart of Celery's ``ignore_result``).
"""

from __future__ import annotations

import argparse
import logging

import redis
from rq import Queue, SimpleWorker, Worker, get_current_job

from scripts.peers.turn import run_turn

QUEUE = "fleet-peers"
KINDS = {"simple": SimpleWorker, "fork": Worker}


def run_turn_job(user: str, turn_id: str, text: str, model_ms: float = 0.0) -> None:
    """The RQ job: one turn on the worker's own connection."""
    job = get_current_job()
    assert job is not None, "run_turn_job runs inside an RQ worker"
    run_turn(job.connection, user, turn_id, text, model_ms)


def queue(r: redis.Redis) -> Queue:
    return Queue(QUEUE, connection=r)


def enqueue(q: Queue, user: str, turn_id: str, text: str) -> None:
    """Submit one turn (the submitter then BLPOPs ``keys.reply(user, turn_id)``)."""
    q.enqueue(run_turn_job, user, turn_id, text, result_ttl=0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.peers.rq_app")
    p.add_argument("--url", required=True)
    p.add_argument("--kind", choices=sorted(KINDS), default="simple")
    p.add_argument("--name", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    r = redis.Redis.from_url(args.url)
    worker = KINDS[args.kind]([queue(r)], connection=r, name=args.name)
    worker.work(logging_level="WARNING")


if __name__ == "__main__":
    main()
