"""The scaling ledger (``fleet:events``): appended by the leader only, fenced by its lease.

``ledger_append.lua`` refuses the append of a holder that no longer leads, in the same call,
so a commander paused past its lease never records (nor acts on) a stale decision.
"""

from __future__ import annotations

import redis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import as_str, encode
from protocol.models import LedgerEvent
from stores.replies import RawRow, raw_rows, raw_streams
from stores.scripts import source

EVENTS_MAXLEN = 100_000


class NotLeading(Exception):
    """The append was fenced: the lease is not held by the caller."""


class Ledger:
    """The fenced append, on a blocking client."""

    def __init__(self, r: redis.Redis) -> None:
        self._append = r.register_script(source("ledger_append"))

    def append(self, holder: str, event: LedgerEvent) -> str:
        """Append ``event`` while ``holder`` leads: the entry id; else raise ``NotLeading``."""
        try:
            entry = self._append(keys=[keys.LEADER, keys.EVENTS],
                                 args=[holder, EVENTS_MAXLEN, encode(event), event.tier])
        except ResponseError as exc:
            if str(exc).startswith("FENCED"):
                raise NotLeading(holder) from None
            raise
        return entry.decode() if isinstance(entry, bytes) else str(entry)


def ledger_page(r: redis.Redis, upper: str, count: int) -> list[RawRow]:
    """Up to ``count`` entries at or below id ``upper`` (``(id`` excludes it), newest first."""
    return raw_rows(r.xrevrange(keys.EVENTS, max=upper, min="-", count=count))


def ledger_tip(r: redis.Redis) -> str:
    """The id of the newest entry, or ``0-0`` when the ledger is empty."""
    rows = raw_rows(r.xrevrange(keys.EVENTS, count=1))
    return as_str(rows[0][0]) if rows else "0-0"


def ledger_after(r: redis.Redis, last: str, count: int, block_ms: int) -> list[RawRow]:
    """Up to ``count`` entries after id ``last``, waiting up to ``block_ms`` for one."""
    resp = raw_streams(r.xread({keys.EVENTS: last}, count=count, block=block_ms))
    return [row for _stream, rows in resp for row in rows]
