"""The worker side of a user's mailbox: lane lease, inbox reads, context pack, write-back.

Every call here is one round trip, and on one node the acquires and commits of a loop pass
share it (``stores.batch``). The Lua scripts do the parts that must be atomic: taking the lane
with the first turn and its context pack (``lane_acquire.lua``), and committing a turn
together with the cursor advance, then releasing the lane or handing back the next turn with
its context (``turn_commit.lua``): a visit of one turn is two script calls.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import as_str, decode_valid
from protocol.models import MemoryItem, ReplyStatus, SessionEntry
from stores import cluster, functions, replicas
from stores.batch import ScriptBatcher
from stores.memory import parse_members
from stores.replies import raw_rows
from stores.retry import TRANSIENT
from stores.roundtrips import arun

log = logging.getLogger("fleet.worker")


class Fenced(Exception):
    """The lane was lost (lease expired and taken over): stop serving this user."""


@dataclass(frozen=True)
class WrongType:
    """A key of the user's that holds another type than the scripts need: ``role`` is its part
    (``session``, ``reply``, ...; see ``include/key_types.lua``)."""

    role: str
    key: str
    found: str
    wanted: str

    def __str__(self) -> str:
        return f"{self.key} holds a {self.found}, not a {self.wanted}"


class UserDataError(Exception):
    """The user's data cannot be used: keys that hold the wrong type (nothing was written). The
    turn is answered with an error and dead-lettered; the user's later turns are served once the
    keys are repaired or deleted."""

    def __init__(self, user: str, wrong: tuple[WrongType, ...]) -> None:
        super().__init__("; ".join(str(w) for w in wrong))
        self.user, self.wrong = user, wrong

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(w.role for w in self.wrong)


@dataclass(frozen=True)
class StoreConfig:
    """Bounds of the per-user stores."""

    lane_ttl_ms: int = 6_000
    session_max: int = 200
    context_turns: int = 20
    memory_k: int = 5
    memory_max: int = 500
    done_keep: int = 1_000
    reply_ttl_ms: int = 3_600_000


@dataclass(frozen=True)
class NextTurn:
    """The first inbox entry after the cursor, as a script handed it back with the lane: its
    fields as stored and, when the script could read it (the entry names its turn id and is for
    this tier), its context pack, duplicate check and attempt count (``pulled``; None: the
    worker reads them itself with :meth:`UserStore.pull`). ``turn_id`` is the id they were
    read for."""

    entry: str
    fields: dict[bytes, bytes]
    pulled: Pulled | None = None
    turn_id: str = ""


@dataclass(frozen=True)
class Lease:
    """A lane we hold: ``owner`` is the ``<worker>|<token>`` string the scripts check; ``next``
    the turn to serve first."""

    user: str
    owner: str
    cursor: str
    next: NextTurn | None = None


@dataclass(frozen=True)
class Flush:
    """Streamed text of one attempt of ``turn_id`` on its way to the turn's reply stream,
    fenced by ``lease``; ``restart`` writes a 'restart' entry first."""

    lease: Lease
    turn_id: str
    attempt: int
    text: str
    restart: bool = False


@dataclass(frozen=True)
class Idle:
    """The lane was free (or ours) and nothing waited after the cursor: it was not taken (ours
    was given up), as if taken, found empty and released in one step."""


@dataclass(frozen=True)
class Committed:
    """What a commit did: ``result`` 'ok', 'dup', 'stale' or 'cancelled' (the turn was cancelled
    and these writes are not its cancelled answer: nothing written; see ``turn_commit.lua``); then the
    lane was ``released`` (nothing waited), or kept with the ``next`` turn to serve. (A key of
    the wrong type raises :class:`UserDataError` instead: nothing was written.)"""

    result: str
    released: bool
    next: NextTurn | None = None


@dataclass(frozen=True)
class Busy:
    """The lane is held by someone else."""

    holder: str
    ttl_ms: int


class ContextPack:
    """What a handler sees of the user: pulled at the start of the turn, forgotten after.

    The session's entries are decoded when a handler first reads ``session`` (a handler that
    never looks at them costs no decoding: the 20 entries of a pack were most of a worker's
    pydantic and msgpack time); ``session_size`` is how many the pack holds, as read."""

    def __init__(self, session: list[SessionEntry] | None = None, profile: dict[str, str] | None = None,
                 memories: list[MemoryItem] | None = None, *, session_raw: list[bytes] | None = None) -> None:
        self._session = session
        self._session_raw = session_raw or []
        self.profile = profile or {}
        self.memories = memories or []

    @property
    def session(self) -> list[SessionEntry]:
        """The session tail, oldest first (an entry that does not decode is skipped)."""
        if self._session is None:
            self._session = _parse_session(self._session_raw)
        return self._session

    @property
    def session_size(self) -> int:
        return len(self._session) if self._session is not None else len(self._session_raw)


@dataclass(frozen=True)
class Pulled:
    pack: ContextPack
    answered: bool  # the turn id was answered before (a duplicate submit)
    attempts: int  # including this one
    cancelled: bool = False  # its user cancelled it (turn_cancel.lua's record)


@dataclass(frozen=True)
class StreamTail:
    """What a streamed turn's commit writes to its reply stream with the reply: a ``restart``
    entry first if ``restart``, the ``text`` not flushed yet (a ``chunk`` of ``attempt``), and
    the ``end`` entry with the turn's status (``Writes.status``; ``include/stream_write.lua``)."""

    attempt: int
    text: str = ""
    restart: bool = False


@dataclass(frozen=True)
class Writes:
    """Everything one turn writes back, applied atomically with the cursor advance."""

    turn_id: str = ""
    session_entry: bytes = b""
    reply: bytes = b""
    profile: dict[str, str] = field(default_factory=dict)
    memories: list[tuple[bytes, float]] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    # the turn's deferred jobs as (job id, msgpack Deferral): one outbox entry each, written by
    # the commit (never by a 'dup' or 'stale' one); after an 'ok' commit the relay is told
    deferrals: list[tuple[str, bytes]] = field(default_factory=list)
    stream: StreamTail | None = None  # a streamed turn's last text and the end of its stream
    # how the turn ended (its reply's status, and its stream's end): a cancelled turn is committed
    # only as "cancelled"
    status: ReplyStatus = "ok"

    def without(self, roles: Collection[str]) -> Writes:
        """These writes less those to the keys of ``roles`` (as :class:`WrongType` names them):
        what a rejection can still write when some of the user's keys hold the wrong type."""
        return replace(self, turn_id="" if "done" in roles else self.turn_id,
                       session_entry=b"" if "session" in roles else self.session_entry,
                       reply=b"" if "reply" in roles else self.reply,
                       profile={} if "profile" in roles else self.profile,
                       memories=[] if "memory" in roles else self.memories,
                       usage={} if "usage" in roles else self.usage,
                       deferrals=[] if "outbox" in roles else self.deferrals,
                       stream=None if "stream" in roles else self.stream)


class UserStore:
    """Per-user operations for one worker, on one asyncio client."""

    def __init__(self, r: aioredis.Redis, worker: str, config: StoreConfig | None = None,
                 tier: str = "chat") -> None:
        self.r = r
        self.worker = worker
        self.tier = tier  # a turn of another tier gets no context pack from the scripts
        self.cfg = config or StoreConfig()
        self.scripts = functions.Functions(r)
        self.batcher = ScriptBatcher(r)  # acquires and commits of one loop pass: one round trip
        self.acks = replicas.ReplicaAcks.of("acquire", "commit")
        # WAIT after the lane acquire and the turn commit (the worker sets it from the tier's
        # policy, ``ReplicaWait.of``); None: no WAIT is sent, the commands of a store without it
        self.replica_wait: replicas.ReplicaWait | None = None
        # the user's keys expire this long after each commit (the tier's policy,
        # ``retention_ms``); 0: they are kept
        self.retention_ms = 0

    async def acquire(self, user: str) -> Lease | Busy | Idle:
        """Take the lane with the first turn after the cursor and its context pack, learn who
        holds it, or find nothing waiting (:class:`Idle`: the lane is left free).

        With ``replica_wait``, the new fencing token reached that many replicas before this
        returns, or the WAIT timed out: counted in ``acks``, logged, and the lane is served anyway
        (docs/guide/redis-cluster.md, "Failover and `replica_acks`", says why)."""
        k = keys.user_keys(user)
        res = await self._call(self.scripts.lane_acquire,
                               [k.lane, k.fence, k.state, k.inbox, k.session, k.profile, k.memory, k.done],
                               [self.worker, self.cfg.lane_ttl_ms, self.tier, self.cfg.context_turns,
                                self.cfg.memory_k], "acquire")
        code = int(res[0])
        if code == 1:
            return Lease(user, f"{self.worker}|{as_str(res[1])}", as_str(res[2]), _next_turn(res[3]))
        if code == 2:
            return Idle()
        return Busy(as_str(res[1]), int(res[2]))

    async def read_inbox(self, user: str, cursor: str, count: int) -> list[tuple[str, dict[bytes, bytes]]]:
        """Up to ``count`` inbox entries after ``cursor``, oldest first."""
        start = f"({cursor}" if cursor else "-"
        rows = raw_rows(await self.r.xrange(keys.inbox(user), min=start, max="+", count=count))
        return [(as_str(entry), fields) for entry, fields in rows]

    async def pull(self, user: str, turn_id: str, entry: str) -> Pulled:
        """The context pack, the duplicate check and the attempt count, in one round trip: for a
        retry, and for an entry the scripts could not read them for (:class:`NextTurn`).
        Raises :class:`UserDataError` if a key holds the wrong type."""
        k = keys.user_keys(user)
        nonce = uuid.uuid4().hex[:16]  # this retry's own: a re-sent pipeline does not count it again
        count = functions.command("attempt_count", [k.state, k.inbox], [entry, nonce, "count"])
        while True:
            pipe = self.r.pipeline(transaction=False)
            pipe.lrange(k.session, -self.cfg.context_turns, -1)
            pipe.hgetall(k.profile)
            pipe.zrevrange(k.memory, 0, self.cfg.memory_k - 1)
            pipe.zscore(k.done, turn_id)
            pipe.hexists(k.state, f"cancel:{entry}")
            pipe.execute_command(*count)
            replies = await pipe.execute(raise_on_error=False)
            if not functions.is_missing(replies[-1]):
                break
            await functions.wait_for_library_async(self.r)
        if any(isinstance(x, Exception) for x in replies):
            await self._raise_wrong_types(user, replies)
        session_raw, profile_raw, memories_raw, seen, cancelled, attempts = replies
        pack = ContextPack(
            session_raw=session_raw,
            profile={as_str(k): as_str(v) for k, v in profile_raw.items()},
            memories=parse_members(memories_raw),
        )
        return Pulled(pack, seen is not None, int(attempts), bool(cancelled))

    async def _raise_wrong_types(self, user: str, replies: list[Any]) -> None:
        """Raise what failed in :meth:`pull`'s replies: :class:`UserDataError` naming the keys
        of the wrong type (their types read in one more round trip), else the first error."""
        k = keys.user_keys(user)
        parts = (("session", k.session, "list"), ("profile", k.profile, "hash"),
                 ("memory", k.memory, "zset"), ("done", k.done, "zset"), ("state", k.state, "hash"),
                 ("state", k.state, "hash"))
        failed = [part for part, res in zip(parts, replies, strict=True)
                  if isinstance(res, ResponseError) and str(res).startswith("WRONGTYPE")]
        if not failed:
            raise next(x for x in replies if isinstance(x, Exception))
        pipe = self.r.pipeline(transaction=False)
        for _role, key, _wanted in failed:
            pipe.type(key)
        found = await pipe.execute()
        raise UserDataError(user, tuple(WrongType(role, key, as_str(t), wanted)
                                        for (role, key, wanted), t in zip(failed, found, strict=True)))

    async def uncount(self, user: str, entry: str, lease: Lease) -> None:
        """Take back the attempt ``lease``'s acquire counted for a turn handed over unserved (a
        user moving group): a hand-over is no attempt, however often a rollout's transition
        bounces it (taken back once, however often the call is sent)."""
        token = lease.owner.rpartition("|")[2]
        k = keys.user_keys(user)
        await self.scripts.attempt_count(keys=[k.state, k.inbox], args=[entry, token, "uncount"])

    async def commit(self, lease: Lease, entry: str, reply_key_turn: str, w: Writes,
                     now_ms: int) -> Committed:
        """Write the turn back and advance the cursor, then release the lane if nothing waits
        (else keep it and hand back the next turn): one script, one round trip.

        With ``replica_wait``, the commit (cursor, reply, done-set) reached that many replicas
        before this returns, or the WAIT timed out: the turn is committed on the master all the
        same (counted in ``acks`` and logged, never an error)."""
        k = keys.user_keys(lease.user)
        keys_ = [k.lane, k.state, k.inbox, k.session, k.done, k.reply(reply_key_turn), k.usage,
                 k.profile, k.memory, k.outbox, k.fence, keys.pins(lease.user)]
        cfg = self.cfg
        usage = {counter: int(n) for counter, n in w.usage.items() if n}  # a zero adds nothing
        args: list[Any] = [lease.owner, entry, w.turn_id, w.session_entry, cfg.session_max, w.reply,
                           cfg.reply_ttl_ms, cfg.done_keep, now_ms, cfg.memory_max, self.tier,
                           cfg.context_turns, cfg.memory_k, len(w.profile), len(w.memories), len(usage),
                           len(w.deferrals)]
        for field_, value in w.profile.items():
            args += [field_, value]
        for member, score in w.memories:
            args += [member, repr(float(score))]
        for counter, n in usage.items():
            args += [counter, n]
        for job, payload in w.deferrals:
            args += [job, payload]
        args += [self.retention_ms, w.status]
        if w.stream is not None:  # a streamed turn: its tail and the end, written with the reply
            keys_.append(k.stream(reply_key_turn))
            tail = w.stream
            args += [tail.attempt, "1" if tail.restart else "0", tail.text]
        try:
            res = await self._call(self.scripts.turn_commit, keys_, args, "commit")
        except ResponseError as exc:
            if str(exc).startswith("FENCED"):
                raise Fenced(lease.user) from None
            raise
        if as_str(res[0]) == "wrongtype":
            flat = [as_str(x) for x in res[3]]
            raise UserDataError(lease.user, tuple(WrongType(*flat[i:i + 4]) for i in range(0, len(flat), 4)))
        committed = Committed(as_str(res[0]), int(res[1]) == 1, _next_turn(res[2]))
        if w.deferrals and committed.result == "ok":  # only a turn that deferred pays this
            await self.notify_relay(lease.user)
        return committed

    async def append_streams(self, flushes: list[Flush]) -> list[str | Exception]:
        """Write ``flushes`` (``stream_append.lua``), each fenced by its lease: per flush 'ok', or
        what kept it from being written ('fenced', 'done', 'wrongtype'), or the error that left
        its outcome unknown. On one node they are one script call, riding the loop pass's round
        trip with the other jobs' calls (``stores.batch``); on a Cluster one call each (their
        users are in other slots)."""
        calls = []
        for f in flushes:
            # the flush's id: a call re-sent whole (redis-py re-sends a pipeline after a dropped
            # connection) finds its chunk written already, and writes nothing twice
            calls.append(([keys.lane(f.lease.user), keys.stream(f.lease.user, f.turn_id)],
                          [f.lease.owner, f.attempt, "1" if f.restart else "0", f.text, self.cfg.reply_ttl_ms,
                           uuid.uuid4().hex[:16]]))
        if cluster.is_cluster(self.r):  # (a preview: no WAIT for replicas, whatever the tier asks)
            out: list[str | Exception] = []
            for k, a in calls:
                try:
                    out.append(as_str((await self.scripts.stream_append(keys=k, args=a))[0]))
                except TRANSIENT as exc:
                    out.append(exc)
            return out
        try:
            got = await self.batcher.call(self.scripts.stream_append, [k for c in calls for k in c[0]],
                                          [a for c in calls for a in c[1]])
        except TRANSIENT as exc:
            return [exc] * len(flushes)
        return [as_str(g) for g in got]

    async def notify_relay(self, user: str) -> None:
        """Tell the relay that ``user``'s outbox holds entries (after the commit that wrote them:
        a notification ahead of its entries could find the outbox empty and be acked). The
        entries are committed either way: a notification lost to a crash or a failed ``XADD``
        (logged here, not raised: the turn is done) leaves them to the relay's sweep of the
        active users (``worker.rq.relay.Relay.sweep``), seconds later."""
        try:
            await self.r.xadd(keys.OUTBOX_READY, {"user": user})
        except TRANSIENT as exc:
            log.warning("the relay's notification for %s was not written (%s: %s): its sweep will "
                        "find the outbox", user, type(exc).__name__, exc)

    async def _call(self, script: functions.Function, keys_: list[str], args: list[Any], op: str) -> Any:
        """A hot-path call: without ``replica_wait``, queued with the other calls of this loop
        pass (``stores.batch``: one round trip for all, per master on a Cluster); else on its own."""
        if self.replica_wait is None:
            return await self.batcher.call(script, keys_, args)
        return await self._run(script, keys_, args, op)

    async def _run(self, script: functions.Function, keys_: list[str], args: list[Any], op: str) -> Any:
        """Run a call; with ``replica_wait``, then ``WAIT`` on the same connection (WAIT counts
        the writes of the connection it is sent on: sent apart, it could go on another of the pool's)."""
        wait = self.replica_wait
        if wait is None:
            return await script(keys=keys_, args=args)  # no WAIT: the call alone
        while True:
            cmd = functions.command(script.op, keys_, args)
            if cluster.is_cluster(self.r):
                # FCALL + WAIT down one connection of the master serving the user's slot (a
                # MOVED there patches the slot table, and is raised below: the caller retries
                # it like any transient error)
                replies, waited = await arun(self.r, replicas.on_node([(keys_[0], cmd)], wait))
                res, acked = replies[0], waited[0]
            else:  # one node: a non-transactional pipeline (one connection) of FCALL + WAIT
                async with self.r.pipeline(transaction=False) as pipe:
                    pipe.execute_command(*cmd)
                    pipe.wait(wait.replicas, wait.timeout_ms)
                    res, acked = await pipe.execute(raise_on_error=False)
            if not functions.is_missing(res):  # else nothing ran: sent again once the library is back
                break
            await functions.wait_for_library_async(self.r)
        self.acks.count(op, wait, acked, asyncio.get_running_loop().time())  # virtual in the simulator
        if isinstance(res, Exception):
            raise res
        return res

    async def drop(self, lease: Lease) -> bool:
        """Give the lane up whatever waits in the inbox (the caller re-notifies)."""
        return bool(await self.scripts.lease_drop(keys=[keys.lane(lease.user)], args=[lease.owner]))

    async def renew(self, leases: list[Lease]) -> list[bool]:
        """Extend several leases in one round trip (on a Cluster, one per master, sent
        concurrently); False where the lane was lost."""
        if not leases:
            return []

        async def pipeline(indexes: list[int]) -> list[Any]:
            async with self.r.pipeline(transaction=False) as pipe:  # gives its connection back on error
                for i in indexes:
                    self.scripts.lease_renew(keys=[keys.lane(leases[i].user)],
                                             args=[leases[i].owner, self.cfg.lane_ttl_ms], client=pipe)
                return list(await pipe.execute(raise_on_error=False))

        replies = await functions.resend_missing(await pipeline(list(range(len(leases)))), self.r, pipeline)
        for res in replies:
            if isinstance(res, Exception):
                raise res
        return [bool(x) for x in replies]


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields as Lua returns them (a flat list) -> dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _parse_session(raw: list[bytes]) -> list[SessionEntry]:
    return decode_valid(SessionEntry, raw)


def _next_turn(raw: Any) -> NextTurn | None:
    """A script's ``next`` (include/next_turn.lua): None when nothing waits."""
    if not raw:
        return None
    entry, flat, context = raw
    if not context:
        return NextTurn(as_str(entry), _pairs(flat))
    session_raw, profile_flat, memories_raw, answered, attempts, turn_id, cancelled = context
    pack = ContextPack(session_raw=session_raw,
                       profile={as_str(k): as_str(v) for k, v in zip(profile_flat[::2], profile_flat[1::2],
                                                                      strict=True)},
                       memories=parse_members(memories_raw))
    return NextTurn(as_str(entry), _pairs(flat),
                    Pulled(pack, int(answered) == 1, int(attempts), int(cancelled) == 1), as_str(turn_id))
