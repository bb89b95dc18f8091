"""One user's lane on one worker: take it, serve every turn after the cursor, let it go.

A job, top to bottom: ``run`` takes the lane (``_take_and_serve``); ``_serve_lane`` serves turn
after turn under it; ``_serve_turn`` decodes one (``_admit``), runs the handler
(``_call_handler``, retried with backoff) and commits the answer (``_commit``), which also
releases the lane once nothing waits. Its lease lasts one lane TTL from the request that took or
renewed it (``LaneDeadline``): unless renewed by then, the turn in progress is stopped.

The ack rule: a notification is acked only when its acker has seen, under the user's lane,
nothing left after the cursor, or when another pending notification for the user still carries
that duty (the lane holder's own). Reclaimed notifications may be a dead holder's own, so they
are never acked on a busy lane: they stay pending and come back.

Its one exception, the delivery limit: a notification delivered ``max_deliveries`` times (its
first delivery and each reclaim) whose job fails again, for anything but Redis being away, is
dead-lettered with that error and acked. A poison notification (a user whose keys cannot be
used) must not pin the ready stream; the user's turns left in the inbox are served at the
user's next submit.

A turn that cannot be served because of its user's data (a key of the wrong type) is answered
with an error and dead-lettered, like a turn that does not decode: the lane moves on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Protocol

from protocol.codec import CodecError, encode
from protocol.models import HandlerResult, Reply, SessionEntry, Turn
from protocol.policy import TurnsPolicy
from stores.deadletters import DeadKind
from stores.memory import new_member
from stores.redis_errors import RedisErrors, error_kind
from stores.retry import TRANSIENT, Backoff
from stores.turns import Busy, Fenced, Lease, NextTurn, Pulled, StreamTail, UserDataError, UserStore, Writes
from worker import handlers
from worker.intake import Fields, decode_entry, reply_route
from worker.settings import WorkerSettings
from worker.streams import StreamFlusher, StreamWriter
from worker.tally import Result, TurnTally

log = logging.getLogger("fleet.worker")
_RETRY_BACKOFF = Backoff(base=0.2, cap=5.0)  # between a failed handler call and its retry
Deferred = list[tuple[str, bytes]]  # a turn's deferrals: (job id, msgpack Deferral)
# what a rejection may leave unwritten when its key holds the wrong type (see Writes.without):
# the cursor (state) and the inbox it cannot do without
_REJECTION_SPARES = frozenset({"done", "reply", "usage", "stream"})


class JobHost(Protocol):
    """What a job needs from the worker that runs it (``worker.host.Host``)."""

    worker_id: str
    tier: str
    pool: str  # the tier, or the pool of the group this worker serves
    settings: WorkerSettings  # lane_ttl_ms, max_turn_bytes, max_reply_bytes, handler_timeout_s
    store: UserStore
    tally: TurnTally  # its turn counts since it started
    redis_errors: RedisErrors  # the worker's Redis errors: each kind logged once, all counted
    streams: StreamFlusher  # streamed turns' text, flushed to their reply streams

    @property
    def draining(self) -> bool: ...  # the worker hands its users on instead of serving more turns
    @property
    def policy(self) -> TurnsPolicy: ...  # max_attempts, handler_options
    @property
    def handler(self) -> handlers.Handler: ...
    @property
    def executor(self) -> Executor: ...  # the threads of sync handlers

    async def ack(self, nids: list[str]) -> None: ...
    async def ack_covered(self, holder: str, user: str, nids: list[str]) -> None: ...
    async def notify(self, user: str, pool: str) -> None: ...
    async def pool_of(self, user: str, tier: str) -> str: ...
    async def tier_defined(self, tier: str) -> bool: ...
    async def dead_letter(self, user: str, entry: str, turn_id: str, reason: str,
                          fields: Fields, kind: DeadKind) -> None: ...
    async def give_up(self, user: str, deliveries: dict[str, int], error: str) -> None: ...
    def job_done(self, job: UserJob) -> None: ...
    def trace_handler(self, event: str, ctx: handlers.TurnContext) -> None: ...
    def protect(self, seconds: float) -> float: ...


@dataclass(frozen=True)
class Done:
    """A turn committed: the lane ``released`` (covering ``covered`` notification ids), or kept
    with the ``next`` turn to serve."""

    released: bool
    next: NextTurn | None
    covered: int


class Unanswerable(Exception):
    """A turn not even its rejection can be committed for: a key the commit cannot do without
    (the user's state or inbox) holds the wrong type. Its notification stays pending, up to the
    delivery limit."""


class TurnCancelled(Exception):
    """The turn's handler was stopped by its user's cancel (or returned after it): ``emitted``
    is what it had streamed by then."""

    def __init__(self, emitted: list[str]) -> None:
        super().__init__("cancelled by its user")
        self.emitted = emitted


class OtherTier(Exception):
    """The user's next turn is for another pool (another tier, or another group of this one):
    hand the lane to its workers."""

    def __init__(self, pool: str, uncount: str | None = None) -> None:
        super().__init__(pool)
        self.pool, self.uncount = pool, uncount  # the entry whose counted attempt a hand-over takes back


class Lapsed(Exception):
    """The lane's deadline passed while a commit was in flight, and the commit kept the lane: it
    was ours when the commit landed, but may be gone since. The job takes it again."""


class LaneDeadline:
    """When a lease ends unless renewed: one lane TTL after the request that took or renewed it.

    A timer of its own calls ``expired`` then, not the renew loop, which Redis away, a renewal
    pass stuck in the client's retries or a paused process make late."""

    def __init__(self, ttl_s: float, expired: Callable[[Lease], None]) -> None:
        self.ttl_s = ttl_s
        self.renewed = float("-inf")  # when the lease was last taken or renewed (monotonic, as sent)
        self._expired = expired
        self._timer: asyncio.TimerHandle | None = None

    def restart(self, lease: Lease, sent: float) -> None:
        """A new ``lease``, taken by a request sent at ``sent``."""
        self.renewed = float("-inf")
        self.extend(lease, sent)

    def extend(self, lease: Lease, sent: float) -> None:
        """``lease`` was renewed by a request sent at ``sent`` (monotonic): it lasts one lane TTL
        from then at least."""
        if sent <= self.renewed:
            return  # (a renewal pass left behind may end after a newer one)
        self.renewed = sent
        self.cancel()
        left = sent + self.ttl_s - time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(max(0.0, left), self._fire, lease)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def passed(self) -> bool:
        """Whether the lease has gone a lane TTL without a renewal."""
        return time.monotonic() >= self.renewed + self.ttl_s

    def _fire(self, lease: Lease) -> None:
        self._timer = None
        self._expired(lease)


class UserJob:
    """Serves one user's inbox under its lane; created per user, gone when the lane is."""

    def __init__(self, host: JobHost, user: str) -> None:
        self.host = host
        self.user = user
        self.fresh: list[str] = []  # notification ids read as new deliveries
        self.reclaimed: list[str] = []  # notification ids taken over from idle consumers
        self.deliveries: dict[str, int] = {}  # notification id -> its deliveries (reclaims count)
        self.handed: list[str] = []  # notification ids a hand-over acks
        self.lease: Lease | None = None
        self.deadline = LaneDeadline(host.settings.lane_ttl_ms / 1000, self._expired)
        self.committing = False  # a commit is in flight (see renew_failed and _expired)
        self.busy_since: float | None = None  # in a handler right now
        self.turn_handler_s = 0.0  # the handler's time on the turn being served (its usage)
        self.task: asyncio.Task[None] | None = None
        self._lost = False  # lane_lost() cancelled the task: take the lane again
        # the handler call in progress: (inbox entry, its context, the task running it)
        self.running: tuple[str, handlers.TurnContext, asyncio.Future[HandlerResult]] | None = None
        self.cancels: set[str] = set()  # inbox entries whose cancel this worker was told of
        self.streamed: set[str] = set()  # inbox entries whose stream this job has written to

    def attach(self, nid: str, reclaimed: bool, deliveries: int = 1) -> None:
        """Give this job the duty of a notification for its user, delivered ``deliveries`` times
        by now (this one included)."""
        (self.reclaimed if reclaimed else self.fresh).append(nid)
        self.deliveries[nid] = deliveries

    @property
    def nids(self) -> list[str]:
        return self.fresh + self.reclaimed

    # --- the lane ------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the user until its lane is let go; every failure is logged and left for a
        retry (the notification stays pending), never raised; up to the delivery limit.

        A lane lost midway (the commit was fenced, or the lane's deadline or a renewal found it
        gone and stopped the turn in progress, or the deadline passed during a commit that kept
        it) sends the job back to take the lane again: it gets it (nobody took over: the turn
        not committed is re-run) or learns who holds it now.
        """
        self.task = asyncio.current_task()
        try:
            while not await self._take_and_serve():
                pass
            self.host.redis_errors.answered("serve")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure: the notification's retry, or its limit
            await self._failed(exc)
        finally:
            self.lease = None
            self.deadline.cancel()
            self.host.job_done(self)

    async def _failed(self, exc: Exception) -> None:
        """Serving failed: its notifications stay pending for a retry, but those at their last
        delivery (``max_deliveries``) are dead-lettered with the error and acked, unless Redis
        is away or refusing (an error that mends: they wait for it)."""
        if isinstance(exc, TRANSIENT):  # counted; each kind logged once until it clears
            self.host.redis_errors.failed("serve", exc)
        if isinstance(exc, TRANSIENT) and error_kind(exc) != "other":
            return  # Redis away, loading, refusing...: not the notification's fault
        limit = self.host.policy.max_deliveries
        last = {nid: n for nid, n in self.deliveries.items() if n >= limit and nid in self.nids}
        if last:
            await self.host.give_up(self.user, last, f"{type(exc).__name__}: {exc}"[:500])
            return
        delivered = max((self.deliveries.get(nid, 1) for nid in self.nids), default=1)
        log.warning("serving %s failed (%s: %s); its notification stays pending for a retry (delivered "
                    "%d of at most %d times)", self.user, type(exc).__name__, str(exc)[:300], delivered,
                    limit, exc_info=not isinstance(exc, (TRANSIENT, Unanswerable)))

    async def _take_and_serve(self) -> bool:
        """Take the lane and serve it until it is let go, then ack the notifications that
        covers; or leave them to the lane's holder. False if the lane was lost midway."""
        try:
            while True:
                asked = len(self.fresh)  # the notifications whose turns are in the inbox by now
                covered: int | None = len(self.nids)  # ...and all ours, should nothing wait (Idle)
                sent = time.monotonic()  # the lease's PX starts on the server after this
                got = await self.host.store.acquire(self.user)
                if isinstance(got, Busy):
                    if await self._leave_to_holder(got.holder, asked):
                        return True
                    continue
                if isinstance(got, Lease):
                    covered = await self._serve_lane(got, sent)
                    if covered is None:  # handed on (draining, or the next turn is another pool's)
                        await self.host.ack(self.handed)
                        return True
                # released, or nothing waited (Idle: seen in the acquire's one atomic step)
                if len(self.nids) == covered:
                    ids = self.nids
                    self.host.job_done(self)  # before the await: a new notification starts a new job
                    await self.host.ack(ids)
                    return True
                # a notification came in while we were releasing: its turn may be newer than what
                # the release saw, so take the lane again before acking it
        except Fenced:
            self.host.tally.fenced += 1
            log.warning("lane of %s lost to another worker: its write was fenced", self.user)
        except Lapsed:
            log.warning("lane of %s not renewed within its TTL during a commit that landed: taking it "
                        "again before the next turn", self.user)
        except asyncio.CancelledError:
            task = self.task
            if not self._lost or task is None or task.cancelling() != 1:
                raise  # the worker is stopping this job, not only the lost lane
            task.uncancel()
            self.host.tally.fenced += 1
            log.warning("lane of %s lost mid-turn: the turn in progress was stopped", self.user)
        self._lost = False
        self.lease = None
        return False

    async def _leave_to_holder(self, holder: str, asked: int) -> bool:
        """The lane is ``holder``'s ("<worker>|<token>"): ack the notifications that came before
        we asked, whose turns it will see before it lets go. True unless one came while we asked:
        its turn may be after the holder's last look, so the job asks again for it.

        They are acked only while the holder has a notification of the user pending, the one
        that carries the duty should it die (a takeover may have acked them all; see
        ``notification_ack_covered.lua``). Reclaimed ones stay pending."""
        covered, self.fresh = self.fresh[:asked], self.fresh[asked:]
        if not self.fresh:
            self.host.job_done(self)  # before the await: a new notification starts a new job
        await self.host.ack_covered(holder, self.user, covered)
        return not self.fresh

    async def _serve_lane(self, lease: Lease, sent: float) -> int | None:
        """Serve turn after turn under ``lease`` (each commit hands back the next, or releases
        the lane); the number of notification ids the release covers, or None if the user was
        handed on to another pool."""
        self.lease = lease
        self.deadline.restart(lease, sent)
        nxt = lease.next
        while nxt is not None:
            try:
                done = await self._serve_turn(lease, nxt)
            except OtherTier as other:
                await self._hand_on(lease, other.pool, other.uncount)
                return None
            if done.released:
                self.lease = None
                return done.covered
            nxt = done.next
            if self.host.draining and nxt is not None:  # to the user's pool (this one, unless
                await self._hand_on(lease, await self.host.pool_of(self.user, self.host.tier))  # removed)
                return None
        # a lease with no turn in hand (only a script's odd reply leaves one): give it up and take
        # the lane again, which releases it for good once nothing waits
        if not await self.host.store.drop(lease):
            raise Fenced(self.user)
        self.lease = None
        return -1  # no count of ids: the job takes the lane again, and acks once nothing waits

    async def _hand_on(self, lease: Lease, pool: str, uncount: str | None = None) -> None:
        """Drop the lane with turns still queued and notify ``pool``, whose workers take over.

        The ids to ack are fixed, and the job forgotten, before the new notification exists:
        should it come back to this very worker, it must start a new job, not be acked here.
        """
        if uncount is not None:  # (under the lane: no other worker counts this entry meanwhile)
            await self.host.store.uncount(self.user, uncount, lease)
        if not await self.host.store.drop(lease):
            raise Fenced(self.user)
        self.lease = None
        self.handed = self.nids
        self.host.job_done(self)
        await self.host.notify(self.user, pool)
        log.info("handed %s over to %s with turns still queued", self.user, pool)

    # --- a turn --------------------------------------------------------------------------
    async def _serve_turn(self, lease: Lease, nxt: NextTurn) -> Done:
        """Serve one turn: run the handler on it, retried with backoff up to ``max_attempts``,
        and commit its answer; or commit its rejection (dead-lettered), or raise ``OtherTier``."""
        self.turn_handler_s = 0.0  # every attempt of this turn here counts
        turn = await self._admit(lease, nxt)
        if isinstance(turn, Done):
            return turn
        try:
            return await self._attempts(lease, nxt, turn)
        except UserDataError as exc:
            return await self._reject(lease, nxt, turn.turn_id, turn.reply_fmt,
                                      f"the user's data cannot be used: {exc}", "user_data",
                                      attempts=0, submitted=turn.ts, unusable=exc.roles, stream=turn.stream)

    async def _attempts(self, lease: Lease, nxt: NextTurn, turn: Turn) -> Done:
        """Run the handler on ``turn`` up to ``max_attempts`` times and commit its answer (or its
        rejection); ``UserDataError`` raised if a key of the user's holds the wrong type."""
        entry = nxt.entry
        # the scripts' pack is for the entry's turn_id field: used if that is the decoded turn's
        pulled = nxt.pulled if nxt.pulled is not None and nxt.turn_id == turn.turn_id else None
        last_error = "the worker died during the turn"
        while True:
            if pulled is None:
                pulled = await self.host.store.pull(self.user, turn.turn_id, entry)
            if pulled.answered:
                log.info("turn %s of %s was answered before: skipped", turn.turn_id, self.user)
                return await self._commit(lease, entry, turn.turn_id, Writes(), "dup")
            if pulled.cancelled or entry in self.cancels:  # (a crashed attempt's retry too)
                return await self._cancelled(lease, entry, turn, pulled.attempts - 1, [])
            if turn.deadline is not None and time.time() >= turn.deadline:
                tried = pulled.attempts - 1  # the attempts before this one (the handler is not called)
                return await self._expire(lease, entry, turn, tried, last_error if tried else None)
            if pulled.attempts > self.host.policy.max_attempts:
                reason = f"failed {pulled.attempts - 1} attempts; last: {last_error}"
                return await self._reject(lease, nxt, turn.turn_id, turn.reply_fmt, reason, "attempts",
                                          attempts=pulled.attempts - 1, submitted=turn.ts, stream=turn.stream)
            writer = self._writer(lease, entry, turn, pulled.attempts)
            try:
                result, ctx = await self._call_handler(lease, entry, turn, pulled, writer)
            except TurnCancelled as stop:
                return await self._cancelled(lease, entry, turn, pulled.attempts, stop.emitted, writer)
            except asyncio.CancelledError:
                if writer is not None:  # (the lane was lost, or the worker stops: no more flushes)
                    writer.abandon()
                raise
            except Exception as exc:  # the handler's failure: retried, then dead-lettered
                if writer is not None:
                    await writer.close()
                last_error = f"{type(exc).__name__}: {exc}"[:500]
                self.host.tally.errors += 1
                log.warning("turn %s of %s, attempt %d: %s", turn.turn_id, self.user,
                            pulled.attempts, last_error)
                await asyncio.sleep(_backoff(pulled.attempts, turn.deadline))
                pulled = None
                continue
            writes = self._answer(entry, turn, pulled, result, ctx.deferred)
            # the text not flushed yet and the stream's end, with the reply (or with the cancelled
            # reply, should the commit find the turn cancelled meanwhile)
            tail = await writer.tail() if writer is not None else None
            cancelled = functools.partial(self._cancel_writes, entry, turn.turn_id, turn.reply_fmt, turn.text,
                                          pulled.attempts, ctx.emitted, tail)
            return await self._commit(lease, entry, turn.turn_id, replace(writes, stream=tail), "ok", turn.ts,
                                      cancelled)

    def _writer(self, lease: Lease, entry: str, turn: Turn, attempt: int) -> StreamWriter | None:
        """A streamed turn's writer for this run. Its first write is a restart when text of an
        earlier run may be in the stream: an earlier attempt's, or this attempt's own run that the
        lane's deadline stopped (the lane still ours, taken again under the same lease: the
        attempt is not counted again)."""
        if not turn.stream:
            return None
        rerun = attempt > 1 or entry in self.streamed
        self.streamed.add(entry)
        limit = self.host.settings.max_reply_bytes
        return self.host.streams.writer(lease, turn.turn_id, attempt, limit, rerun)

    async def _admit(self, lease: Lease, nxt: NextTurn) -> Turn | Done:
        """The turn of ``nxt`` if this pool serves it; the ``Done`` of its rejection if it cannot
        be served (it does not decode, or no policy defines its tier); ``OtherTier`` raised if it
        is another pool's (per-user order holds across tiers: that pool goes next)."""
        entry, fields = nxt.entry, nxt.fields
        try:
            turn = decode_entry(self.user, self.host.tier, entry, fields, self.host.settings.max_turn_bytes)
        except Exception as exc:  # CodecError, or a decoder bug: never wedge the user's lane
            if not isinstance(exc, CodecError):
                log.exception("turn %s of %s could not be decoded", entry, self.user)
            reason = str(exc) if isinstance(exc, CodecError) else f"{type(exc).__name__}: {str(exc)[:200]}"
            reply_to, fmt = reply_route(entry, fields)  # only for a rejected turn: it re-reads the payload
            return await self._reject(lease, nxt, reply_to, fmt, f"bad turn: {reason}", "bad_turn",
                                      attempts=0)
        if turn.tier != self.host.tier:
            if not await self.host.tier_defined(turn.tier):  # no worker will ever serve it
                return await self._reject(lease, nxt, turn.turn_id, turn.reply_fmt,
                                          f"tier {turn.tier!r} has no policy: no worker serves it",
                                          "no_policy", attempts=0, submitted=turn.ts, stream=turn.stream)
            raise OtherTier(await self.host.pool_of(self.user, turn.tier))
        pool = await self.host.pool_of(self.user, turn.tier)  # a user moving group: the next turn is
        if pool != self.host.pool:  # the new group's (the attempt the acquire counted is taken back)
            raise OtherTier(pool, entry if nxt.pulled is not None else None)
        return turn

    async def _call_handler(self, lease: Lease, entry: str, turn: Turn, pulled: Pulled,
                            writer: StreamWriter | None = None) -> tuple[HandlerResult, handlers.TurnContext]:
        """Run the tier's handler on the turn: its result and its context (what it deferred and
        emitted in this attempt only: a failed attempt's go with it); what it emits goes to
        ``writer`` too (a streamed turn's). Its exceptions are the caller's to count;
        ``TurnCancelled`` if its user cancelled it meanwhile (``cancel``)."""
        host = self.host
        ctx = handlers.TurnContext(turn, pulled.pack, dict(host.policy.handler_options),
                                   host.worker_id, pulled.attempts, lease.owner, host.protect,
                                   deadline=turn.deadline,
                                   emitter=writer.emit if writer is not None else None)
        if pulled.attempts == 1:  # (a turn's first attempt is pulled once, whichever worker it is)
            host.tally.observe("queue_wait", time.time() - turn.ts)
        else:
            host.tally.retries += 1
        started = time.monotonic()
        self.busy_since = started
        host.trace_handler("enter", ctx)
        call = asyncio.ensure_future(handlers.call(host.handler, ctx, host.settings.handler_timeout_s,
                                                   host.executor))
        self.running = (entry, ctx, call)
        try:
            result = await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if ctx.cancelled and call.cancelled() and task is not None and not task.cancelling():
                raise TurnCancelled(ctx.emitted) from None  # this handler's cancel, not the job's
            raise
        except Exception:
            if ctx.cancelled:  # (what a cancelled handler raises, its cleanup's error, is no failure)
                raise TurnCancelled(ctx.emitted) from None
            raise
        finally:
            self.running = None
            host.trace_handler("exit", ctx)
            self.busy_since = None
            took = time.monotonic() - started
            self.turn_handler_s += took
            host.tally.handler_seconds += took
            host.tally.observe("handler", took)
        if ctx.cancelled:  # (a sync handler that returned after the cancel: its result is dropped)
            raise TurnCancelled(ctx.emitted)
        limit = host.settings.max_reply_bytes
        if len(result.text.encode()) > limit:
            raise handlers.HandlerError(f"reply text is over the limit of {limit} bytes")
        return result, ctx

    def cancel(self, turn_id: str, entry: str) -> None:
        """The user cancelled turn ``turn_id`` (inbox entry ``entry``; the worker's control
        stream says so): a handler running it is stopped now (an async one's task cancelled:
        ``CancelledError`` inside it; a sync one sees ``ctx.cancelled`` and its result is
        dropped), and it is not started if not running yet. The turn is then committed as
        cancelled. (Without this word the commit finds the cancel's record all the same.)"""
        self.cancels.add(entry)
        running = self.running
        if running is None or running[0] != entry or running[1].turn.turn_id != turn_id:
            return
        _entry, ctx, call = running
        ctx.cancel_flag.set()
        handler = self.host.handler
        if inspect.iscoroutinefunction(handler) or inspect.isasyncgenfunction(handler):
            call.cancel()
        log.info("turn %s of %s cancelled by its user while its handler ran", turn_id, self.user)

    def _answer(self, entry: str, turn: Turn, pulled: Pulled, result: HandlerResult,
                deferred: Deferred) -> Writes:
        """The turn's write-back: its reply, session entry, memories, profile, usage, deferrals."""
        now = time.time()
        # built without validation: every value is validated already (the turn, the handler's
        # result, the ids) or made here
        reply = Reply.model_construct(turn_id=turn.turn_id, user=self.user, ok=True, text=result.text,
                                      worker=self.host.worker_id, ts=now, attempts=pulled.attempts,
                                      context={"session_turns": pulled.pack.session_size,
                                               "memories": [m.text for m in pulled.pack.memories],
                                               "profile": pulled.pack.profile})
        session_entry = SessionEntry.model_construct(turn_id=turn.turn_id, entry=entry, text=turn.text,
                                                     reply=result.text, ts=now)
        return Writes(
            turn_id=turn.turn_id, session_entry=encode(session_entry),
            reply=_encode_reply(reply, turn.reply_fmt), profile=result.profile,
            memories=[new_member(text, imp, now) for text, imp in result.memories],
            usage={"turns": 1, "chars_in": len(turn.text), "chars_out": len(result.text),
                   "handler_ms": round(self.turn_handler_s * 1000)},
            deferrals=deferred,
        )

    async def _expire(self, lease: Lease, entry: str, turn: Turn, attempts: int,
                      last_error: str | None) -> Done:
        """Answer a turn reached after its deadline ``expired``, without calling the handler (nobody
        waits for its reply); committed like a rejection but not dead-lettered: a normal end."""
        late = time.time() - (turn.deadline or 0.0)
        reason = f"the turn's deadline passed {late:.3f}s before a worker could serve it"
        if last_error is not None:
            reason = f"the turn's deadline passed after {attempts} failed attempts; last: {last_error}"
        log.info("turn %s of %s expired: %s", turn.turn_id, self.user, reason)
        reply = Reply(turn_id=turn.turn_id, user=self.user, ok=False, status="expired", error=reason,
                      worker=self.host.worker_id, ts=time.time(), attempts=attempts)
        writes = Writes(turn_id=turn.turn_id, reply=_encode_reply(reply, turn.reply_fmt),
                        usage={"expired": 1, "handler_ms": round(self.turn_handler_s * 1000)},
                        stream=_stream_end(turn.stream, attempts), status="expired")
        return await self._commit(lease, entry, turn.turn_id, writes, "expired", turn.ts,
                                  functools.partial(self._cancel_writes, entry, turn.turn_id, turn.reply_fmt,
                                                    turn.text, attempts, [], writes.stream))

    async def _cancelled(self, lease: Lease, entry: str, turn: Turn, attempts: int,
                         emitted: list[str], writer: StreamWriter | None = None) -> Done:
        """Answer a turn its user cancelled: ``cancelled``, with what its handler had emitted (and
        a streamed turn's stream ends: with the attempt's text not flushed yet, if it ran)."""
        self.cancels.discard(entry)
        tail = await writer.tail() if writer is not None else _stream_end(turn.stream, attempts)
        writes = self._cancel_writes(entry, turn.turn_id, turn.reply_fmt, turn.text, attempts, emitted, tail)
        return await self._commit(lease, entry, turn.turn_id, writes, "cancelled", turn.ts)

    def _cancel_writes(self, entry: str, turn_id: str, fmt: str, turn_text: str | None, attempts: int,
                       emitted: list[str], stream: StreamTail | None = None) -> Writes:
        """The write-back of a cancelled turn: a ``cancelled`` reply holding what was emitted
        (``emitted``, joined), and in the session, marked ``cut``, the turn with that partial
        reply: only if something was emitted. A turn stopped before it said anything is as if
        withdrawn: its text never reaches the model's context. No memories, profile or
        deferrals: a cancelled handler's result is dropped."""
        text, now = "".join(emitted), time.time()
        reply = Reply(turn_id=turn_id, user=self.user, ok=False, status="cancelled", text=text,
                      error="cancelled by its user", worker=self.host.worker_id, ts=now, attempts=attempts)
        said = turn_text is not None and text != ""
        session_entry = encode(SessionEntry(turn_id=turn_id, entry=entry, text=turn_text or "", reply=text,
                                            ts=now, cut=True)) if said else b""
        return Writes(turn_id=turn_id, session_entry=session_entry, reply=_encode_reply(reply, fmt),
                      usage={"cancelled": 1, "chars_out": len(text),
                             "handler_ms": round(self.turn_handler_s * 1000)},
                      status="cancelled", stream=stream)

    async def _reject(self, lease: Lease, nxt: NextTurn, reply_to: str, fmt: str, reason: str,
                      kind: DeadKind, attempts: int, submitted: float | None = None,
                      unusable: frozenset[str] = frozenset(), stream: bool = False) -> Done:
        """Dead-letter a turn with its reason and tell the user; the lane moves on. The keys of
        ``unusable`` (and any the commit finds of the wrong type) are left unwritten: a rejection
        needs only the cursor and the inbox (else ``Unanswerable``). A streamed turn's stream
        gets its end (after a 'restart' if attempts may have streamed text: it is no answer)."""
        await self.host.dead_letter(self.user, nxt.entry, reply_to, reason, nxt.fields, kind)
        reply = Reply(turn_id=reply_to, user=self.user, ok=False, error=reason,
                      worker=self.host.worker_id, ts=time.time(), attempts=attempts)
        writes = Writes(turn_id=reply_to, reply=_encode_reply(reply, fmt),
                        usage={"errors": 1, "handler_ms": round(self.turn_handler_s * 1000)},
                        stream=_stream_end(stream, attempts), status="error")

        def cancelled(spared: frozenset[str]) -> Writes:
            cut = self._cancel_writes(nxt.entry, reply_to, fmt, None, attempts, [], writes.stream)
            return cut.without(spared)

        while True:
            try:
                return await self._commit(lease, nxt.entry, reply_to, writes.without(unusable), "error",
                                          submitted, functools.partial(cancelled, unusable))
            except UserDataError as exc:
                if not exc.roles <= _REJECTION_SPARES or exc.roles <= unusable:
                    raise Unanswerable(f"turn {nxt.entry} of {self.user} cannot be answered: {exc}") from exc
                unusable |= exc.roles

    async def _commit(self, lease: Lease, entry: str, reply_to: str, writes: Writes, result: Result,
                      submitted: float | None = None, cancelled: Callable[[], Writes] | None = None) -> Done:
        """Commit the turn's writes (and release the lane if nothing waits) and count what the
        commit found (``result`` if it wrote them; with ``submitted``, the end-to-end latency too).
        A turn its user cancelled before the commit is committed with the writes ``cancelled``
        makes instead (the commit refuses any other: exactly one reply, never ``ok``), made only
        then: a rare path, and their reply costs as much as the turn's own to build.
        The ids attached by now are the ones a release covers: one that comes during the call
        may be for a turn after what it saw."""
        covered = len(self.nids)
        self.committing = True
        try:
            committed = await self.host.store.commit(lease, entry, reply_to, writes, int(time.time() * 1000))
        finally:
            self.committing = False
        res, tally = committed.result, self.host.tally
        if res == "cancelled" and writes.status != "cancelled":
            log.info("turn %s of %s was cancelled before its commit: answered cancelled", reply_to, self.user)
            self.cancels.discard(entry)
            return await self._commit(lease, entry, reply_to,
                                      cancelled() if cancelled is not None
                                      else Writes(turn_id=reply_to, status="cancelled"), "cancelled",
                                      submitted)
        tally.served(result if res == "ok" else "dup" if res == "dup" else "stale")
        if res == "ok" and submitted is not None:
            tally.observe("latency", time.time() - submitted)
        if res == "dup":
            log.info("turn %s of %s (entry %s) was answered before: not answered again", reply_to,
                     self.user, entry)
        elif res != "ok":
            log.warning("turn %s of %s was already committed (%s)", entry, self.user, res)
        if result != "dup":  # a turn served here (answered or rejected), whatever the commit found
            tally.turns += 1
            if result == "error":
                tally.errors += 1
        if not committed.released and self.deadline.passed():
            raise Lapsed(self.user)  # (see _expired)
        return Done(committed.released, committed.next, covered)

    # --- its lease, renewed by the worker (worker.renewal) ---------------------------------
    def renewed_at(self, lease: Lease, sent: float) -> None:
        """``lease`` was renewed by a request sent at ``sent`` (monotonic): its deadline moves."""
        if self.lease is lease:
            self.deadline.extend(lease, sent)

    def renew_failed(self) -> None:
        """A renewal found the lane gone. While a commit is in flight that is its own doing
        (the commit releases the lane when nothing waits, and its reply may wait on for a WAIT
        after it): the commit's answer decides. Released: nothing was lost. Kept: the next
        renewal pass judges the lane again, the commit was fenced if it had been lost before,
        and the lane's deadline still bounds the turn after it."""
        if self.committing:
            return
        log.warning("lane of %s expired under us: stopping the turn in progress", self.user)
        self.lane_lost()

    def _expired(self, lease: Lease) -> None:
        """The lease went a lane TTL without a renewal: stop the turn in progress. Unless a
        commit is in flight: cancelling its caller would not stop it (the batch's round trip
        goes on, and it may land), and the job, taking its own lane back with the same token
        before it did, would run the turn's handler again. The commit's answer decides:
        fenced, the lane was lost; released, nothing was; kept, ``Lapsed`` takes it again."""
        if self.lease is lease and not self.committing:
            log.warning("lane of %s not renewed within its TTL: stopping the turn in progress", self.user)
            self.lane_lost()

    def lane_lost(self) -> None:
        """Stop the turn in progress, whose write would be fenced anyway, so no handler runs on
        beside the new owner's; the job then takes the lane again."""
        if self.task is not None and not self.task.done() and not self._lost:
            self._lost = True
            self.task.cancel()


def _backoff(attempt: int, deadline: float | None) -> float:
    """Seconds to wait before the retry of a failed ``attempt``: the backoff, cut at the turn's
    ``deadline`` (the retry then finds it passed and answers ``expired``)."""
    wait = _RETRY_BACKOFF.compute(attempt)
    return wait if deadline is None else max(0.0, min(wait, deadline - time.time()))


def _stream_end(streamed: bool, attempts: int) -> StreamTail | None:
    """A streamed turn answered with no attempt streaming now: its stream's end alone, after a
    'restart' (any text a run may have streamed is not the answer)."""
    return StreamTail(attempts, restart=True) if streamed else None


def _encode_reply(reply: Reply, fmt: str) -> bytes:
    return reply.model_dump_json().encode() if fmt == "json" else encode(reply)
