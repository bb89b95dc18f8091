"""The turn as an arq (asyncio) job, and an arq worker process to run it.

``python -m scripts.peers.arq_app --url URL --max-jobs N --poll-ms P`` runs one worker with N
jobs at a time that polls its queue (a sorted set) every P ms: arq has no blocking dequeue, its
default poll is 500 ms; the benchmark gives it a fast one. ``keep_result=0``: the reply travels
on Fleet's reply key.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.worker import Worker, func

from scripts.peers.turn import run_turn_async

QUEUE = "fleet-peers"


async def turn(ctx: dict[str, Any], user: str, turn_id: str, text: str, model_ms: float = 0.0) -> None:
    """The arq job: one turn, on the worker's own connection pool."""
    await run_turn_async(ctx["redis"], user, turn_id, text, model_ms)


async def pool(url: str) -> ArqRedis:
    """The submitting side's pool: as many connections as the load generator's users want."""
    settings = RedisSettings.from_dsn(url)
    settings.max_connections = 10_000
    return await create_pool(settings, default_queue_name=QUEUE)


async def enqueue(p: ArqRedis, user: str, turn_id: str, text: str) -> None:
    """Submit one turn (the submitter then BLPOPs ``keys.reply(user, turn_id)``)."""
    await p.enqueue_job("turn", user, turn_id, text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.peers.arq_app")
    p.add_argument("--url", required=True)
    p.add_argument("--max-jobs", type=int, default=64)
    p.add_argument("--poll-ms", type=float, default=5.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    asyncio.set_event_loop(asyncio.new_event_loop())
    worker = Worker([func(turn, name="turn", keep_result=0)], queue_name=QUEUE,
                    redis_settings=RedisSettings.from_dsn(args.url), max_jobs=args.max_jobs,
                    poll_delay=args.poll_ms / 1000, keep_result=0, max_tries=1, log_results=False,
                    handle_signals=True)
    worker.run()


if __name__ == "__main__":
    main()
