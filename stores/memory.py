"""Episodic memory: top-K by a score of recency and importance, in one ZREVRANGE.

The score of a memory is ``importance * 2 ** (-(now - ts) / half_life)``: a memory loses half
its weight every ``half_life`` seconds. Its logarithm is
``ln(importance) + ts * ln(2) / half_life - now * ln(2) / half_life``, and the last term is
the same for every memory of the user, so ranking by the *time-independent* key
``ln(importance) + ts * ln(2) / half_life`` gives exactly the same order at any ``now``.
That key is the sorted-set score: top-K is ``ZREVRANGE 0 K-1``, no rescoring ever.
"""

from __future__ import annotations

import math
import uuid

from protocol.codec import decode_valid, encode
from protocol.models import MemoryItem

DEFAULT_HALF_LIFE_S = 86_400.0  # one day


def rank_key(importance: float, ts: float, half_life_s: float = DEFAULT_HALF_LIFE_S) -> float:
    """The sorted-set score of a memory (see the module docstring)."""
    if not 0.0 < importance <= 1.0:
        raise ValueError(f"importance must be in (0, 1], got {importance}")
    return math.log(importance) + ts * math.log(2) / half_life_s


def weight(item: MemoryItem, now: float, half_life_s: float = DEFAULT_HALF_LIFE_S) -> float:
    """The memory's weight at ``now``: importance decayed by its age."""
    decay: float = 2.0 ** (-(now - item.ts) / half_life_s)  # float ** float is Any in typeshed
    return item.importance * decay


def new_member(text: str, importance: float, ts: float,
               half_life_s: float = DEFAULT_HALF_LIFE_S) -> tuple[bytes, float]:
    """A (member, score) pair ready for ZADD."""
    item = MemoryItem(id=uuid.uuid4().hex[:12], text=text, importance=importance, ts=ts)
    member = encode(item)
    return member, rank_key(importance, ts, half_life_s)


def parse_members(raw: list[bytes]) -> list[MemoryItem]:
    """Decode ZREVRANGE members; a corrupt member is skipped, not fatal."""
    return decode_valid(MemoryItem, raw)
