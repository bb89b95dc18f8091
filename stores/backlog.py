"""The backlog of each tier's ready stream: turns that no worker has started.

A worker keeps the notifications of a job in progress pending until the job ends (the ack
rule) and claims them to itself on every renew, so "lag + pending" counts work that is
being done. The backlog counts only what waits:

- ``undelivered``: notifications no worker has read yet (the group's lag);
- pending notifications whose consumer is not a live worker (SIGKILLed workers stay in the
  group as consumers; a name the registry does not know is not live either);
- pending notifications of a live worker that it has stopped claiming again: idle past
  ``unserved_after_ms`` (two renew intervals of the tier's slowest live worker, as each
  registered it), no job of it serves them (its lane was lost, say after a Redis pause), and
  they wait for a reclaim.

The rest, pending with a live worker and refreshed, is ``in_progress``: not backlog.
``held`` says which worker holds how many of those (fresh from Redis: such a worker is not
idle, whatever its last report said).

A tier spread over ready shards (``Policy.ready_shards``) is counted per shard and summed:
every shard whose stream exists (:func:`existing_shards`, a round trip or two of ``EXISTS``), not
only the policy's count, since a tier that shrank may still hold notifications on the others.

Per pass it is one pipelined round trip of ``XINFO GROUPS``, ``XPENDING`` (its summary: the
consumers that hold entries, not every consumer), ``XPENDING … IDLE`` and ``XLEN`` per tier and
shard (:func:`queue_backlog` adds them to a caller's
pipeline, so the commander reads the rest of its signals in the same round trip);
:func:`tier_backlog` is the pure judgement over the raw replies.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from protocol import keys
from protocol.codec import as_str
from protocol.models import RENEW_INTERVAL_S, WorkerInfo
from stores.cluster import is_cluster

COMMANDS_PER_TIER = 4  # what queue_backlog adds to a pipeline for one tier
STALE_LIMIT = 2_000  # idle pending entries read per tier and pass (beyond, held ones count as served)


def unserved_after_ms(renew_interval_s: float = RENEW_INTERVAL_S) -> int:
    """A job's notification is claimed again every renew: idle two renews, no job serves it."""
    return max(1, int(2_000 * renew_interval_s))


def unserved_by_tier(workers: Mapping[str, tuple[WorkerInfo, bool]], tiers: Iterable[str]) -> dict[str, int]:
    """:func:`unserved_after_ms` per tier, for the slowest renew among its live workers (a
    ``Registry.workers`` mapping; the workers' default where none is live)."""
    slowest: dict[str, float] = {}
    for info, alive in workers.values():
        if alive:
            slowest[info.tier] = max(slowest.get(info.tier, 0.0), info.renew_interval_s)
    return {tier: unserved_after_ms(slowest.get(tier, RENEW_INTERVAL_S)) for tier in tiers}


def write_starting(r: redis.Redis, slots: Mapping[str, int], ttl_ms: int) -> None:
    """Publish the turn slots of each tier's workers still starting (tier -> slots; the
    client's ``no_free_slot`` reads them), in one round trip; they expire after ``ttl_ms``
    without a new pass."""
    pipe = r.pipeline(transaction=False)
    for tier, n in slots.items():
        pipe.set(keys.starting(tier), n, px=ttl_ms)
    pipe.execute()


@dataclass(frozen=True)
class TierBacklog:
    """One tier's ready stream, counted in notifications."""

    undelivered: int = 0  # not read by any worker yet (lag)
    pending: int = 0  # delivered, not acked: every consumer's, live or not
    in_progress: int = 0  # pending with a live worker that keeps claiming it: a job it serves
    backlog: int = 0  # undelivered + the pending no live worker serves: work no one started
    held: Mapping[str, int] = field(default_factory=dict)  # live worker id -> its in_progress (> 0)


def tier_backlog(groups: Any, consumers: Any, stale: Any, length: Any, live: Collection[str]) -> TierBacklog:
    """Judge the raw replies of ``XINFO GROUPS``, ``XPENDING``'s summary (who holds how many
    entries), ``XPENDING … IDLE`` (entries idle past the bound) and ``XLEN`` of one ready stream
    (each may be the exception its command raised) against the live worker ids.

    - no stream (``XINFO GROUPS`` fails): nothing waits;
    - no group ``workers`` yet: every entry is undelivered;
    - lag unknown (Redis reports none after deletions inside the stream): every entry that
      is not pending is taken as undelivered, an upper estimate (acked entries not trimmed
      yet count) that never counts a job in progress;
    - consumers unreadable: no pending entry is known to be held, so all of it is backlog;
    - idle entries unreadable: the live workers' pending all counts as served.
    """
    if isinstance(groups, Exception) or isinstance(length, Exception):
        return TierBacklog()
    length = int(length)
    group = workers_group(groups)
    if group is None:
        return TierBacklog(undelivered=length, backlog=length)
    pending = int(group.get("pending") or 0)
    lag = group.get("lag")
    undelivered = max(0, length - pending) if lag is None else max(0, int(lag))
    unserved: dict[str, int] = {}
    for entry in [] if isinstance(stale, Exception) else stale:
        name = as_str(entry.get("consumer"))
        unserved[name] = unserved.get(name, 0) + 1
    held: dict[str, int] = {}
    for c in [] if isinstance(consumers, Exception) else consumers["consumers"]:
        name = as_str(c.get("name"))
        n = int(c.get("pending") or 0) - unserved.get(name, 0)
        if name in live and n > 0:
            held[name] = n
    in_progress = min(sum(held.values()), pending)  # replies a moment apart: never more than the group
    return TierBacklog(undelivered=undelivered, pending=pending, in_progress=in_progress,
                       backlog=undelivered + pending - in_progress, held=held)


def summed(parts: Iterable[TierBacklog]) -> TierBacklog:
    """One tier's backlog from its shards' backlogs."""
    parts = list(parts)
    held: dict[str, int] = {}
    for part in parts:
        for name, n in part.held.items():
            held[name] = held.get(name, 0) + n
    return TierBacklog(undelivered=sum(p.undelivered for p in parts), pending=sum(p.pending for p in parts),
                       in_progress=sum(p.in_progress for p in parts), backlog=sum(p.backlog for p in parts),
                       held=held)


def existing_shards(r: redis.Redis, tiers: Iterable[str]) -> dict[str, list[int]]:
    """Per tier, its ready shards to count: 0, and every higher one whose stream exists. On one
    node one ``EXISTS`` over a tier's possible higher shards counts them, and only a tier that
    has some is asked shard by shard (a second round trip); on a Cluster, where the shards are
    in as many slots, one ``EXISTS`` per possible shard and tier (one round trip)."""
    tiers = list(tiers)
    high = range(1, keys.MAX_READY_SHARDS)
    out = {tier: [0] for tier in tiers}
    probe = tiers
    if tiers and not is_cluster(r):
        pipe = r.pipeline(transaction=False)
        for tier in tiers:
            pipe.exists(*(keys.ready(tier, k) for k in high))
        counts = pipe.execute(raise_on_error=False)
        probe = [tier for tier, n in zip(tiers, counts, strict=True) if isinstance(n, Exception) or int(n)]
    if not probe:
        return out
    pipe = r.pipeline(transaction=False)
    for tier in probe:
        for k in high:
            pipe.exists(keys.ready(tier, k))
    res = pipe.execute(raise_on_error=False)
    for i, tier in enumerate(probe):
        row = res[i * len(high): (i + 1) * len(high)]
        out[tier] += [k for k, n in zip(high, row, strict=True) if not isinstance(n, Exception) and int(n)]
    return out


def workers_group(groups: Any) -> Any:
    """The ``workers`` group's entry of an ``XINFO GROUPS`` reply, or None if there is none."""
    return next((g for g in groups if as_str(g.get("name")) == keys.GROUP), None)


def queue_submit_gauges(pipe: Any, tier: str, shard: int = 0) -> None:
    """Add what a submit reads after its ``EXEC`` to a pipeline: the groups of the ready shard
    it wrote last (the lag there: a sample of the tier's) and the slots of workers already
    starting (:func:`no_free_slot` judges them)."""
    pipe.xinfo_groups(keys.ready(tier, shard))
    pipe.get(keys.starting(tier))


def no_free_slot(groups: Any, starting: Any) -> bool:
    """Whether a submit just found the tier without a free slot, net of starting workers."""
    if isinstance(groups, Exception):
        return False  # unknown: the commander still sees the backlog
    group = workers_group(groups)
    if group is None:
        return True  # no worker ever served this tier: a parked turn needs one
    lag = group.get("lag")
    if lag is None:
        return False  # Redis cannot tell after deletions: leave it to the backlog signal
    try:
        absorbed = int(starting or 0)
    except ValueError:
        absorbed = 0
    return int(lag) > absorbed


def queue_active_users(pipe: Any, tier: str, since: float) -> None:
    """Add the count of the tier's users active since ``since`` to a pipeline."""
    pipe.zcount(keys.active(tier), since, "+inf")


def active_users(r: redis.Redis, tier: str, since: float) -> int:
    """How many of the tier's users were active since ``since``."""
    return int(r.zcount(keys.active(tier), since, "+inf"))


def queue_backlog(pipe: Any, tier: str, unserved_ms: int, shards: Sequence[int] = (0,)) -> None:
    """Add the ``COMMANDS_PER_TIER`` reads of each of ``tier``'s ready ``shards`` to a pipeline."""
    for shard in shards:
        ready = keys.ready(tier, shard)
        pipe.xinfo_groups(ready)
        pipe.xpending(ready, keys.GROUP)
        pipe.xpending_range(ready, keys.GROUP, "-", "+", STALE_LIMIT, idle=unserved_ms)
        pipe.xlen(ready)


def parse_backlog(replies: Sequence[Any], live: Collection[str]) -> TierBacklog:
    """The backlog from the replies :func:`queue_backlog` asked for (``COMMANDS_PER_TIER`` per
    shard), summed over the shards."""
    n = COMMANDS_PER_TIER
    parts = []
    for i in range(0, len(replies), n):
        groups, consumers, stale, length = replies[i: i + n]
        parts.append(tier_backlog(groups, consumers, stale, length, live))
    return summed(parts)


def read_backlog(r: redis.Redis, tiers: Iterable[str], live: Collection[str],
                 unserved_ms: int | Mapping[str, int] | None = None) -> dict[str, TierBacklog]:
    """Every tier's backlog in one round trip. ``live`` are the worker ids with a heartbeat
    (``stores.registry.read_registry(r)``); ``unserved_ms``, one bound or one per tier
    (:func:`unserved_by_tier`), defaults to the workers' default renew's."""
    tiers = list(tiers)
    if not tiers:
        return {}
    bound = _per_tier(unserved_ms, tiers)
    shards = existing_shards(r, tiers)
    pipe = r.pipeline(transaction=False)
    for tier in tiers:
        queue_backlog(pipe, tier, bound[tier], shards[tier])
    res = pipe.execute(raise_on_error=False)
    out, at = {}, 0
    for tier in tiers:
        n = COMMANDS_PER_TIER * len(shards[tier])
        out[tier], at = parse_backlog(res[at: at + n], live), at + n
    return out


def read_tier_load(r: redis.Redis, tiers: Iterable[str], live: Collection[str],
                   unserved_ms: int | Mapping[str, int] | None,
                   active_since: Mapping[str, float]) -> dict[str, tuple[TierBacklog, int]]:
    """Every tier's backlog (``unserved_ms`` as for :func:`read_backlog`) and its users active
    since ``active_since[tier]``, in one round trip (a count that cannot be read is 0)."""
    tiers = list(tiers)
    bound = _per_tier(unserved_ms, tiers)
    shards = existing_shards(r, tiers)
    pipe = r.pipeline(transaction=False)
    for tier in tiers:
        queue_backlog(pipe, tier, bound[tier], shards[tier])
        queue_active_users(pipe, tier, active_since[tier])
    res = pipe.execute(raise_on_error=False) if tiers else []
    out, at = {}, 0
    for tier in tiers:
        n = COMMANDS_PER_TIER * len(shards[tier]) + 1
        *backlog_replies, active = res[at: at + n]
        at += n
        out[tier] = (parse_backlog(backlog_replies, live),
                     0 if isinstance(active, Exception) else int(active))
    return out


def _per_tier(unserved_ms: int | Mapping[str, int] | None, tiers: list[str]) -> dict[str, int]:
    if unserved_ms is None:
        unserved_ms = unserved_after_ms()
    if isinstance(unserved_ms, int):
        return dict.fromkeys(tiers, unserved_ms)
    return {tier: unserved_ms.get(tier, unserved_after_ms()) for tier in tiers}


def live_ids(workers: Mapping[str, tuple[Any, bool]]) -> frozenset[str]:
    """The ids with a live heartbeat of a ``Registry.workers`` mapping."""
    return frozenset(wid for wid, (_info, alive) in workers.items() if alive)
