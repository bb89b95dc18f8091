"""The worker registry (``fleet:workers``) read with liveness: one HGETALL, then the heartbeats.

A registered worker whose heartbeat key has expired is dead: it is returned with
``alive=False`` (callers decide whether to show it or ignore it). An entry that does not
decode, or whose ids are not valid, is skipped, named in ``unreadable`` and told to a
``stores.bad_state.BadState``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import redis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import CodecError, as_str, decode
from protocol.groups import validate_pool
from protocol.ids import InvalidId, validate_token
from protocol.models import WorkerInfo
from stores.bad_state import DEFAULT, BadState, reject_wrong_type
from stores.cluster import is_cluster
from stores.replies import hash_reply


@dataclass(frozen=True)
class Registry:
    """Workers by id with whether their heartbeat is alive."""

    workers: dict[str, tuple[WorkerInfo, bool]] = field(default_factory=dict)
    unreadable: tuple[str, ...] = ()

    def live(self, tier: str | None = None) -> list[WorkerInfo]:
        """Workers with a heartbeat (of ``tier``, if given), by id."""
        return [info for wid, (info, alive) in sorted(self.workers.items())
                if alive and (tier is None or info.tier == tier)]


def _entry(wid: str, blob: bytes) -> WorkerInfo:
    """A registry entry decoded and checked: its ids are valid (they name keys, and its tier a
    pool) and its field is its own worker id. Raises ``CodecError`` or ``InvalidId``."""
    info = decode(WorkerInfo, blob)
    validate_token(info.worker, "worker id")
    validate_pool(info.tier)
    if info.worker != wid:
        raise InvalidId(f"the field names worker {wid!r}, the entry {info.worker[:40]!r}")
    return info


Known = dict[tuple[bytes, bytes], WorkerInfo]  # (field, entry) -> the entry decoded and checked


def read_entries(r: redis.Redis, bad: BadState = DEFAULT,
                 known: Known | None = None) -> tuple[list[WorkerInfo], list[str]]:
    """Every registry entry that decodes and whose ids are valid, and the ids of those that are
    not (told to ``bad``, as is a registry of another type), in one HGETALL. ``known``: the
    entries a reader decoded on its last read, by their exact bytes; an entry unchanged since is
    not decoded again (a commander reads 10,000 of them a pass). It is left holding this read's."""
    try:
        entries = hash_reply(r.hgetall(keys.WORKERS))
    except ResponseError as exc:
        bad.note("registry", keys.WORKERS, "", reject_wrong_type(exc))
        return [], []
    infos, unreadable, seen = [], [], {}
    for name, blob in entries.items():
        info = known.get((name, blob)) if known else None
        if info is None:
            wid = as_str(name, errors="replace")
            try:
                info = _entry(wid, blob)
            except (CodecError, InvalidId) as exc:
                bad.note("registry", keys.WORKERS, wid, exc)
                unreadable.append(wid)
                continue
        infos.append(info)
        seen[name, blob] = info
    if known is not None:
        known.clear()
        known.update(seen)
    return infos, unreadable


HEARTBEATS_PER_MGET = 1000  # heartbeats read by one MGET (one node)


def read_registry(r: redis.Redis, bad: BadState = DEFAULT, known: Known | None = None) -> Registry:
    """The registry with every worker's liveness, in two round trips (bad entries: ``bad``).
    On one node the heartbeats are read by an ``MGET`` per thousand workers (a heartbeat that
    is not a string, never a worker's, reads as none: dead); on a Cluster they are in as many
    slots as workers, one ``EXISTS`` each. ``known``: as :func:`read_entries`."""
    infos, unreadable = read_entries(r, bad, known)
    if not infos:
        return Registry(unreadable=tuple(unreadable))
    beats = [keys.heartbeat(info.worker) for info in infos]
    pipe = r.pipeline(transaction=False)
    if is_cluster(r):
        for key in beats:
            pipe.exists(key)
        alive = [bool(a) for a in pipe.execute()]
    else:
        for at in range(0, len(beats), HEARTBEATS_PER_MGET):
            pipe.mget(beats[at:at + HEARTBEATS_PER_MGET])
        alive = [value is not None for values in pipe.execute() for value in values]
    return Registry({i.worker: (i, a) for i, a in zip(infos, alive, strict=True)}, tuple(unreadable))


def registered_and_beating(r: redis.Redis, worker_ids: Sequence[str]) -> list[bool]:
    """For each id, whether it has both a registry entry and a heartbeat (one round trip)."""
    pipe = r.pipeline(transaction=False)
    for wid in worker_ids:
        pipe.hexists(keys.WORKERS, wid)
        pipe.exists(keys.heartbeat(wid))
    answers = pipe.execute()
    return [bool(answers[2 * i] and answers[2 * i + 1]) for i in range(len(worker_ids))]


def rq_registered(r: redis.Redis, names: Sequence[str]) -> list[bool]:
    """For each name, whether RQ's worker registry has that RQ worker (one round trip)."""
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.sismember(keys.RQ_WORKERS, keys.rq_worker(name))
    return [bool(x) for x in pipe.execute()]


def heartbeat_alive(r: redis.Redis, worker_id: str) -> bool:
    """Whether the worker's heartbeat key still exists."""
    return bool(r.exists(keys.heartbeat(worker_id)))


def forget_workers(r: redis.Redis, worker_ids: Sequence[str]) -> None:
    """Remove what dead workers could not: registry entries, heartbeats, control and cancels streams.

    One round trip, one ``DEL`` per key: the workers' keys are in as many slots as there are
    workers, and redis-py's cluster pipeline routes each single-key command to its node (it
    refuses a multi-key ``DEL`` even within one slot)."""
    pipe = r.pipeline(transaction=False)
    pipe.hdel(keys.WORKERS, *worker_ids)
    for w in worker_ids:
        pipe.delete(keys.heartbeat(w))
        pipe.delete(keys.control(w))
        pipe.delete(keys.cancels(w))
    pipe.execute()


@dataclass(frozen=True)
class RqEntry:
    """An RQ worker as RQ's worker registry has it: enough to adopt its process."""

    name: str
    hostname: str
    pid: int
    birth: float  # when it registered (epoch seconds)


def rq_entries(r: redis.Redis) -> list[RqEntry]:
    """Every RQ worker in RQ's registry whose hash has a host, a pid and a birth (two round
    trips); a member whose hash is gone or incomplete (dying, or not RQ's) is skipped."""
    names = sorted(n for n in (keys.rq_worker_name(as_str(m)) for m in r.smembers(keys.RQ_WORKERS)) if n)
    if not names:
        return []
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hmget(keys.rq_worker(name), ["hostname", "pid", "birth"])
    out = []
    for name, (host, pid, birth) in zip(names, pipe.execute(), strict=True):
        try:
            born = datetime.strptime(as_str(birth), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
            out.append(RqEntry(name, as_str(host), int(pid), born.timestamp()))
        except (TypeError, ValueError):
            continue  # an incomplete hash: the worker is registering or going away
    return out
