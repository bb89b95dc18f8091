"""Turning raw stream entries into turns, or into clear rejections.

A turn arrives in the user's inbox in one of two forms:
- binary: field ``m`` holding a msgpack ``Turn`` (what the Python client writes), with plain
  copies of its ``turn_id`` and ``tier`` (the worker's scripts read them; an entry with ``m``
  alone is served the same, its pack read by the worker instead);
- plain: fields ``text`` and optionally ``turn_id`` (default: the inbox entry id), ``tier``
  (default: the tier of the worker that reads it), ``meta`` (a JSON object), ``stream`` (``1``:
  a streamed turn) and ``deadline`` (unix seconds, a decimal number), which any Redis client can
  write. Replies to plain turns are JSON.
"""

from __future__ import annotations

import json
from typing import Literal

import msgpack

from protocol.codec import CodecError, unpack, validate
from protocol.ids import InvalidId, validate_token, validate_user_id
from protocol.models import Turn

Fields = dict[bytes, bytes]
_ROUTE_PEEK_LIMIT = 16 * 1024 * 1024  # read a rejected binary turn this far for its turn id


_BINARY_PLAIN = (b"turn_id", b"tier")  # a binary entry's plain copies of its turn id and tier


def entry_size(fields: Fields) -> int:
    """Bytes of an entry's values: for a binary turn, exactly what the client measured (its
    payload, not the plain copies of its turn id and tier beside it)."""
    binary = b"m" in fields
    return sum(len(v) for k, v in fields.items() if not (binary and k in _BINARY_PLAIN))


def reply_route(entry: str, fields: Fields) -> tuple[str, Literal["msgpack", "json"]]:
    """Where and how to reply to an entry, even a broken one: (turn id for the key, format).

    A binary turn that is rejected (oversize, invalid) is still answered on its own turn id
    when the msgpack can be read that far, so the client waiting for it gets the error.
    """
    if b"m" in fields:
        return _binary_turn_id(fields[b"m"]) or entry, "msgpack"
    raw = fields.get(b"turn_id")
    try:
        turn_id = validate_token(raw.decode(), "turn id") if raw else entry
    except (InvalidId, UnicodeDecodeError):
        turn_id = entry
    return turn_id, "json"


def _binary_turn_id(payload: bytes) -> str | None:
    if len(payload) > _ROUTE_PEEK_LIMIT:
        return None
    try:
        body = msgpack.unpackb(payload, raw=False)
        return validate_token(body.get("turn_id"), "turn id") if isinstance(body, dict) else None
    except Exception:  # noqa: BLE001 - any garbage means: no turn id to reply on
        return None


def decode_entry(user: str, tier: str, entry: str, fields: Fields, max_bytes: int) -> Turn:
    """Decode and validate one inbox entry of ``user``; raise ``CodecError`` with the reason."""
    size = entry_size(fields)
    if size > max_bytes:
        raise CodecError(f"turn of {size} bytes is over the limit of {max_bytes}")
    if b"m" in fields:
        turn = validate(Turn, unpack(fields[b"m"]))
        if turn.user != user:
            raise CodecError(f"turn is for user {turn.user!r} but sits in the inbox of {user!r}")
        for name, value in ((b"turn_id", turn.turn_id), (b"tier", turn.tier)):
            if name in fields and fields[name] != value.encode():
                raise CodecError(f"the entry's {name.decode()} field does not match its turn's")
        return turn
    return _plain(user, tier, entry, fields)


def _plain(user: str, tier: str, entry: str, fields: Fields) -> Turn:
    try:
        text = fields[b"text"].decode()
    except KeyError:
        raise CodecError("plain turn has no 'text' field (or use field 'm' with a msgpack Turn)") from None
    except UnicodeDecodeError:
        raise CodecError("'text' is not valid UTF-8") from None
    meta = {}
    if b"meta" in fields:
        try:
            meta = json.loads(fields[b"meta"])
        except (ValueError, RecursionError):  # bad JSON or UTF-8, huge ints, deep nesting
            raise CodecError("'meta' is not JSON") from None
        if not isinstance(meta, dict):
            raise CodecError("'meta' must be a JSON object")
    turn_id = fields.get(b"turn_id", entry.encode()).decode(errors="replace")
    tier = fields.get(b"tier", tier.encode()).decode(errors="replace")
    ts = entry.split("-", 1)[0]
    body = {"turn_id": turn_id, "user": user, "tier": tier, "text": text,
            "ts": int(ts) / 1000 if ts.isascii() and ts.isdigit() else 0.0, "meta": meta, "reply_fmt": "json",
            "stream": fields.get(b"stream", b"0") in (b"1", b"true")}
    if b"deadline" in fields:
        body["deadline"] = _deadline(fields[b"deadline"])
    return validate(Turn, body)


def _deadline(raw: bytes) -> float:
    """A plain turn's ``deadline`` field: unix seconds, a positive finite decimal number."""
    try:
        deadline = float(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise CodecError("'deadline' is not a number (unix seconds)") from None
    if not (0 < deadline < float("inf")):
        raise CodecError("'deadline' must be a positive, finite unix time in seconds")
    return deadline


def notification_user(fields: Fields) -> str:
    """The user a ready-stream notification is for (raises CodecError if it names none)."""
    raw = fields.get(b"user")
    if raw is None:
        raise CodecError("notification has no 'user' field")
    try:
        return validate_user_id(raw)
    except InvalidId as exc:
        raise CodecError(str(exc)) from None
