"""A relay's health (``fleet relay --check``): alive and not stuck.

Every relay writes a heartbeat each loop (``stores.outbox.beat_relay``: its id -> the wall time,
in one hash): after each pass, whose blocking read lasts at most ``block_ms`` (1 s). A relay
that died, hangs, or cannot reach Redis stops beating. ``fleet relay --check`` reads the
heartbeats and judges (:func:`judge`): fresh if the newest one of the relay asked for is at
most ``--max-age`` seconds old (default 30). Without ``--id`` it asks for the relays of this
host: a relay's default id is ``relay-<host>-<pid>``, so a container's (or a pod's) health check
finds the relay running in it without knowing its pid. The ages compare wall clocks: the check
and the relay run on one machine (the same container, or pod). Heartbeats older than a day are
removed by the relays' sweeps.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

DEFAULT_MAX_AGE_S = 30.0
FORGET_AFTER_S = 86_400.0  # a relay silent this long is gone: its heartbeat is removed


def host_prefix(host: str | None = None) -> str:
    """The id prefix of this host's relays: ``relay-<host, letters, digits and dashes>-``."""
    name = "".join(c for c in (host or socket.gethostname()) if c.isalnum() or c == "-")[:40] or "host"
    return f"relay-{name}-"


def default_relay_id() -> str:
    """``relay-<host>-<pid>``: unique on a host, and found by ``--check`` on it."""
    return f"{host_prefix()}{os.getpid()}"


def judge(beats: Mapping[str, float], now: float, max_age_s: float, relay_id: str | None = None,
          prefix: str | None = None) -> tuple[bool, str]:
    """Whether the relay ``relay_id`` (else the freshest of the ids starting with ``prefix``)
    beat within ``max_age_s`` of ``now``, and one line saying so or why not."""
    if relay_id is not None:
        mine = {relay_id: beats[relay_id]} if relay_id in beats else {}
        who = f"relay {relay_id}"
    else:
        prefix = prefix if prefix is not None else host_prefix()
        mine = {rid: ts for rid, ts in beats.items() if rid.startswith(prefix)}
        who = f"a relay of this host ({prefix}*)"
    if not mine:
        return False, f"no heartbeat of {who}: not started, or gone for more than a day"
    rid, ts = max(mine.items(), key=lambda kv: (kv[1], kv[0]))
    age = max(0.0, now - ts)
    if age > max_age_s:
        return False, (f"relay {rid}: last heartbeat {age:.0f}s ago, over --max-age {max_age_s:g}s: "
                       "stopped, stuck, or unable to reach Redis")
    return True, f"relay {rid}: heartbeat {age:.1f}s ago"


def gone(beats: Mapping[str, float], now: float, after_s: float = FORGET_AFTER_S) -> list[str]:
    """The relays whose last heartbeat is older than ``after_s``: to forget."""
    return sorted(rid for rid, ts in beats.items() if now - ts > after_s)
