"""The turn as an SAQ (asyncio) job, and an SAQ worker process to run it.

``python -m scripts.peers.saq_app --url URL --concurrency N`` runs one worker on the
``fleet-peers`` queue with N jobs at a time (SAQ's default dequeue: a blocking ``BLMOVE``, no
poll). Jobs are enqueued with a short ``ttl``: the reply travels on Fleet's reply key, so SAQ
keeps the finished job only briefly (its own bookkeeping stays, as in production).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from saq import Queue, Worker

from scripts.peers.turn import run_turn_async

QUEUE = "fleet-peers"
_clients: dict[str, aioredis.Redis] = {}


def queue(url: str) -> Queue:
    return Queue.from_url(url, name=QUEUE)


async def turn(ctx: dict[str, Any], *, user: str, turn_id: str, text: str, model_ms: float = 0.0) -> None:
    """The SAQ job: one turn, on the worker's own asyncio client."""
    await run_turn_async(ctx["fleet_redis"], user, turn_id, text, model_ms)


async def enqueue(q: Queue, user: str, turn_id: str, text: str) -> None:
    """Submit one turn (the submitter then BLPOPs ``keys.reply(user, turn_id)``)."""
    await q.enqueue("turn", user=user, turn_id=turn_id, text=text, ttl=60)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.peers.saq_app")
    p.add_argument("--url", required=True)
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    async def startup(ctx: dict[str, Any]) -> None:
        ctx["fleet_redis"] = aioredis.Redis.from_url(args.url)

    worker = Worker(queue(args.url), [turn], concurrency=args.concurrency, startup=startup)
    asyncio.run(worker.start())


if __name__ == "__main__":
    main()
