"""A tier's dead letters (``fleet:{T}:dead``), as ``fleet status`` and ``fleet top`` read them.

The worker appends them (``Worker.dead_letter`` calls :func:`dead_letter_async`)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import redis
import redis.asyncio as aioredis

from protocol import keys
from protocol.codec import as_str
from stores.replies import Row, raw_rows

DEAD_MAXLEN = 100_000
DEAD_FIELD_BYTES = 2048


def dead_letter_count(r: redis.Redis, tier: str) -> int:
    """How many dead letters the tier keeps."""
    return int(r.xlen(keys.dead(tier)))


def newest_dead_letters(r: redis.Redis, tier: str, count: int) -> list[Row]:
    """The newest ``count`` dead letters as ``(id, fields)``, newest first."""
    return [(as_str(i), f) for i, f in raw_rows(r.xrevrange(keys.dead(tier), count=count))]


async def dead_letter_async(r: aioredis.Redis, tier: str, *, user: str, entry: str, turn_id: str,
                            reason: str, worker: str, fields: Mapping[bytes, bytes]) -> None:
    """Append a turn that could not be served to the tier's dead letters, with the reason and
    its fields (each cut to ``DEAD_FIELD_BYTES``), kept to about ``DEAD_MAXLEN`` entries."""
    payload = {as_str(k)[:64]: v[:DEAD_FIELD_BYTES].decode(errors="replace") for k, v in fields.items()}
    await r.xadd(keys.dead(tier), {
        "user": user, "entry": entry, "turn_id": turn_id, "reason": reason,
        "worker": worker, "ts": f"{time.time():.3f}",
        "size": str(sum(len(k) + len(v) for k, v in fields.items())),
        "payload": json.dumps(payload)[: 4 * DEAD_FIELD_BYTES]}, maxlen=DEAD_MAXLEN, approximate=True)
