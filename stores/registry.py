"""The worker registry (``fleet:workers``) read with liveness: one HGETALL, then the heartbeats.

A registered worker whose heartbeat key has expired is dead: it is returned with
``alive=False`` (callers decide whether to show it or ignore it). An entry that does not
decode, or whose ids are not valid, is skipped, named in ``unreadable`` and told to a
``stores.bad_state.BadState``. A reader that reads it again and again (the commander, every
pass) keeps it (:class:`Known`) and reads it whole only when its version changed; the
heartbeats are read every time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import cast

import redis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import CodecError, as_str, decode
from protocol.groups import validate_pool
from protocol.ids import InvalidId, validate_token
from protocol.models import WorkerInfo
from stores.bad_state import DEFAULT, LOG, BadState, reject_wrong_type
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


FULL_READ_EVERY_S = 10.0  # a reader that keeps the entries reads them all at least this often


class Known:
    """What a reader keeps of its last registry read (a commander reads 10,000 entries a pass):
    each entry decoded, by field, with its exact bytes, and the registry's version then
    (``keys.WORKERS_VERSION``). While the version stands, a read is one ``GET`` of it instead
    of the whole hash; the hash is read whole again when it changed, when it has none or one
    that is no counter (writers that do not bump it), and every ``FULL_READ_EVERY_S`` (an entry
    written without a bump: a raw ``HSET``, a forged entry); an entry unchanged since is not
    decoded again."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self.entries: dict[bytes, tuple[bytes, WorkerInfo]] = {}  # field -> (its bytes, decoded)
        self.infos: list[WorkerInfo] = []
        self.failed: list[tuple[str, Exception]] = []  # the entries that did not decode, and why
        self.version: bytes | None = None
        self.beats: list[str] = []  # each info's heartbeat key
        self._monotonic, self._read_at = monotonic, -math.inf
        self._last: tuple[list[bool], Registry] | None = None  # the last registry, and its liveness

    def stands(self, r: redis.Redis) -> bool:
        """Whether the last read is still the registry (one round trip, unless it is due whole)."""
        if self.version is None or self._monotonic() - self._read_at >= FULL_READ_EVERY_S:
            return False
        try:
            return bool(r.get(keys.WORKERS_VERSION) == self.version)
        except ResponseError:  # (another type: the whole read says so)
            return False

    @property
    def unreadable(self) -> list[str]:
        """The ids of the entries that did not decode."""
        return [wid for wid, _ in self.failed]

    def keep(self, entries: dict[bytes, tuple[bytes, WorkerInfo]], failed: list[tuple[str, Exception]],
             version: bytes | None) -> None:
        """A whole read's entries (those that decoded), those that did not and why, and version.
        Entries the same as the last read's (each the same bytes and decoded object) keep the
        last registry: what a reader derived from it stands."""
        self._read_at, self.version = self._monotonic(), version
        same = entries == self.entries and [w for w, _ in failed] == self.unreadable
        self.entries, self.failed = entries, failed
        if same:
            return
        self.infos = [info for _, info in entries.values()]
        self.beats = [keys.heartbeat(info.worker) for info in self.infos]
        self._last = None

    def registry(self, alive: list[bool]) -> Registry:
        """The registry of the entries kept, with ``alive`` (each one's heartbeat): the very
        one returned last time if neither changed (a pass at 10,000 workers need not build it
        again, and a reader may keep what it derived from it: compare by identity)."""
        if self._last is not None and self._last[0] == alive:
            return self._last[1]
        reg = Registry({i.worker: (i, a) for i, a in zip(self.infos, alive, strict=True)},
                       tuple(self.unreadable))
        self._last = alive, reg
        return reg


def _version(reply: object, bad: BadState) -> bytes | None:
    """The registry's version as read (``GET``), or None if there is none or it is no counter
    (told to ``bad``): the registry is then read whole every time."""
    if isinstance(reply, ResponseError):
        bad.note("registry", keys.WORKERS_VERSION, "", reject_wrong_type(reply))
        return None
    if reply is not None and not cast("bytes", reply).isdigit():
        bad.note("registry", keys.WORKERS_VERSION, "", "not a counter: writers cannot bump it")
        return None
    return cast("bytes | None", reply)


def read_entries(r: redis.Redis, bad: BadState = DEFAULT,
                 known: Known | None = None) -> tuple[list[WorkerInfo], list[str]]:
    """Every registry entry that decodes and whose ids are valid, and the ids of those that are
    not (told to ``bad``, as is a registry of another type), in one HGETALL. ``known``: what
    this reader kept of its last read (:class:`Known`), read again only as it says (with the
    version, read first in the same round trip: an entry written after it is read again at the
    next change), and left holding this read's."""
    if known is not None and known.stands(r):
        for wid, exc in known.failed:  # met again: told again (and counted), as a read would
            bad.note("registry", keys.WORKERS, wid, exc)
        return known.infos, known.unreadable
    pipe = r.pipeline(transaction=False)
    if known is not None:
        pipe.get(keys.WORKERS_VERSION)
    pipe.hgetall(keys.WORKERS)
    *versions, reply = pipe.execute(raise_on_error=False)
    version = _version(versions[0], bad) if versions else None
    if isinstance(reply, ResponseError):
        bad.note("registry", keys.WORKERS, "", reject_wrong_type(reply))
        if known is not None:
            known.keep({}, [], None)
        return [], []
    infos: list[WorkerInfo] = []
    failed: list[tuple[str, Exception]] = []
    seen: dict[bytes, tuple[bytes, WorkerInfo]] = {}
    last = known.entries if known is not None else {}
    for name, blob in hash_reply(reply).items():
        hit = last.get(name)
        if hit is not None and hit[0] == blob:
            info = hit[1]
        else:
            wid = as_str(name, errors="replace")
            try:
                info = _entry(wid, blob)
            except (CodecError, InvalidId) as exc:
                bad.note("registry", keys.WORKERS, wid, exc)
                failed.append((wid, exc))
                continue
        infos.append(info)
        seen[name] = blob, info
    if known is not None:
        known.keep(seen, failed, version)
    return infos, [wid for wid, _ in failed]


def raise_unless_bumped(replies: list[object], log: logging.Logger) -> None:
    """The replies of a registry write whose last command bumps the version (``INCR``): the
    first error of the others is raised; a failed bump (a version that is no counter, or of
    another type: hostile state) is warned of and loses nothing, since readers that keep the
    registry read it whole at least every ``FULL_READ_EVERY_S``."""
    *written, bump = replies
    for reply in written:
        if isinstance(reply, Exception):
            raise reply
    if isinstance(bump, ResponseError):
        log.warning("the registry's version %s cannot be bumped (%s): readers that keep the "
                    "registry see this change within %.0f s", keys.WORKERS_VERSION, bump, FULL_READ_EVERY_S)
    elif isinstance(bump, Exception):
        raise bump


HEARTBEATS_PER_MGET = 1000  # heartbeats read by one MGET (one node)


def read_registry(r: redis.Redis, bad: BadState = DEFAULT, known: Known | None = None) -> Registry:
    """The registry with every worker's liveness, in two round trips (bad entries: ``bad``).
    On one node the heartbeats are read by an ``MGET`` per thousand workers (a heartbeat that
    is not a string, never a worker's, reads as none: dead); on a Cluster they are in as many
    slots as workers, one ``EXISTS`` each. ``known``: as :func:`read_entries` (the heartbeats
    are read every time)."""
    infos, unreadable = read_entries(r, bad, known)
    if not infos:
        return Registry(unreadable=tuple(unreadable))
    beats = known.beats if known is not None else [keys.heartbeat(info.worker) for info in infos]
    pipe = r.pipeline(transaction=False)
    if is_cluster(r):
        for key in beats:
            pipe.exists(key)
        alive = [bool(a) for a in pipe.execute()]
    else:
        for at in range(0, len(beats), HEARTBEATS_PER_MGET):
            pipe.mget(beats[at:at + HEARTBEATS_PER_MGET])
        alive = [value is not None for values in pipe.execute() for value in values]
    if known is not None:
        return known.registry(alive)
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
    pipe.incr(keys.WORKERS_VERSION)
    raise_unless_bumped(pipe.execute(raise_on_error=False), LOG)


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
