"""What ``decide`` remembers between passes for one tier, and its JSON body in Redis.

The body is ``fleet:{T}:decide-state`` (``stores.decide_state``), so a new leader goes on with
the same windows, measurements and pending recycles instead of starting afresh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TierState:
    """One tier's memory.

    ``history`` holds ``(ts, desired)`` pairs inside the scale-in hold, kept as a monotone queue
    (values strictly decrease with time): an older, lower entry can never be the window's max
    again, so it is dropped and the state stays small. ``changes`` are the scale events the rate
    rules look back on, ``starts`` the measured start costs (``commander.holdtime``),
    ``failures`` the failed observations in a row, ``recycling`` the workers being replaced,
    ``steps`` the last two scale-ups ``(ts, workers)`` (a step within a burst doubles the one
    before it: ``commander.scaleup``; two, so that a pass repeated at the same ``now`` sees the
    step the first one saw), ``queued_since`` since when turns have waited beyond the free
    slots. ``last_scale_down`` is the last scale-in (recycling is not one).
    """

    history: tuple[tuple[float, int], ...] = ()
    last_scale_up: float | None = None
    last_scale_down: float | None = None
    changes: tuple[tuple[float, int], ...] = ()
    starts: tuple[tuple[str, float], ...] = ()
    failures: int = 0
    failed_at: float | None = None  # the pass that counted the last failure (a repeat does not)
    recycling: tuple[tuple[str, float, str], ...] = ()  # (old worker, replacement asked at, phase)
    steps: tuple[tuple[float, int], ...] = ()
    queued_since: float | None = None

    def to_body(self) -> dict[str, Any]:
        """Plain JSON data."""
        return {"history": [list(h) for h in self.history], "last_scale_up": self.last_scale_up,
                "last_scale_down": self.last_scale_down, "changes": [list(c) for c in self.changes],
                "starts": [list(s) for s in self.starts], "failures": self.failures,
                "failed_at": self.failed_at, "recycling": [list(r) for r in self.recycling],
                "steps": [list(s) for s in self.steps], "queued_since": self.queued_since}

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> TierState:
        """Read ``to_body``'s data (fields missing from an older body start empty).

        Raises ``ValueError``, ``KeyError`` or ``TypeError`` on a malformed body (a body is
        data read from Redis: every field is checked here, none reaches ``decide`` unchecked)."""
        if not isinstance(body, dict):
            raise TypeError(f"a decide state is a JSON object, not {type(body).__name__}")
        return cls(history=tuple((float(t), int(d)) for t, d in body["history"]),
                   last_scale_up=_time(body.get("last_scale_up")),
                   last_scale_down=_time(body.get("last_scale_down")),
                   changes=tuple((float(t), int(d)) for t, d in body.get("changes", ())),
                   starts=tuple((str(w), float(s)) for w, s in body.get("starts", ())),
                   failures=int(body.get("failures", 0)), failed_at=_time(body.get("failed_at")),
                   recycling=tuple((str(w), float(t), str(p)) for w, t, p in body.get("recycling", ())),
                   steps=tuple((float(t), int(n)) for t, n in body.get("steps", ())),
                   queued_since=_time(body.get("queued_since")))


def _time(value: Any) -> float | None:
    """An optional time of a body: a number or null (a string or a list is refused, not parsed)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a time is a number or null, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"a time is a finite number, not {value}")
    return float(value)
