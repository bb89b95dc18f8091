"""The scaling ledger (``fleet:events``): appended by the leader only, fenced by its lease.

``ledger_append.lua`` refuses the append of a holder that no longer leads, in the same call,
so a commander paused past its lease never records (nor acts on) a stale decision.
"""

from __future__ import annotations

import redis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import encode
from protocol.models import LedgerEvent
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
