"""The msgpack codec: every binary message carries the protocol version ``v``.

``encode(model)`` -> bytes; ``decode(Model, data)`` -> model or ``CodecError`` with a reason
that is fit to show a person (it ends up in the dead-letter stream).
"""

from __future__ import annotations

from collections.abc import Iterable
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


def decode_valid(cls: type[M], items: Iterable[bytes]) -> list[M]:
    """Decode each item, skipping the ones that do not decode (a corrupt stored entry must not
    cost a user their turn); for lists read back from Redis."""
    out = []
    for item in items:
        try:
            out.append(decode(cls, item))
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
