"""The scaling ledger (``fleet:events``): appended by the leader only, fenced by its lease.

``ledger_append.lua`` refuses the append of a holder that no longer leads, in the same call,
so a commander paused past its lease never records (nor acts on) a stale decision.

Each entry has the fields ``m`` (msgpack ``LedgerEvent``) and ``tier`` (so a reader filters
without decoding). An entry that does not decode is read as a ``CorruptEvent``: one bad entry
never hides the rest of the ledger. ``fleet events``, ``fleet top`` and the commander's monitor
read it through :func:`read_events` and :func:`events_since`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import CodecError, as_str, decode, encode
from protocol.models import LedgerEvent
from stores.functions import Functions
from stores.replies import RawRow, raw_rows, raw_streams

EVENTS_MAXLEN = 100_000
PAGE = 200  # entries per XREVRANGE when a tier filter makes us scan back
MAX_SCAN = 100_000  # never scan more of the ledger than this for one read

_s = functools.partial(as_str, errors="replace")  # a monitor shows bad bytes, never fails on them


class NotLeading(Exception):
    """The append was fenced: the lease is not held by the caller."""


class Ledger:
    """The fenced append, on a blocking client."""

    def __init__(self, r: redis.Redis) -> None:
        self._append = Functions(r).ledger_append

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


# --- reading ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CorruptEvent:
    """A ledger entry that is not a valid ``LedgerEvent``."""

    tier: str
    error: str


Entry = tuple[str, LedgerEvent | CorruptEvent]


def _field(fields: dict[Any, Any], name: str) -> Any:
    return fields.get(name.encode(), fields.get(name))


def parse_entry(entry_id: Any, fields: dict[Any, Any]) -> Entry:
    """One stream entry as ``(id, LedgerEvent)``, or ``(id, CorruptEvent)`` with the reason."""
    tier = _s(_field(fields, "tier") or "?")
    blob = _field(fields, "m")
    if blob is None:
        return _s(entry_id), CorruptEvent(tier, "no field 'm'")
    if isinstance(blob, str):
        blob = blob.encode()
    try:
        return _s(entry_id), decode(LedgerEvent, blob)
    except CodecError as exc:
        return _s(entry_id), CorruptEvent(tier, str(exc))


def tier_matches(fields: dict[Any, Any], tier: str | None) -> bool:
    """Whether an entry's ``tier`` field is ``tier`` (any entry when ``tier`` is None)."""
    return tier is None or _s(_field(fields, "tier") or "") == tier


def read_events(r: redis.Redis, tier: str | None = None, count: int = 50) -> list[Entry]:
    """The newest ``count`` ledger entries (of ``tier`` if given), oldest first."""
    if count <= 0:
        return []
    found: list[Entry] = []
    upper, scanned = "+", 0
    page = count if tier is None else max(count, PAGE)
    while len(found) < count and scanned < MAX_SCAN:
        rows = ledger_page(r, upper, page)
        if not rows:
            break
        scanned += len(rows)
        found += [parse_entry(i, f) for i, f in rows if tier_matches(f, tier)]
        if tier is None or len(rows) < page:
            break
        upper = f"({_s(rows[-1][0])}"
    return list(reversed(found[:count]))


def events_since(r: redis.Redis, since: float, tier: str | None = None,
                 limit: int = 5_000) -> list[Entry]:
    """The ledger entries appended since unix time ``since`` (of ``tier`` if given), oldest
    first; at most the newest ``limit`` of them (entry ids are their append time in ms)."""
    rows = raw_rows(r.xrevrange(keys.EVENTS, max="+", min=f"{max(0, int(since * 1000))}-0", count=limit))
    return [parse_entry(i, f) for i, f in reversed(rows) if tier_matches(f, tier)]


def event_json(entry_id: str, event: LedgerEvent | CorruptEvent) -> dict[str, Any]:
    """An entry as plain data: the event's fields plus ``id``; a corrupt one has ``corrupt``."""
    if isinstance(event, CorruptEvent):
        return {"id": entry_id, "tier": event.tier, "corrupt": event.error}
    return {"id": entry_id, **event.model_dump(mode="json")}
