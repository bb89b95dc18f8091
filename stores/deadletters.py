"""A tier's dead letters (``fleet:{T}:dead``), as ``fleet status`` and ``fleet top`` read them.

The worker appends them (``worker/app.py``, ``Worker.dead_letter``)."""

from __future__ import annotations

import redis

from protocol import keys
from protocol.codec import as_str
from stores.replies import Row, raw_rows


def dead_letter_count(r: redis.Redis, tier: str) -> int:
    """How many dead letters the tier keeps."""
    return int(r.xlen(keys.dead(tier)))


def newest_dead_letters(r: redis.Redis, tier: str, count: int) -> list[Row]:
    """The newest ``count`` dead letters as ``(id, fields)``, newest first."""
    return [(as_str(i), f) for i, f in raw_rows(r.xrevrange(keys.dead(tier), count=count))]
