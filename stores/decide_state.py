"""The decide state a leader keeps per tier (``fleet:{T}:decide-state``), so its successor goes on
with the same stabilization windows instead of starting afresh.

Stored as JSON with a TTL; what the body means is ``commander.decide.TierState``'s business.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import redis

from protocol import keys


def read_decide_state(r: redis.Redis, tier: str) -> Any:
    """The saved body of ``tier``, or None if there is none. Raises ``ValueError`` if it is
    not JSON."""
    raw = r.get(keys.decide_state(tier))
    return json.loads(raw) if raw else None


def write_decide_states(r: redis.Redis, bodies: Mapping[str, dict[str, Any]], ttl_s: int) -> None:
    """Replace the saved body of each tier of ``bodies``, in one round trip; each expires after
    ``ttl_s``."""
    pipe = r.pipeline(transaction=False)
    for tier, body in bodies.items():
        pipe.set(keys.decide_state(tier), json.dumps(body), ex=ttl_s)
    pipe.execute()
