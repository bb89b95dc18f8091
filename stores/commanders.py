"""The commander registry (``fleet:commanders``): who runs, in which role, seen when.

Each commander rewrites its entry every pass (a leader) or every poll (a standby), with the
time in ``seen``. An entry not rewritten for ``STALE_S`` is a commander that is gone (killed,
or its host lost): shown as such, never as a leader, and removed by the leader after an hour.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import CodecError, as_str, decode, encode
from protocol.models import CommanderInfo
from stores.bad_state import DEFAULT, BadState, reject_wrong_type
from stores.replies import hash_reply

STALE_S = 15.0  # several standby polls and leader passes: a live commander is never this late


def commander_entries(r: redis.Redis,
                      bad: BadState = DEFAULT) -> list[tuple[str, CommanderInfo | CodecError]]:
    """Every entry by commander id: decoded, or the error that kept it from decoding (also told
    to ``bad``, as is a key of another type: no entries)."""
    try:
        entries = hash_reply(r.hgetall(keys.COMMANDERS))
    except ResponseError as exc:
        bad.note("commander", keys.COMMANDERS, "", reject_wrong_type(exc))
        return []
    out: list[tuple[str, CommanderInfo | CodecError]] = []
    for name, blob in entries.items():
        cid = as_str(name, errors="replace")
        try:
            out.append((cid, decode(CommanderInfo, blob)))
        except CodecError as exc:
            bad.note("commander", keys.COMMANDERS, cid, exc)
            out.append((cid, exc))
    return out


def read_commanders(r: redis.Redis, now: float | None = None,
                    bad: BadState = DEFAULT) -> list[dict[str, Any]]:
    """Every entry with ``alive`` (seen within ``STALE_S``), ``seen_ago_s`` and the URLs of its
    ``/metrics`` and monitor page (``metrics_url``, ``monitor_url``: one address serves both)."""
    now = time.time() if now is None else now
    out = []
    for cid, entry in commander_entries(r, bad):
        if isinstance(entry, CodecError):
            out.append({"commander": cid, "role": "unreadable entry", "alive": False})
            continue
        info = entry.model_dump()
        ago = now - info["seen"] if info["seen"] else None
        info.update(alive=ago is not None and ago <= STALE_S,
                    seen_ago_s=None if ago is None else round(ago, 1),
                    metrics_url=f"http://{info['metrics']}/metrics" if info["metrics"] else None,
                    monitor_url=f"http://{info['metrics']}/" if info["metrics"] else None)
        out.append(info)
    return sorted(out, key=lambda c: str(c.get("commander")))


def register_commander(r: redis.Redis, info: CommanderInfo) -> None:
    """Write (or rewrite) this commander's entry."""
    r.hset(keys.COMMANDERS, info.commander, encode(info))


def deregister_commander(r: redis.Redis, commander_id: str) -> None:
    """Remove this commander's entry (a clean exit)."""
    r.hdel(keys.COMMANDERS, commander_id)


def forget_commanders(r: redis.Redis, before: float, bad: BadState = DEFAULT) -> int:
    """Remove the entries of commanders last seen before ``before`` (the leader does this)."""
    gone = [cid for cid, entry in commander_entries(r, bad)
            if not isinstance(entry, CodecError) and entry.seen and entry.seen < before]
    return int(r.hdel(keys.COMMANDERS, *gone)) if gone else 0
