"""Raw redis-py stream replies -> typed values, where stores/ reads them.

redis-py's inline annotations describe its replies as unions over RESP2/RESP3 and
``decode_responses`` (``bytes | str | None``, XREAD as a dict); Fleet's clients speak RESP2
with ``decode_responses=False``, so a stream entry is ``(id bytes, {field bytes: value bytes})``
and an XREAD reply a list of ``(stream name, entries)``. These helpers state that once, so the
stores' callers are typed. They do not copy or convert the fields.
"""

from __future__ import annotations

from typing import cast

from protocol.codec import as_str

RawRow = tuple[bytes, dict[bytes, bytes]]  # one stream entry as redis-py returns it
Row = tuple[str, dict[bytes, bytes]]  # the same with its id as text


def raw_rows(reply: object) -> list[RawRow]:
    """An XRANGE/XREVRANGE reply (``None`` or empty -> ``[]``), ids left as they are."""
    return cast("list[RawRow] | None", reply) or []


def rows(reply: object) -> list[Row]:
    """An XRANGE/XREVRANGE reply (or one stream's entries of an XREAD) with ids as text."""
    return [(as_str(rid), fields) for rid, fields in raw_rows(reply)]


def raw_streams(reply: object) -> list[tuple[bytes, list[RawRow]]]:
    """An XREAD reply (``None`` on a timeout -> ``[]``): ``(stream name, entries)`` pairs."""
    return cast("list[tuple[bytes, list[RawRow]]] | None", reply) or []


def entry_id(raw: object) -> tuple[int, int]:
    """A stream entry id (``ms-seq``, bytes or text) as a pair that orders as Redis orders ids."""
    ms, _, seq = as_str(raw).partition("-")
    return int(ms), int(seq or 0)


def hash_reply(reply: object) -> dict[bytes, bytes]:
    """An HGETALL reply: field -> value, both bytes."""
    return cast("dict[bytes, bytes]", reply)


def bytes_list(reply: object) -> list[bytes]:
    """An LRANGE (or HVALS, ...) reply: a list of bytes."""
    return cast("list[bytes]", reply)
