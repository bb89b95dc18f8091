"""The turn as a Dramatiq actor on its Redis broker; the workers are Dramatiq's own CLI.

Worker: ``dramatiq scripts.peers.dramatiq_app --processes 2 --threads T`` with ``REDIS_URL``
set (one supervisor that forks 2 worker processes, each with T worker threads and a consumer
thread that prefetches). The reply travels on Fleet's reply key, so no result backend; no
retries (a peer that fails a turn reports it as an error reply would not come: the benchmark's
timeout). Only the broker's default middleware that costs nothing here: age and time limits,
shutdown notifications, callbacks, pipelines, retries (``max_retries=0``).
"""

from __future__ import annotations

import os
import threading

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

from scripts.peers.turn import run_turn

QUEUE = "fleet-peers"
broker = RedisBroker(url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
dramatiq.set_broker(broker)
_local = threading.local()


def _redis() -> redis.Redis:
    """One client per worker thread (and per forked process: a thread-local is per process too)."""
    client = getattr(_local, "client", None)
    if client is None or _local.pid != os.getpid():
        client = _local.client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
        _local.pid = os.getpid()
    return client


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def turn(user: str, turn_id: str, text: str, model_ms: float = 0.0) -> None:
    """The Dramatiq actor: one turn."""
    run_turn(_redis(), user, turn_id, text, model_ms)


def use_broker(url: str) -> None:
    """Point the submitting side at ``url`` (the worker side reads ``REDIS_URL``)."""
    global broker
    broker = RedisBroker(url=url)
    dramatiq.set_broker(broker)
    turn.broker = broker
    broker.declare_actor(turn)


def enqueue(user: str, turn_id: str, text: str) -> None:
    """Submit one turn (the submitter then BLPOPs ``keys.reply(user, turn_id)``)."""
    turn.send(user, turn_id, text)
