"""A worker's control stream (``fleet:w:{<id>}:control``): drain orders to one worker,
sent by the commander and read by the worker."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from protocol import keys
from protocol.codec import encode
from protocol.models import Control
from stores.replies import RawRow, raw_streams


def send_control(r: redis.Redis, worker_id: str, message: Control, maxlen: int) -> None:
    """Append ``message`` to the worker's control stream, kept to about ``maxlen`` entries."""
    r.xadd(keys.control(worker_id), {"m": encode(message)}, maxlen=maxlen, approximate=True)


async def read_control_async(r: aioredis.Redis, worker_id: str, last: str, count: int,
                             block_ms: int) -> list[RawRow]:
    """Block up to ``block_ms`` for up to ``count`` control messages after ``last``."""
    resp = raw_streams(await r.xread({keys.control(worker_id): last}, count=count, block=block_ms))
    return [row for _stream, entries in resp for row in entries]
