"""One user's lane on one worker: take it, serve every turn after the cursor, let it go.

The ack rule (DESIGN §3): a notification is acked only when its acker has seen, under the
user's lane, nothing left after the cursor, or when another pending notification for the
user still carries that duty (the lane holder's own). Reclaimed notifications may be a dead
holder's own, so they are never acked on a busy lane: they stay pending and come back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

from protocol.codec import CodecError, encode
from protocol.models import HandlerResult, Reply, SessionEntry, Turn
from protocol.policy import TurnsPolicy
from stores.memory import new_member
from stores.retry import TRANSIENT, Backoff
from stores.turns import Busy, Fenced, Lease, NextTurn, Pulled, UserStore, Writes
from worker import handlers
from worker.intake import Fields, decode_entry, reply_route
from worker.lanetimer import LaneTimer
from worker.settings import WorkerSettings
from worker.tally import Result, TurnTally

log = logging.getLogger("fleet.worker")
_RETRY_BACKOFF = Backoff(base=0.2, cap=5.0)  # between a failed handler call and its retry
Deferred = list[tuple[str, bytes]]  # a turn's deferrals: (job id, msgpack Deferral)


class JobHost(Protocol):
    """What a job needs from the worker that runs it (``worker.app.Worker`` is one)."""

    worker_id: str
    tier: str
    pool: str  # the tier, or the pool of the group this worker serves
    draining: bool
    settings: WorkerSettings  # max_turn_bytes, max_reply_bytes, handler_timeout_s
    policy: TurnsPolicy  # max_attempts, handler_options
    handler: handlers.Handler
    store: UserStore
    tally: TurnTally  # its turn counts since it started

    @property
    def executor(self) -> Executor: ...  # the threads of sync handlers

    async def ack(self, nids: list[str]) -> None: ...
    async def ack_covered(self, holder: str, user: str, nids: list[str]) -> None: ...
    async def notify(self, user: str, pool: str) -> None: ...
    async def pool_of(self, user: str, tier: str) -> str: ...
    async def tier_defined(self, tier: str) -> bool: ...
    async def dead_letter(self, user: str, entry: str, turn_id: str, reason: str,
                          fields: Fields) -> None: ...
    def job_done(self, job: UserJob) -> None: ...
    def counters_add(self, turns: int = 0, errors: int = 0, handler_seconds: float = 0.0) -> None: ...
    def trace_handler(self, event: str, ctx: handlers.TurnContext) -> None: ...
    def protect(self, seconds: float) -> float: ...


@dataclass(frozen=True)
class Done:
    """A turn committed: the lane ``released`` (covering ``covered`` notification ids), or kept
    with the ``next`` turn to serve."""

    released: bool
    next: NextTurn | None
    covered: int


class OtherTier(Exception):
    """The user's next turn is for another pool (another tier, or another group of this one):
    hand the lane to its workers."""

    def __init__(self, pool: str, uncount: str | None = None) -> None:
        super().__init__(pool)
        self.pool, self.uncount = pool, uncount  # the entry whose counted attempt a hand-over takes back


class UserJob(LaneTimer):
    """Serves one user's inbox under its lane; created per user, gone when the lane is."""

    def __init__(self, worker: JobHost, user: str) -> None:
        self.w = worker
        self.user = user
        self.fresh: list[str] = []  # notification ids read as new deliveries
        self.reclaimed: list[str] = []  # notification ids taken over from idle consumers
        self.lease: Lease | None = None
        self.handed: list[str] = []  # notification ids a hand-over acks
        self.busy_since: float | None = None  # in a handler right now
        self.turn_handler_s = 0.0  # the handler's time on the turn being served (its usage)
        self.task: asyncio.Task[None] | None = None
        self.renewed = 0.0  # when the lease was last taken or renewed (monotonic, as the request went out)
        self._lost = False  # lane_lost() cancelled the task: take the lane again
        self.committing = False  # a commit is in flight (see renew_failed)
        self._expiry: asyncio.TimerHandle | None = None  # lane_lost() one lane TTL after ``renewed``

    def lane_ttl_s(self) -> float:
        return self.w.settings.lane_ttl_ms / 1000

    def attach(self, nid: str, reclaimed: bool) -> None:
        """Give this job the duty of a notification for its user."""
        (self.reclaimed if reclaimed else self.fresh).append(nid)

    @property
    def nids(self) -> list[str]:
        return self.fresh + self.reclaimed

    async def run(self) -> None:
        """Serve the user; every failure is logged and left for a retry, never raised.

        A lane lost midway (the commit was fenced, or a renewal found the lease gone and
        stopped the turn in progress) sends the job back to take the lane again: it gets it
        (nobody took over: the turn is re-run) or learns who holds it now.
        """
        self.task = asyncio.current_task()
        try:
            while not await self._serve_once():
                pass
        except asyncio.CancelledError:
            raise
        except TRANSIENT as exc:  # Redis away, or a Cluster failing over: no traceback to show
            log.warning("serving %s failed (%s: %s); its notification stays pending for a retry",
                        self.user, type(exc).__name__, exc)
        except Exception:
            log.exception("serving %s failed; its notification stays pending for a retry", self.user)
        finally:
            self.lease = None
            if self._expiry is not None:
                self._expiry.cancel()
            self.w.job_done(self)

    async def _serve_once(self) -> bool:
        """One go at the user; False if the lane was lost midway."""
        try:
            await self._run()
            return True
        except Fenced:
            self.w.tally.fenced += 1
            log.warning("lane of %s lost to another worker: its write was fenced", self.user)
        except asyncio.CancelledError:
            task = self.task
            if not self._lost or task is None or task.cancelling() != 1:
                raise  # the worker is stopping this job, not only the lost lane
            task.uncancel()
            self.w.tally.fenced += 1
            log.warning("lane of %s lost mid-turn: the turn in progress was stopped", self.user)
        self._lost = False
        self.lease = None
        return False

    async def _run(self) -> None:
        store = self.w.store
        covered: list[str] | int | None  # the notification ids a holder covers, then a count
        while True:
            asked = len(self.fresh)  # the notifications whose turns are in the inbox by now
            covered = len(self.nids)  # ...and all ours, should nothing wait (Idle)
            sent = time.monotonic()  # the lease's PX starts on the server after this
            got = await store.acquire(self.user)
            if isinstance(got, Busy):
                # The holder will see, before it lets go, every turn whose notification came
                # before we asked: those are covered. One attached while we asked may be for a
                # turn after the holder's last look, so ask again for it (issue 8, hole 1).
                # (and only while the holder has a notification of the user pending: that one
                # carries the duty if it dies; a takeover may have acked them all, see
                # notification_ack_covered.lua)
                covered, self.fresh = self.fresh[:asked], self.fresh[asked:]
                if not self.fresh:
                    self.w.job_done(self)  # before the await: a new notification starts a new job
                await self.w.ack_covered(got.holder, self.user, covered)
                if not self.fresh:
                    return
                continue
            if isinstance(got, Lease):
                self.lease, self.renewed = got, float("-inf")
                self.renewed_at(got, sent)
                covered = await self._serve_until_released(got)
                if covered is None:  # handed over (draining, or the next turn is another tier's)
                    await self.w.ack(self.handed)
                    return
            # released, or nothing waited (Idle: seen in the acquire's one atomic step)
            if len(self.nids) == covered:
                ids = self.nids
                self.w.job_done(self)  # before the await: a new notification starts a new job
                await self.w.ack(ids)
                return
            # a notification came in while we were releasing: its turn may be newer than what
            # the release saw, so take the lane again before acking it

    async def _serve_until_released(self, lease: Lease) -> int | None:
        """Serve turn after turn (each commit hands back the next, or releases the lane); return
        how many notification ids the release covers, or None if the user was handed over."""
        nxt = lease.next
        while nxt is not None:
            try:
                done = await self._serve_turn(lease, nxt)
            except OtherTier as other:
                await self._give_up(lease, other.pool, other.uncount)
                return None
            if done.released:
                self.lease = None
                return done.covered
            nxt = done.next
            if self.w.draining and nxt is not None:  # to the user's pool (this one, unless it was
                await self._give_up(lease, await self.w.pool_of(self.user, self.w.tier))  # removed)
                return None
        return await self._release_empty(lease)

    async def _release_empty(self, lease: Lease) -> int:
        """A lease with no turn in hand (only a script's odd reply leaves one): give it up and
        take the lane again, which releases it for good once nothing waits."""
        if not await self.w.store.drop(lease):
            raise Fenced(self.user)
        self.lease = None
        return -1  # no count of ids: the job takes the lane again, and acks once nothing waits

    async def _give_up(self, lease: Lease, pool: str, uncount: str | None = None) -> None:
        """Drop the lane with turns still queued and notify ``pool``, whose workers take over.

        The ids to ack are fixed, and the job forgotten, before the new notification exists:
        should it come back to this very worker, it must start a new job, not be acked here.
        """
        if uncount is not None:  # (under the lane: no other worker counts this entry meanwhile)
            await self.w.store.uncount(self.user, uncount)
        if not await self.w.store.drop(lease):
            raise Fenced(self.user)
        self.lease = None
        self.handed = self.nids
        self.w.job_done(self)
        await self.w.notify(self.user, pool)
        log.info("handed %s over to %s with turns still queued", self.user, pool)

    async def _serve_turn(self, lease: Lease, nxt: NextTurn) -> Done:
        self.turn_handler_s = 0.0  # every attempt of this turn here counts
        entry, fields = nxt.entry, nxt.fields
        try:
            turn = decode_entry(self.user, self.w.tier, entry, fields, self.w.settings.max_turn_bytes)
        except Exception as exc:  # CodecError, or a decoder bug: never wedge the user's lane
            if not isinstance(exc, CodecError):
                log.exception("turn %s of %s could not be decoded", entry, self.user)
            reason = str(exc) if isinstance(exc, CodecError) else f"{type(exc).__name__}: {str(exc)[:200]}"
            reply_to, fmt = reply_route(entry, fields)  # only for a rejected turn: it re-reads the payload
            return await self._reject(lease, entry, fields, reply_to, fmt, f"bad turn: {reason}", attempts=0)
        if turn.tier != self.w.tier:  # per-user order holds across tiers: that tier goes next
            if not await self.w.tier_defined(turn.tier):  # ...unless no worker will ever serve it
                return await self._reject(lease, entry, fields, turn.turn_id, turn.reply_fmt,
                                          f"tier {turn.tier!r} has no policy: no worker serves it",
                                          attempts=0, submitted=turn.ts)
            raise OtherTier(await self.w.pool_of(self.user, turn.tier))
        pool = await self.w.pool_of(self.user, turn.tier)  # a user moving group: the next turn is
        if pool != self.w.pool:  # the new group's (the attempt the acquire counted is taken back)
            raise OtherTier(pool, entry if nxt.pulled is not None else None)
        # the scripts' pack is for the entry's turn_id field: used if that is the decoded turn's
        pulled = nxt.pulled if nxt.pulled is not None and nxt.turn_id == turn.turn_id else None
        last_error = "the worker died during the turn"
        while True:
            if pulled is None:
                pulled = await self.w.store.pull(self.user, turn.turn_id, entry)
            if pulled.answered:
                log.info("turn %s of %s was answered before: skipped", turn.turn_id, self.user)
                return await self._commit(lease, entry, turn.turn_id, Writes(), "dup")
            if pulled.attempts > self.w.policy.max_attempts:
                reason = f"failed {pulled.attempts - 1} attempts; last: {last_error}"
                return await self._reject(lease, entry, fields, turn.turn_id, turn.reply_fmt, reason,
                                          attempts=pulled.attempts - 1, submitted=turn.ts)
            try:
                result, deferred = await self._call(lease, turn, pulled)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the handler's failure: retried, then dead-lettered
                last_error = f"{type(exc).__name__}: {exc}"[:500]
                self.w.counters_add(errors=1)
                log.warning("turn %s of %s, attempt %d: %s", turn.turn_id, self.user,
                            pulled.attempts, last_error)
                await asyncio.sleep(_RETRY_BACKOFF.compute(pulled.attempts))
                pulled = None
                continue
            return await self._answer(lease, entry, turn, pulled, result, deferred)

    async def _call(self, lease: Lease, turn: Turn, pulled: Pulled) -> tuple[HandlerResult, Deferred]:
        """Run the tier's handler on the turn: its result and what it deferred (this attempt's
        only: a failed attempt's deferrals go with it). Its exceptions are the caller's to count."""
        ctx = handlers.TurnContext(turn, pulled.pack, dict(self.w.policy.handler_options),
                                   self.w.worker_id, pulled.attempts, lease.owner, self.w.protect)
        tally = self.w.tally
        if pulled.attempts == 1:  # (a turn's first attempt is pulled once, whichever worker it is)
            tally.observe("queue_wait", time.time() - turn.ts)
        else:
            tally.retries += 1
        started = time.monotonic()
        self.busy_since = started
        self.w.trace_handler("enter", ctx)
        try:
            result = await handlers.call(self.w.handler, ctx, self.w.settings.handler_timeout_s,
                                         self.w.executor)
        finally:
            self.w.trace_handler("exit", ctx)
            self.busy_since = None
            took = time.monotonic() - started
            self.turn_handler_s += took
            self.w.counters_add(handler_seconds=took)
            tally.observe("handler", took)
        limit = self.w.settings.max_reply_bytes
        if len(result.text.encode()) > limit:
            raise handlers.HandlerError(f"reply text is over the limit of {limit} bytes")
        return result, ctx.deferred

    async def _answer(self, lease: Lease, entry: str, turn: Turn, pulled: Pulled,
                      result: HandlerResult, deferred: Deferred) -> Done:
        """Write the turn back with its reply, session entry, memories, profile and usage."""
        now = time.time()
        # built without validation: every value is validated already (the turn, the handler's
        # result, the ids) or made here
        reply = Reply.model_construct(turn_id=turn.turn_id, user=self.user, ok=True, text=result.text,
                                      worker=self.w.worker_id, ts=now, attempts=pulled.attempts,
                                      context={"session_turns": pulled.pack.session_size,
                                               "memories": [m.text for m in pulled.pack.memories],
                                               "profile": pulled.pack.profile})
        session_entry = SessionEntry.model_construct(turn_id=turn.turn_id, entry=entry, text=turn.text,
                                                     reply=result.text, ts=now)
        writes = Writes(
            turn_id=turn.turn_id, session_entry=encode(session_entry),
            reply=_encode_reply(reply, turn.reply_fmt), profile=result.profile,
            memories=[new_member(text, imp, now) for text, imp in result.memories],
            usage={"turns": 1, "chars_in": len(turn.text), "chars_out": len(result.text),
                   "handler_ms": round(self.turn_handler_s * 1000)},
            deferrals=deferred,
        )
        done = await self._commit(lease, entry, turn.turn_id, writes, "ok", turn.ts)
        self.w.counters_add(turns=1)
        return done

    async def _reject(self, lease: Lease, entry: str, fields: Fields, reply_to: str, fmt: str,
                      reason: str, attempts: int, submitted: float | None = None) -> Done:
        """Dead-letter a turn with its reason and tell the user; the lane moves on."""
        await self.w.dead_letter(self.user, entry, reply_to, reason, fields)
        reply = Reply(turn_id=reply_to, user=self.user, ok=False, error=reason,
                      worker=self.w.worker_id, ts=time.time(), attempts=attempts)
        writes = Writes(turn_id=reply_to, reply=_encode_reply(reply, fmt),
                        usage={"errors": 1, "handler_ms": round(self.turn_handler_s * 1000)})
        done = await self._commit(lease, entry, reply_to, writes, "error", submitted)
        self.w.counters_add(turns=1, errors=1)
        return done

    async def _commit(self, lease: Lease, entry: str, reply_to: str, writes: Writes, result: Result,
                      submitted: float | None = None) -> Done:
        """Commit the turn's writes (and release the lane if nothing waits) and count what the
        commit found (``result`` if it wrote them; with ``submitted``, the end-to-end latency too).
        The ids attached by now are the ones a release covers: one that comes during the call
        may be for a turn after what it saw."""
        covered = len(self.nids)
        self.committing = True
        try:
            committed = await self.w.store.commit(lease, entry, reply_to, writes, int(time.time() * 1000))
        finally:
            self.committing = False
        res = committed.result
        self.w.tally.served(result if res == "ok" else "dup" if res == "dup" else "stale")
        if res == "ok" and submitted is not None:
            self.w.tally.observe("latency", time.time() - submitted)
        if res == "dup":
            log.info("turn %s of %s (entry %s) was answered before: not answered again", reply_to,
                     self.user, entry)
        elif res != "ok":
            log.warning("turn %s of %s was already committed (%s)", entry, self.user, res)
        return Done(committed.released, committed.next, covered)


def _encode_reply(reply: Reply, fmt: str) -> bytes:
    return reply.model_dump_json().encode() if fmt == "json" else encode(reply)

