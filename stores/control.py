"""A worker's control stream (``fleet:w:{<id>}:control``): drain orders to one worker, sent by
the commander; and its cancels stream (``fleet:w:{<id>}:cancels``): clients' cancels of turns it
runs (``stores.cancel``). The worker reads both in one blocking ``XREAD`` (one slot)."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from protocol import keys
from protocol.codec import as_str, encode
from protocol.models import Control
from stores.replies import RawRow, raw_streams


def send_control(r: redis.Redis, worker_id: str, message: Control, maxlen: int) -> None:
    """Append ``message`` to the worker's control stream, kept to about ``maxlen`` entries."""
    r.xadd(keys.control(worker_id), {"m": encode(message)}, maxlen=maxlen, approximate=True)


async def read_control_async(r: aioredis.Redis, worker_id: str, last: str, count: int, block_ms: int,
                             last_cancel: str = "0-0") -> tuple[list[RawRow], list[RawRow]]:
    """Block up to ``block_ms`` for up to ``count`` messages of each stream: the control
    messages after ``last``, and the cancels after ``last_cancel``."""
    control, cancels = keys.control(worker_id), keys.cancels(worker_id)
    resp = raw_streams(await r.xread({control: last, cancels: last_cancel}, count=count, block=block_ms))
    got: dict[str, list[RawRow]] = {control: [], cancels: []}
    for stream, entries in resp:
        got.setdefault(as_str(stream), []).extend(entries)
    return got[control], got[cancels]
