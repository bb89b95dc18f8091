"""The backlog of each tier's ready stream: turns that no worker has started (DESIGN §3).

A worker keeps the notifications of a job in progress pending until the job ends (the ack
rule) and claims them to itself on every renew, so "lag + pending" counts work that is
being done. The backlog counts only what waits:

- ``undelivered``: notifications no worker has read yet (the group's lag);
- pending notifications whose consumer is not a live worker (SIGKILLed workers stay in the
  group as consumers; a name the registry does not know is not live either).

Pending notifications held by a live worker are ``in_progress``, not backlog.

Per pass it is one pipelined round trip of ``XINFO GROUPS``, ``XINFO CONSUMERS`` and
``XLEN`` per tier (:func:`queue_backlog` adds them to a caller's pipeline, so the commander
reads the rest of its signals in the same round trip); :func:`tier_backlog` is the pure
judgement over the raw replies.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from protocol import keys

COMMANDS_PER_TIER = 3  # what queue_backlog adds to a pipeline for one tier


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class TierBacklog:
    """One tier's ready stream, counted in notifications."""

    undelivered: int = 0  # not read by any worker yet (lag)
    pending: int = 0  # delivered, not acked: every consumer's, live or not
    in_progress: int = 0  # pending held by a live worker: a job it has started
    backlog: int = 0  # undelivered + pending not held by a live worker: work no one started


def tier_backlog(groups: Any, consumers: Any, length: Any, live: Collection[str]) -> TierBacklog:
    """Judge the raw replies of ``XINFO GROUPS``, ``XINFO CONSUMERS`` and ``XLEN`` of one ready
    stream (each may be the exception its command raised) against the live worker ids.

    - no stream (``XINFO GROUPS`` fails): nothing waits;
    - no group ``workers`` yet: every entry is undelivered;
    - lag unknown (Redis reports none after deletions inside the stream): every entry that
      is not pending is taken as undelivered, an upper estimate (acked entries not trimmed
      yet count) that never counts a job in progress;
    - consumers unreadable: no pending entry is known to be held, so all of it is backlog.
    """
    if isinstance(groups, Exception) or isinstance(length, Exception):
        return TierBacklog()
    length = int(length)
    group = next((g for g in groups if _s(g.get("name")) == keys.GROUP), None)
    if group is None:
        return TierBacklog(undelivered=length, backlog=length)
    pending = int(group.get("pending") or 0)
    lag = group.get("lag")
    undelivered = max(0, length - pending) if lag is None else max(0, int(lag))
    held = 0
    if not isinstance(consumers, Exception):
        held = sum(int(c.get("pending") or 0) for c in consumers if _s(c.get("name")) in live)
    held = min(held, pending)  # two replies, not one snapshot: never more than the group holds
    return TierBacklog(undelivered=undelivered, pending=pending, in_progress=held,
                       backlog=undelivered + pending - held)


def queue_backlog(pipe: Any, tier: str) -> None:
    """Add the ``COMMANDS_PER_TIER`` reads of ``tier``'s ready stream to a pipeline."""
    ready = keys.ready(tier)
    pipe.xinfo_groups(ready)
    pipe.xinfo_consumers(ready, keys.GROUP)
    pipe.xlen(ready)


def parse_backlog(replies: Sequence[Any], live: Collection[str]) -> TierBacklog:
    """The backlog from the ``COMMANDS_PER_TIER`` replies :func:`queue_backlog` asked for."""
    groups, consumers, length = replies
    return tier_backlog(groups, consumers, length, live)


def read_backlog(r: redis.Redis, tiers: Iterable[str], live: Collection[str]) -> dict[str, TierBacklog]:
    """Every tier's backlog in one round trip; ``live`` are the worker ids with a heartbeat
    (``stores.registry.read_registry(r)``)."""
    tiers = list(tiers)
    if not tiers:
        return {}
    pipe = r.pipeline(transaction=False)
    for tier in tiers:
        queue_backlog(pipe, tier)
    res = pipe.execute(raise_on_error=False)
    n = COMMANDS_PER_TIER
    return {tier: parse_backlog(res[n * i: n * i + n], live) for i, tier in enumerate(tiers)}


def live_ids(workers: dict[str, tuple[Any, bool]]) -> frozenset[str]:
    """The ids with a live heartbeat of a ``Registry.workers`` mapping."""
    return frozenset(wid for wid, (_info, alive) in workers.items() if alive)
