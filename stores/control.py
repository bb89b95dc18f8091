"""A worker's control stream (``fleet:w:<id>:control``): drain orders to one worker."""

from __future__ import annotations

import redis

from protocol import keys
from protocol.codec import encode
from protocol.models import Control


def send_control(r: redis.Redis, worker_id: str, message: Control, maxlen: int) -> None:
    """Append ``message`` to the worker's control stream, kept to about ``maxlen`` entries."""
    r.xadd(keys.control(worker_id), {"m": encode(message)}, maxlen=maxlen, approximate=True)
