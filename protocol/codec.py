"""The msgpack codec: every binary message carries the protocol version ``v``.

``encode(model)`` -> bytes; ``decode(Model, data)`` -> model or ``CodecError`` with a reason
that is fit to show a person (it ends up in the dead-letter stream).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

PROTOCOL_VERSION = 1
M = TypeVar("M", bound=BaseModel)


class CodecError(ValueError):
    """A payload that cannot become a message."""


def encode(model: BaseModel) -> bytes:
    """Serialize a model with the protocol version."""
    body = model.model_dump(mode="json")
    body["v"] = PROTOCOL_VERSION
    packed: bytes = msgpack.packb(body, use_bin_type=True)  # msgpack ships no types
    return packed


def unpack(data: bytes, max_bytes: int | None = None) -> dict[str, Any]:
    """Unpack a versioned msgpack map, checking size and version."""
    if max_bytes is not None and len(data) > max_bytes:
        raise CodecError(f"payload of {len(data)} bytes is over the limit of {max_bytes}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types for garbage
        raise CodecError(f"not msgpack: {type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(body, dict):
        raise CodecError(f"expected a msgpack map, got {type(body).__name__}")
    version = body.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise CodecError(f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})")
    return body


def validate(cls: type[M], body: dict[str, Any]) -> M:
    """Build ``cls`` from a dict, turning validation errors into one-line ``CodecError``s."""
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise CodecError(_one_line(exc)) from None


def decode(cls: type[M], data: bytes, max_bytes: int | None = None) -> M:
    """Decode ``data`` into ``cls``; raise ``CodecError`` with the reason."""
    return validate(cls, unpack(data, max_bytes))


@cache
def _plain_fields(cls: type[BaseModel]) -> dict[str, tuple[type, ...]] | None:
    """The field names of ``cls`` with the Python types their values may have, if every field is
    a plain ``str``, ``float``, ``int`` or ``bool`` with no constraint (None otherwise: a model
    with a bound, like ``MemoryItem.importance``, is always validated)."""
    allowed: dict[Any, tuple[type, ...]] = {str: (str,), float: (float, int), int: (int,), bool: (bool,)}
    out: dict[str, tuple[type, ...]] = {}
    for name, info in cls.model_fields.items():
        if info.annotation not in allowed or info.metadata:
            return None
        out[name] = allowed[info.annotation]
    return out


def decode_own(cls: type[M], data: bytes) -> M:
    """Decode a message Fleet wrote itself and reads back on the hot path (a session entry, a
    memory: every context pack holds some 25): its version, field names and value types are
    checked and the model is built without pydantic's validation (``model_construct``). A
    payload of any other shape (written by someone else, or an older version) is validated in
    full, and raises ``CodecError`` exactly as :func:`decode` does."""
    body = unpack(data)
    fields = _plain_fields(cls)
    if fields is not None and body.keys() == fields.keys() and all(
            type(body[name]) in kinds for name, kinds in fields.items()):
        return cls.model_construct(**body)
    return validate(cls, body)


def decode_valid(cls: type[M], items: Iterable[bytes]) -> list[M]:
    """Decode each item, skipping the ones that do not decode (a corrupt stored entry must not
    cost a user their turn); for lists read back from Redis."""
    out = []
    for item in items:
        try:
            out.append(decode_own(cls, item))
        except CodecError:
            continue
    return out


def as_str(value: Any, errors: str = "strict") -> str:
    """A Redis reply field as text: bytes decoded as UTF-8 (``errors`` as for ``bytes.decode``),
    anything else by ``str``."""
    return value.decode(errors=errors) if isinstance(value, bytes) else str(value)


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "message"
        parts.append(f"{where}: {err['msg']}")
    more = "" if exc.error_count() <= 3 else f" (+{exc.error_count() - 3} more)"
    return " ".join(("; ".join(parts) + more).split())  # input may hold newlines: keep one line
