"""The turn as a Celery task; broker on the benchmark's redis-server, no result backend.

Worker: ``celery -A scripts.peers.celery_app worker --pool prefork --concurrency 2`` with
``REDIS_URL`` set (one main process that consumes, two forked pool processes that run turns).
The reply travels on Fleet's reply key, so the task ignores its result.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

from scripts.peers.turn import run_turn

app = Celery("fleet_peers", broker=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_default_queue="fleet-peers",
)

_client: tuple[int, redis.Redis] | None = None


def _redis() -> redis.Redis:
    """One client per pool process (a forked child must not share its parent's sockets)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(app.conf.broker_url))
    return _client[1]


@app.task(name="peers.turn", ignore_result=True)
def turn(user: str, turn_id: str, text: str, model_ms: float = 0.0) -> None:
    """The Celery task: one turn."""
    run_turn(_redis(), user, turn_id, text, model_ms)


def use_broker(url: str) -> None:
    """Point the submitting side at ``url`` (the worker side reads ``REDIS_URL``)."""
    app.conf.broker_url = url
