"""Identifier validation at the boundary: a bad id is a clear error, never a key injection.

User ids end up inside Redis key names (``fleet:u:{alice}:inbox``); a ``{``, ``}``, ``:``,
space or control character there would change which hash slot or which key is touched.
"""

from __future__ import annotations

import re

USER_ID_MAX = 64
_USER_RE = re.compile(rf"[A-Za-z0-9_.@+-]{{1,{USER_ID_MAX}}}")
_TIER_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_TOKEN_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class InvalidId(ValueError):
    """An identifier that may not be used in a key name."""


def validate_user_id(user: object) -> str:
    """Return ``user`` if it is a valid user id (1-64 of ``A-Za-z0-9_.@+-``), else raise."""
    if isinstance(user, bytes):
        try:
            user = user.decode()
        except UnicodeDecodeError:
            raise InvalidId("user id is not valid UTF-8") from None
    if not isinstance(user, str):
        raise InvalidId(f"user id must be a string, got {type(user).__name__}")
    if not _USER_RE.fullmatch(user):
        raise InvalidId(
            f"invalid user id {user[:80]!r}: use 1-{USER_ID_MAX} characters of A-Z a-z 0-9 _ . @ + -"
        )
    return user


def validate_tier(tier: object) -> str:
    """Return ``tier`` if it is a valid tier name (lowercase, 1-32 chars), else raise."""
    if not isinstance(tier, str) or not _TIER_RE.fullmatch(tier):
        raise InvalidId(
            f"invalid tier {str(tier)[:40]!r}: use 1-32 of a-z 0-9 _ -, starting with a letter or digit"
        )
    return tier


def validate_token(value: object, what: str) -> str:
    """Validate a turn id or worker id (1-64 of ``A-Za-z0-9_.-``)."""
    if not isinstance(value, str) or not _TOKEN_RE.fullmatch(value):
        raise InvalidId(f"invalid {what} {str(value)[:80]!r}: use 1-64 of A-Z a-z 0-9 _ . -")
    return value
