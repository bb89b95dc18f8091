"""What ``decide`` remembers of each tier between passes, kept in Redis for the next leader.

A leadership reads each tier's state back once (``fleet:{T}:decide-state``), so a new leader
goes on with the same stabilization windows, measurements and pending recycles; the state is
written back at the end of a pass that changed it.
"""

from __future__ import annotations

import redis
from redis.exceptions import ResponseError

from commander.tierstate import TierState
from protocol import keys
from stores.bad_state import DEFAULT, BadState, reject_wrong_type
from stores.decide_state import read_decide_state, write_decide_states

STATE_TTL_S = 86_400  # a tier judged by no leader for a day starts afresh


class DecideStates:
    """Each tier's ``TierState``: read back at the first pass of a leadership, saved on change
    at the end of a pass."""

    def __init__(self, r: redis.Redis, bad: BadState = DEFAULT) -> None:
        self._r, self._bad = r, bad
        self._states: dict[str, TierState] = {}
        self._unsaved: set[str] = set()  # tiers whose state changed since the last save

    def get(self, tier: str) -> TierState:
        """The tier's state, read from Redis the first time this leadership asks."""
        if tier not in self._states:
            self._states[tier] = self._load(tier)
        return self._states[tier]

    def put(self, tier: str, state: TierState) -> None:
        """Keep the state the pass returned; :meth:`save` writes it to Redis if it changed."""
        if state != self._states.get(tier):
            self._states[tier] = state
            self._unsaved.add(tier)

    def save(self) -> None:
        """Write every state changed since the last save, in one round trip (the end of a pass:
        a leader deposed during it writes nothing of it)."""
        if self._unsaved:
            write_decide_states(self._r, {t: self._states[t].to_body() for t in sorted(self._unsaved)},
                                STATE_TTL_S)
            self._unsaved.clear()

    def forget(self) -> None:
        """A new leadership: read back what the last leader saved."""
        self._states.clear()
        self._unsaved.clear()

    def _load(self, tier: str) -> TierState:
        try:
            body = read_decide_state(self._r, tier)
            return TierState() if body is None else TierState.from_body(body)
        except (ValueError, KeyError, TypeError, ResponseError) as exc:  # (its pass starts afresh)
            why = reject_wrong_type(exc) if isinstance(exc, ResponseError) else f"{type(exc).__name__}: {exc}"
            self._bad.note("decide_state", keys.decide_state(tier), "", why)
            return TierState()
