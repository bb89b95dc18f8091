"""Reading the scaling ledger ``fleet:events``: what changed, and why.

Each entry has the fields ``m`` (msgpack ``LedgerEvent``) and ``tier`` (so a reader filters
without decoding). An entry that does not decode is returned as a ``CorruptEvent`` and shown
as such: one bad entry never hides the rest of the ledger.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Iterator
from typing import TextIO

import redis
from redis.exceptions import RedisClusterException

from protocol.codec import as_str
from protocol.ids import validate_tier
from protocol.models import LedgerEvent
from stores.ledger import (  # the readers are in stores: the commander's monitor reads them too
    CorruptEvent,
    Entry,
    event_json,
    ledger_after,
    ledger_tip,
    parse_entry,
    read_events,
    tier_matches,
)

BLOCK_MS = 1000
RETRY_CAP_S = 5.0

_s = functools.partial(as_str, errors="replace")  # a monitor shows bad bytes, never fails on them


def stream_tip(r: redis.Redis) -> str:
    """The id of the newest ledger entry, or ``0-0`` when the ledger is empty."""
    return ledger_tip(r)


def follow(r: redis.Redis, tier: str | None, since: str,
           block_ms: int = BLOCK_MS) -> Iterator[Entry]:
    """Entries after id ``since`` (``$`` = from now on), as they are appended; never ends."""
    last = stream_tip(r) if since == "$" else since
    failures = 0
    while True:
        try:
            rows = ledger_after(r, last, 100, block_ms)
            failures = 0
        except (redis.ConnectionError, redis.TimeoutError, RedisClusterException) as exc:
            failures += 1  # Redis restarting: keep the place in the ledger and try again
            print(f"fleet events: Redis unreachable ({exc}); retrying", file=sys.stderr, flush=True)
            time.sleep(min(RETRY_CAP_S, 0.25 * 2 ** min(failures, 5)))
            continue
        for entry_id, fields in rows:
            last = _s(entry_id)
            if tier_matches(fields, tier):
                yield parse_entry(entry_id, fields)


_follow = follow  # run_events' ``follow`` argument shadows the name


# --- formatting -----------------------------------------------------------------------
def _id_time(entry_id: str) -> float:
    try:
        return int(entry_id.split("-", 1)[0]) / 1000
    except ValueError:
        return 0.0


def _hms(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts))


def _one_line(text: str) -> str:
    return " ".join(text.split())


SCALE_ACTIONS = frozenset({"scale-up", "scale-down", "reclaim-idle", "consolidate", "recycle"})
TIER_W, ACTION_W, COUNTS_W, WHO_W = 10, 15, 7, 24  # "policy-rejected" is the longest action


def counts(action: str, from_count: object, to_count: object) -> str:
    """``from->to`` for a change of the worker count; ``-`` for the other events (leader, hold, ...)."""
    return f"{from_count}->{to_count}" if action in SCALE_ACTIONS else "-"


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, an ellipsis marking a cut."""
    return text if len(text) <= width else text[:max(width - 1, 0)] + "…"


def duration(seconds: float | None) -> str:
    """``45s``, ``12m``, ``3h``, ``2d``: short enough for a narrow column."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _who(event: LedgerEvent) -> str:
    parts = []
    if event.spawned:
        parts.append("+" + ",".join(event.spawned))
    if event.victims:
        parts.append("-" + ",".join(event.victims))
    return clip(" ".join(parts), WHO_W) or "-"  # every id is in --json


def format_event(entry_id: str, event: LedgerEvent | CorruptEvent, brief: bool = False) -> str:
    """One line: time (UTC), tier, action, from->to, spawned/victims, reason, epoch.

    The columns before the reason have fixed widths (a longer tier or id list is cut, with
    ``…``), so the lines stay aligned; the reason is last and whole. ``brief`` leaves out the
    spawned/victims column and the epoch (for a narrow ``fleet top``).
    """
    if isinstance(event, CorruptEvent):
        return (f"{_hms(_id_time(entry_id))}  {clip(event.tier, TIER_W):<{TIER_W}} "
                f"CORRUPT        entry {entry_id}: {_one_line(event.error)}")
    head = (f"{_hms(event.ts)}  {clip(event.tier, TIER_W):<{TIER_W}} {event.action:<{ACTION_W}} "
            f"{counts(event.action, event.from_count, event.to_count):<{COUNTS_W}} ")
    reason = _one_line(event.reason) or "-"
    return head + reason if brief else f"{head}{_who(event):<{WHO_W}} {reason}  (epoch {event.epoch})"


# --- the command ----------------------------------------------------------------------
def run_events(r: redis.Redis, tier: str | None = None, count: int = 50, follow: bool = False,
               as_json: bool = False, out: TextIO | None = None) -> int:
    """``fleet events``: print the ledger (then follow it with ``follow``); Ctrl-C exits 0.

    Without ``follow``, ``as_json`` prints one JSON array; with it, one JSON object per line.
    """
    out = out or sys.stdout
    if tier is not None:
        validate_tier(tier)
    tip = stream_tip(r) if follow else "0-0"
    entries = read_events(r, tier, count)
    if as_json and not follow:
        print(json.dumps([event_json(i, e) for i, e in entries], indent=2), file=out)
        return 0
    for entry_id, event in entries:
        _emit(entry_id, event, as_json, out)
    if not entries and not as_json:
        print("no events" + (f" for tier {tier}" if tier else ""), file=out, flush=True)
    if not follow:
        return 0
    since = entries[-1][0] if entries else tip
    try:
        for entry_id, event in _follow(r, tier, since):
            _emit(entry_id, event, as_json, out)
    except KeyboardInterrupt:
        return 0
    return 0


def _emit(entry_id: str, event: LedgerEvent | CorruptEvent, as_json: bool, out: TextIO) -> None:
    line = json.dumps(event_json(entry_id, event)) if as_json else format_event(entry_id, event)
    print(line, file=out, flush=True)
