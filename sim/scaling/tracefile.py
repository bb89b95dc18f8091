"""Reading any request trace into ``Request`` rows: CSV, TSV or JSON lines, by column mapping.

What a trace may look like, and how each is read (``read_requests``):

- **Columns.** ``Columns`` names the timestamp (``ts``), input-length (``in``), output-length
  (``out``), request-count (``count``) and user (``user``) columns, e.g. from the command line
  ``ts=TIMESTAMP,in=ContextTokens,out=GeneratedTokens``. A role left out is looked up among
  the usual names (``ALIASES``: the Azure LLM traces' ``TIMESTAMP``/``ContextTokens``/
  ``GeneratedTokens``, Mooncake's ``timestamp``/``input_length``/``output_length``,
  BurstGPT's ``Timestamp``/``Request tokens``/``Response tokens``, ...).
- **Timestamps** (``parse_ts``): ISO 8601 with ``T`` or a space, any number of fractional
  digits, and ``Z`` or an offset (``+01:00``, ``-0500``); a naive one is read in ``tz``
  (an IANA zone, UTC by default). A number is seconds (``ts_unit="s"``), milliseconds or
  microseconds; ``auto`` takes milliseconds in JSON lines and seconds in CSV. A number
  below 10^9 seconds (before 2001) is an offset from ``start`` (unix seconds, 0 by default),
  as in traces that publish time since their own start.
- **A UTF-8 byte-order mark** at the head of the file is skipped.
- **Rate-only rows** (a ``count`` column and no lengths, e.g. requests per minute):
  ``count`` arrivals are drawn in the row's window ``[ts, ts + window_s)``, uniformly and
  independently, with a ``random.Random(seed)``: a Poisson process conditioned on the
  window's count, so every window has exactly the published count. A fractional count
  ``n + f`` gives ``n`` arrivals and one more with probability ``f``. ``window_s`` is the
  median gap between consecutive rows unless given.

A trace without lengths (``Trace.has_lengths`` false) needs a service model that does not
read them (``sim.scaling.service``).
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from statistics import median
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sim.scaling.trace import Request

TsUnit = Literal["auto", "s", "ms", "us"]
RELATIVE_BELOW_S = 1e9  # 2001-09-09: a number below is an offset, not a unix time
_UNIT_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_ISO = re.compile(r"(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2})(?::(\d{2})(?:[.,](\d+))?)?"
                  r"\s*(Z|[+-]\d{2}:?\d{2})?", re.IGNORECASE)
ALIASES: dict[str, tuple[str, ...]] = {
    "ts": ("TIMESTAMP", "timestamp", "Timestamp", "ts", "time", "arrival_time", "created_at",
           "start_time"),
    "in": ("ContextTokens", "input_length", "input_tokens", "prompt_tokens", "Request tokens",
           "context_tokens", "prompt_len", "num_input_tokens"),
    "out": ("GeneratedTokens", "output_length", "output_tokens", "completion_tokens",
            "Response tokens", "generated_tokens", "output_len", "num_output_tokens"),
    "count": ("count", "requests", "invocations", "num_requests"),
    "user": ("user", "user_id", "conversation_id", "session_id", "conversation"),
}


@dataclass(frozen=True)
class Columns:
    """Which column plays which role; None: look it up among ``ALIASES``."""

    ts: str | None = None
    inp: str | None = None
    out: str | None = None
    count: str | None = None
    user: str | None = None


_ROLE_FIELD = {"ts": "ts", "in": "inp", "out": "out", "count": "count", "user": "user"}


def parse_columns(text: str) -> Columns:
    """``"ts=TIMESTAMP,in=ContextTokens,out=GeneratedTokens"`` -> ``Columns``."""
    given: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, sep, name = part.partition("=")
        if not sep or not name or role not in _ROLE_FIELD:
            raise ValueError(f"{part!r}: expected ROLE=COLUMN with ROLE one of "
                             f"{', '.join(_ROLE_FIELD)}")
        given[_ROLE_FIELD[role]] = name
    return Columns(**given)


@dataclass(frozen=True)
class TraceSource:
    """How to read one trace file (see the module docstring)."""

    path: Path
    columns: Columns = Columns()
    ts_unit: TsUnit = "auto"
    tz: str = "UTC"
    start: float = 0.0
    window_s: float | None = None
    seed: int = 7
    name: str | None = None


@dataclass(frozen=True)
class Trace:
    """Requests sorted by time, with where they came from."""

    name: str
    requests: list[Request]
    has_lengths: bool
    arrivals: str  # how the arrival times were obtained, for the report

    @property
    def epoch(self) -> float:
        """Unix time of the first request (0 for an empty trace)."""
        return self.requests[0].ts if self.requests else 0.0


def zone(name: str) -> ZoneInfo:
    """An IANA time zone; ``ValueError`` naming it when unknown."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r} (an IANA name, e.g. UTC or Europe/Paris)") from None


def _offset(text: str) -> timezone:
    sign = -1 if text[0] == "-" else 1
    digits = text[1:].replace(":", "")
    return timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))


def parse_iso(text: str, tz: ZoneInfo) -> float:
    """An ISO 8601 date-time (``T`` or space, any fraction, ``Z`` or offset) as unix seconds."""
    m = _ISO.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not an ISO 8601 date-time")
    year, month, day, hour, minute, second, frac, off = m.groups()
    where = tz if off is None else (timezone.utc if off.upper() == "Z" else _offset(off))  # noqa: UP017
    whole = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second or 0),
                     tzinfo=where)
    return whole.timestamp() + (float(f"0.{frac}") if frac else 0.0)


def parse_ts(value: Any, *, unit: Literal["s", "ms", "us"], tz: ZoneInfo, start: float) -> float:
    """A timestamp cell (text or number) as unix seconds (see the module docstring)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a timestamp")
    number: float | None = float(value) if isinstance(value, (int, float)) else None
    if number is None:
        text = str(value).strip()
        try:
            number = float(text)
        except ValueError:
            return parse_iso(text, tz)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a timestamp")
    seconds = number * _UNIT_S[unit]
    return seconds if seconds >= RELATIVE_BELOW_S else start + seconds


def _resolve(columns: Columns, header: list[str]) -> Columns:
    """Fill the roles left unnamed from ``ALIASES``; a named column must exist."""
    present = set(header)
    found: dict[str, str | None] = {}
    for role, attr in _ROLE_FIELD.items():
        named = getattr(columns, attr)
        if named is not None:
            if named not in present:
                raise ValueError(f"no column {named!r} (columns: {', '.join(header)})")
            found[attr] = named
        else:
            found[attr] = next((a for a in ALIASES[role] if a in present), None)
    resolved = Columns(**found)
    if resolved.ts is None:
        raise ValueError(f"no timestamp column among {', '.join(header)}: name it with ts=COLUMN")
    return resolved


def _jsonl_rows(path: Path, text: str) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: a JSON line must be an object")
        rows.append(row)
    return rows


def _rows(path: Path) -> tuple[list[Mapping[str, Any]], list[str], bool]:
    """(rows, header, is_jsonl); a UTF-8 BOM is skipped."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        text = f.read()
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        rows = _jsonl_rows(path, text)
        return list(rows), sorted({k for row in rows for k in row}), True
    reader = csv.DictReader(text.splitlines(), delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
    body: list[Mapping[str, Any]] = list(reader)
    return body, list(reader.fieldnames or []), False


def _int_cell(row: Mapping[str, Any], column: str | None) -> int:
    if column is None:
        return 0
    value = row.get(column)
    if value is None or value == "":
        raise ValueError(f"empty {column}")
    return int(float(value))


def read_trace_file(source: TraceSource) -> Trace:
    """Read ``source`` into a ``Trace``; ``ValueError`` names the file and line of a bad row."""
    path = Path(source.path)
    rows, header, jsonl = _rows(path)
    cols = _resolve(source.columns, header)
    assert cols.ts is not None
    unit: Literal["s", "ms", "us"] = ("ms" if jsonl else "s") if source.ts_unit == "auto" else source.ts_unit
    tz = zone(source.tz)
    lengths = cols.inp is not None or cols.out is not None
    rate_only = cols.count is not None and not lengths
    parsed: list[tuple[float, int, int, str | None, float]] = []
    for n, row in enumerate(rows, start=1 if jsonl else 2):
        try:
            ts = parse_ts(row.get(cols.ts), unit=unit, tz=tz, start=source.start)
            count = float(row.get(cols.count) or 0) if rate_only and cols.count else 1.0
            user = None if cols.user is None else str(row.get(cols.user))
            parsed.append((ts, _int_cell(row, cols.inp), _int_cell(row, cols.out), user, count))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: {exc} (columns: ts={cols.ts}, in={cols.inp}, "
                             f"out={cols.out}, count={cols.count})") from None
    name = source.name or path.stem
    if rate_only:
        window = source.window_s or _median_gap([p[0] for p in parsed])
        requests = arrivals_from_counts([(p[0], p[4]) for p in parsed], window, source.seed)
        how = (f"drawn from per-window counts ({window:g} s windows): uniform in each window, "
               f"seed {source.seed}")
        return Trace(name, requests, False, how)
    requests = sorted((Request(ts, i, o, u) for ts, i, o, u, _ in parsed), key=lambda r: r.ts)
    return Trace(name, requests, lengths, "as recorded")


def _median_gap(times: list[float]) -> float:
    ordered = sorted(set(times))
    gaps = [b - a for a, b in zip(ordered, ordered[1:], strict=False) if b > a]
    if not gaps:
        raise ValueError("cannot tell the window of a rate-only trace with one row: give window_s")
    return float(median(gaps))


def arrivals_from_counts(rows: list[tuple[float, float]], window_s: float, seed: int) -> list[Request]:
    """Arrival times for per-window counts: each window's count, uniform in the window (seeded)."""
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    rng = random.Random(seed)
    out: list[float] = []
    for start, count in sorted(rows):
        if count < 0 or not math.isfinite(count):
            raise ValueError(f"bad count {count!r} at {start}")
        whole = int(count)
        n = whole + (1 if rng.random() < count - whole else 0)
        out.extend(start + rng.random() * window_s for _ in range(n))
    out.sort()
    return [Request(ts, 0, 0) for ts in out]


def with_name(trace: Trace, name: str | None) -> Trace:
    """The same trace under another name (None keeps it)."""
    return trace if name is None else replace(trace, name=name)


__all__ = ["ALIASES", "Columns", "Trace", "TraceSource", "arrivals_from_counts", "parse_columns",
           "parse_iso", "parse_ts", "read_trace_file", "with_name", "zone"]
