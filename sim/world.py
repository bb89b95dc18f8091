"""One simulated fleet: real ``Worker``s and real client submits on the simulated store.

A ``World`` is built from a ``Workload`` and the seeded network; it starts the workers
(each a node of the loop), runs one client per user that submits its turns (drawn from the
seed, or as a ``Planned`` list says; resubmitting a failed submit with the same turn id, as a
careful client does), replaces killed workers after a short delay (as the commander would),
applies faults (``inject``), and records what the checker needs: when each turn was
accepted, every handler entry and exit with the lease it ran under, every fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from redis.exceptions import RedisError

from fleet.client import AsyncFleet, _build_turn
from protocol import keys
from protocol.codec import as_str
from protocol.models import HandlerResult
from protocol.policy import Scaling, TurnsPolicy
from sim.clock import EPOCH
from sim.loop import NODE, SimLoop
from sim.store import Network, Wire
from stores.policies import write_policy
from stores.takeover import sweep, take_over
from worker import handlers
from worker.app import Worker
from worker.settings import WorkerSettings

TIER = "chat"
GHOST = "ghost"  # a tier no policy defines and no worker serves

# Short leases, as the chaos run uses: a takeover costs seconds of virtual time.
WORKER_TIMING = {"lane_ttl_ms": 2000, "renew_interval_s": 0.5, "reclaim_idle_ms": 2000,
                 "reclaim_interval_s": 0.5, "heartbeat_ttl_ms": 2000, "block_ms": 1000,
                 "housekeeping_interval_s": 2.0, "policy_refresh_s": 2.0, "batch": 8}
RESPAWN_S = 0.5  # a killed worker's replacement starts this much later
SEES_EXIT_S = 0.2  # the commander notices a worker process exit this much later
SAMPLE_S = 0.25  # how often the world samples who waits
SWEEP_S = 5.0  # CommanderSettings.sweep_interval_s: consumers without a heartbeat are taken over
PASS_S = 0.5  # CommanderSettings.interval_s: a takeover that failed is tried again next pass


@dataclass(frozen=True)
class Workload:
    """The size of one simulated fleet."""

    workers: int = 2
    users: int = 3
    turns: int = 3
    concurrency: int = 2
    ghosts: bool = True  # some users also submit a turn for a tier that runs nowhere
    ready_shards: int = 1  # the tier's ready shards (Policy.ready_shards) at the start
    reshard_at_s: float | None = None  # at this virtual time the policy's count changes
    reshard_to: int = 1  # ... to this many
    streamed: bool = False  # the turns are submitted as streamed (never drawn: a seed's schedule stays)
    # the share of a drawn client's turns it stops: half of them cancelled at a drawn moment
    # after they were accepted, half given a drawn deadline (0: none, and nothing drawn for it)
    stop: float = 0.0

    @classmethod
    def draw(cls, rng: random.Random) -> Workload:
        """A small random fleet: small enough to explore fast, big enough to contend. (The
        shard draws come last: a seed's earlier fields are what they were before shards.)"""
        drawn = cls(workers=rng.randint(1, 3), users=rng.randint(1, 8), turns=rng.randint(1, 6),
                    concurrency=rng.randint(1, 4), ghosts=rng.random() < 0.3)
        shards = rng.choice((1, 1, 2, 3))
        reshard = rng.random() < 0.3
        return replace(drawn, ready_shards=shards, reshard_at_s=rng.uniform(0.5, 6.0) if reshard else None,
                       reshard_to=rng.choice([n for n in (1, 2, 3) if n != shards]))


@dataclass(frozen=True)
class Planned:
    """A turn a planned client submits: its user, when (virtual seconds from the start), the
    handler time it asks for, and its tier (``GHOST``: written raw, as any Redis client can);
    with ``timeout_s`` a deadline that long after its submit; with ``cancel_after_s`` the client
    cancels it that long after it was accepted (before its next turn)."""

    user: str
    at_s: float = 0.0
    sleep_ms: int = 5
    tier: str = TIER
    timeout_s: float | None = None
    cancel_after_s: float | None = None


@dataclass
class Call:
    """One handler run: who ran which turn under which lease, when, and what it saw."""

    user: str
    turn: str
    worker: str
    lease: str
    attempt: int
    seen: list[str]
    enter: float
    exit: float | None = None


@dataclass
class Submitted:
    user: str
    turn: str
    tier: str
    index: int  # position in the user's submission order
    sleep_ms: int = 0  # the handler time it asks for
    accepted: float | None = None  # when the client learned it was accepted
    deadline: float | None = None  # its deadline (virtual seconds), if it has one
    # what the client's cancel found (Cancel.outcome; "sent" while unanswered), if it cancelled it
    cancelled: str | None = None


@dataclass
class Record:
    """What happened, for the checker."""

    turns: list[Submitted] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    faults: list[tuple[float, str, str]] = field(default_factory=list)  # (time, kind, target)
    fault_end: float = 0.0  # when the last fault's effect ended (a pause resumed, Redis back)
    killed: dict[str, float] = field(default_factory=dict)  # worker -> kill time
    stopped: dict[str, float] = field(default_factory=dict)  # worker -> when its run() returned
    terminated: dict[str, float] = field(default_factory=dict)  # worker -> SIGTERM time
    terminated_starting: set[str] = field(default_factory=set)  # ...that had not started serving
    outages: list[tuple[float, float]] = field(default_factory=list)  # Redis away: (from, until)
    paused: list[tuple[str, float, float]] = field(default_factory=list)  # (worker, from, until)
    expired: list[tuple[float, str, str]] = field(default_factory=list)  # (time, user, lease it ended)
    takeovers: list[tuple[float, str, int]] = field(default_factory=list)  # (time, worker, users handed on)
    clients_done: float | None = None
    starved: dict[str, float] = field(default_factory=dict)  # turn -> seconds waiting with a slot free
    # (lease, turn id) written with "ok" -> when each such write landed (a worker may run a turn
    # again under its own lease while the first run's commit is still on its way)
    commits: dict[tuple[str, str], list[float]] = field(default_factory=dict)


_WORLD: contextvars.ContextVar[World] = contextvars.ContextVar("sim_world")


@handlers.register("sim")
async def sim_handler(ctx: handlers.TurnContext) -> HandlerResult:
    """The simulated model call: records its entry and exit, sleeps the turn's ``sleep_ms``."""
    world = _WORLD.get()
    loop = asyncio.get_running_loop()
    call = Call(ctx.turn.user, ctx.turn.turn_id, ctx.worker, ctx.lease, ctx.attempt,
                [e.turn_id for e in ctx.pack.session], loop.time())
    world.record.calls.append(call)
    world.saw_handler("enter", call)
    try:
        if ctx.turn.stream:  # text that names its writer: the checker tells whose chunks it reads
            ctx.emit(f"<{ctx.lease} a{ctx.attempt}>")
        await asyncio.sleep(float(ctx.option("sleep_ms", 5)) / 1000)
        if ctx.turn.stream:
            ctx.emit(f"<{ctx.lease} a{ctx.attempt} end>")
    finally:
        call.exit = loop.time()
        world.saw_handler("exit", call)
    return HandlerResult(text="".join(ctx.emitted) if ctx.turn.stream else f"done {ctx.turn.turn_id}")


class World:
    """The workers, the clients and the record of one schedule."""

    def __init__(self, loop: SimLoop, net: Network, workload: Workload, rng: random.Random,
                 plan: list[Planned] | None = None) -> None:
        self.loop = loop
        self.net = net
        self.workload = workload
        self.rng = rng
        self.plan = plan  # None: each user's turns are drawn from the seed
        self.record = Record()
        self.workers: dict[str, asyncio.Task[int]] = {}
        self.instances: dict[str, Worker] = {}
        self.handler_watchers: list[Callable[[str, Call], None]] = []  # (enter|exit, the call)
        self._resumes: dict[str, asyncio.TimerHandle] = {}  # paused worker -> its SIGCONT
        net.watchers.append(self._watch_commits)
        self._spawned = 0
        self.policy = TurnsPolicy(handler="sim", concurrency=workload.concurrency, max_attempts=50,
                                  scaling=Scaling(report_interval_s=5.0), ready_shards=workload.ready_shards)

    def saw_handler(self, kind: str, call: Call) -> None:
        for watch in list(self.handler_watchers):
            watch(kind, call)

    # --- nodes -------------------------------------------------------------------------------
    def _in_node(self, node: str) -> contextvars.Context:
        ctx = contextvars.copy_context()
        ctx.run(NODE.set, node)
        ctx.run(_WORLD.set, self)
        return ctx

    def call_later(self, seconds: float, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` ``seconds`` from now, as the commander (a node no fault touches)."""
        self.loop.call_later(seconds, fn, *args, context=self._in_node("commander"))

    def start_worker(self) -> str:
        """Start one more worker of the tier, a node of its own."""
        wid = f"w{self._spawned}"
        self._spawned += 1
        settings = WorkerSettings(tier=TIER, worker_id=wid, **WORKER_TIMING)  # type: ignore[arg-type]
        worker = Worker(settings, r=self.net.client())
        self.instances[wid] = worker
        self._watch_drain(wid, worker)
        self.workers[wid] = self.loop.create_task(self._run_worker(wid, worker), context=self._in_node(wid))
        return wid

    def _watch_drain(self, wid: str, worker: Worker) -> None:
        """Note whether the worker had started serving when its drain ran: a SIGTERM sent while
        it was stopped (SIGSTOP) and still starting runs only after SIGCONT, and its event loop
        may finish the start first; then it drains as a serving worker."""
        drain = worker.drain

        def watched(reason: str = "") -> None:
            if not worker.draining and worker.state != "starting":
                self.record.terminated_starting.discard(wid)
            drain(reason)
        worker.drain = watched  # type: ignore[method-assign]  # (its signal handler binds this)

    def _watch_commits(self, wire: Wire) -> None:
        """Note every write-back that landed, with the lease it landed under (for I3): a
        ``turn_commit`` the server ran that answered 'ok' (ARGV[1] the lease, ARGV[3] the turn)."""
        if wire.kind != "applied" or wire.script() != "turn_commit":
            return
        reply = wire.reply
        if isinstance(reply, list) and reply and reply[0] == b"ok":
            argv = wire.script_argv()
            if argv[2]:
                landed = self.record.commits.setdefault((as_str(argv[0]), as_str(argv[2])), [])
                landed.append(self.loop.time())

    async def _run_worker(self, wid: str, worker: Worker) -> int:
        code = await worker.run()
        self.record.stopped[wid] = self.loop.time()
        return code

    def live_workers(self) -> list[str]:
        return [w for w, t in self.workers.items() if w not in self.loop.dead and not t.done()]

    def kill(self, wid: str) -> None:
        """SIGKILL: the worker's tasks vanish; a replacement starts a little later."""
        self.loop.kill(wid)
        self.net.kill_node(wid)
        self.record.killed[wid] = self.loop.time()
        self.loop.call_later(RESPAWN_S, self.start_worker, context=self._in_node("commander"))
        self.loop.call_later(SEES_EXIT_S, self.take_over, wid, context=self._in_node("commander"))

    def take_over(self, wid: str) -> None:
        """What the commander does when it sees a worker process exit (stores.takeover), or
        when it takes a live one for dead (its heartbeat expired in an outage): fenced.

        Its blocking calls run as one step, on the fault-free client, but not while Redis is
        down for everyone: then the real commander's call fails and it tries again next pass.
        """
        if self.net.is_down():
            self.loop.call_later(PASS_S, self.take_over, wid, context=self._in_node("commander"))
            return
        done = take_over(self.net.sync_client(), TIER, wid)
        self.record.takeovers.append((self.loop.time(), wid, len(done.users)))

    async def _commander(self) -> None:
        """The commander's periodic sweep: consumers whose heartbeat is gone are taken over
        (live workers too, right after an outage longer than the heartbeat TTL: fenced)."""
        while True:
            await asyncio.sleep(SWEEP_S)
            if self.net.is_down():
                continue  # the sweep fails; tried again at the next one
            for done in sweep(self.net.sync_client(), TIER):
                self.record.takeovers.append((self.loop.time(), done.worker, len(done.users)))

    def pause(self, wid: str, seconds: float) -> None:
        """SIGSTOP now, SIGCONT ``seconds`` later."""
        self.loop.pause(wid)
        self.record.paused.append((wid, self.loop.time(), self.loop.time() + seconds))
        self._resumes[wid] = self.loop.call_later(seconds, self.loop.resume, wid,
                                                  context=self._in_node("commander"))

    def resume(self, wid: str) -> None:
        """SIGCONT now, before its pause was to end."""
        timer = self._resumes.pop(wid, None)
        if timer is not None:
            timer.cancel()
        if wid in self.loop.paused:
            now = self.loop.time()
            self.record.paused = [(w, a, min(b, now) if w == wid and a <= now < b else b)
                                  for w, a, b in self.record.paused]
        self.loop.resume(wid)

    def expire_lane(self, user: str) -> None:
        """The user's lease ends early (a clock jump, a renewal that came too late)."""
        r = self.net.sync_client()
        held = r.get(keys.lane(user))
        if held is not None:
            r.delete(keys.lane(user))
            self.record.expired.append((self.loop.time(), user, as_str(held)))

    def terminate(self, wid: str) -> None:
        """SIGTERM: the worker drains and stops; a replacement starts a little later."""
        if self._sigterm(wid):
            self.loop.call_later(RESPAWN_S, self.start_worker, context=self._in_node("commander"))

    def inject(self, kind: str, target: str, arg: float = 0.0) -> None:
        """Apply one fault now and record it: ``kill``, ``term`` or ``pause`` (``arg`` s) a worker,
        ``expire`` a user's lane, ``drop`` a node's next reply, ``stall`` it ``arg`` s, lose a
        node's next cancellation inside a Redis call (``lose-cancel``), or take Redis away for
        ``arg`` s (``restart``, ``outage``)."""
        now = self.loop.time()
        if kind == "kill":
            self.kill(target)
        elif kind == "term":
            self.terminate(target)
        elif kind == "pause":
            self.pause(target, arg)
        elif kind == "expire":
            self.expire_lane(target)
        elif kind == "drop":
            self.net.drop_next.add(target)
        elif kind == "stall":
            self.net.stall_next[target] = arg
        elif kind == "lose-cancel":
            self.net.lose_cancel.add(target)
        elif kind in ("restart", "outage"):  # Redis goes away for arg seconds
            self.net.restart(arg)
            self.record.outages.append((now, now + arg))
        else:
            raise ValueError(f"unknown fault {kind!r}")
        self.record.faults.append((now, kind, target))
        self.record.fault_end = max(self.record.fault_end, now + arg)

    # --- the run -----------------------------------------------------------------------------
    async def main(self, horizon_s: float) -> None:
        """Serve every user's turns; return when all are answered or at ``horizon_s``."""
        write_policy(self.net.sync_client(), TIER, self.policy)
        if self.workload.reshard_at_s is not None:  # a live tier's ready_shards changes
            self.loop.call_later(self.workload.reshard_at_s, self._reshard,
                                 context=self._in_node("commander"))
        for _ in range(self.workload.workers):
            self.start_worker()
        commander = self.loop.create_task(self._commander(), context=self._in_node("commander"))
        clients = [self.loop.create_task(self._user(f"u{i}"), context=self._in_node(f"c{i}"))
                   for i in range(self.workload.users)] if self.plan is None else \
                  [self.loop.create_task(self._planned(user), context=self._in_node(f"c{i}"))
                   for i, user in enumerate(dict.fromkeys(p.user for p in self.plan))]
        while self.loop.time() < horizon_s:
            await asyncio.sleep(SAMPLE_S)
            self._sample_starvation()
            if all(c.done() for c in clients):
                if self.record.clients_done is None:
                    self.record.clients_done = self.loop.time()
                if self.all_answered():
                    break
        for task in [*clients, commander]:
            task.cancel()

    def _reshard(self) -> None:
        """``fleet policy set chat ready_shards=<n>`` mid-run (a Redis that is down skips it)."""
        self.policy = self.policy.model_copy(update={"ready_shards": self.workload.reshard_to})
        with contextlib.suppress(RedisError):
            write_policy(self.net.sync_client(), TIER, self.policy)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """SIGTERM every live worker and wait for them to drain (bounded)."""
        for wid in self.live_workers():
            self._sigterm(wid)
        deadline = self.loop.time() + grace_s
        while self.loop.time() < deadline and self.live_workers():
            await asyncio.sleep(0.1)

    def _sigterm(self, wid: str) -> bool:
        worker = self.instances[wid]
        if not self.loop.send_signal(wid, 15) and worker.state != "starting":
            return False  # (a worker still starting may not have installed its handler yet)
        if worker.state == "starting":
            self.record.terminated_starting.add(wid)
            self.loop.call_soon(worker.drain, "SIGTERM", context=self._in_node(wid))
        self.record.terminated[wid] = self.loop.time()
        return True

    def _free_slot(self) -> bool:
        """Whether some live, running, unpaused worker could take a user right now."""
        for wid in self.live_workers():
            w = self.instances[wid]
            if wid not in self.loop.paused and w.state == "ready" and len(w.jobs) < w.policy.concurrency:
                return True
        return False

    def _sample_starvation(self) -> None:
        """Count, per waiting turn, the time nobody serves its user while a slot is free."""
        if self.net.is_down() or not self._free_slot():
            return
        waiting = [t for t in self.record.turns if t.accepted is not None and t.tier != GHOST]
        if not waiting:
            return
        r = self.net.sync_client()
        pipe = r.pipeline(transaction=False)
        for t in waiting:
            pipe.exists(keys.reply(t.user, t.turn))
            pipe.exists(keys.lane(t.user))
        got = pipe.execute()
        for i, t in enumerate(waiting):
            answered, served = got[2 * i], got[2 * i + 1]
            if not answered and not served:
                self.record.starved[t.turn] = self.record.starved.get(t.turn, 0.0) + SAMPLE_S

    def all_answered(self) -> bool:
        r = self.net.sync_client()
        pipe = r.pipeline(transaction=False)
        wanted = [t for t in self.record.turns if t.accepted is not None]
        for t in wanted:
            pipe.exists(keys.reply(t.user, t.turn))
        return all(pipe.execute())

    # --- a user ------------------------------------------------------------------------------
    async def _user(self, user: str) -> None:
        client = AsyncFleet(client=self.net.client(retries=0))
        ghost_at = self.rng.randrange(self.workload.turns) if self.workload.ghosts else -1
        for i in range(self.workload.turns):
            await asyncio.sleep(self.rng.choice((0.0, 0.0, 0.001, 0.02, 0.3)))
            tier = GHOST if i == ghost_at else TIER
            sub = Submitted(user, f"{user}-t{i}", tier, i, self.rng.choice((1, 5, 20, 200, 1500)))
            stop = tier == TIER and self.workload.stop > 0 and self.rng.random() < self.workload.stop
            cancel = stop and self.rng.random() < 0.5
            if stop and not cancel:
                sub.deadline = self.loop.time() + self.rng.choice((0.01, 0.2, 1.0, 3.0))
            self.record.turns.append(sub)
            await self._submit(client, sub, sub.sleep_ms)
            if cancel:
                await asyncio.sleep(self.rng.choice((0.0, 0.001, 0.02, 0.3)))
                await self._cancel(client, sub)

    async def _planned(self, user: str) -> None:
        """Submit ``user``'s planned turns, each at its time (after the one before it is accepted)."""
        client = AsyncFleet(client=self.net.client(retries=0))
        for i, turn in enumerate(p for p in self.plan or [] if p.user == user):
            await asyncio.sleep(max(0.0, turn.at_s - self.loop.time()))
            sub = Submitted(user, f"{user}-t{i}", turn.tier, i, turn.sleep_ms)
            if turn.timeout_s is not None:
                sub.deadline = self.loop.time() + turn.timeout_s
            self.record.turns.append(sub)
            await self._submit(client, sub, sub.sleep_ms)
            if turn.cancel_after_s is not None:
                await asyncio.sleep(turn.cancel_after_s)
                await self._cancel(client, sub)

    def cancel(self, user: str, turn: str) -> None:
        """A client cancels ``user``'s turn ``turn`` now (a scenario's action)."""
        sub = next(s for s in self.record.turns if s.user == user and s.turn == turn)
        client = AsyncFleet(client=self.net.client(retries=0))
        self.loop.create_task(self._cancel(client, sub), context=self._in_node(f"c-{user}"))

    async def _cancel(self, client: AsyncFleet, sub: Submitted) -> None:
        """Cancel until Redis answers (a cancel sent again is the same cancel): ``sub.cancelled``
        is "sent" until then (the cancel may have been recorded), then what it found."""
        sub.cancelled = sub.cancelled or "sent"
        failures = 0
        while True:
            try:
                sub.cancelled = (await client.cancel(sub.user, sub.turn)).outcome
                return
            except RedisError:
                failures += 1
                await asyncio.sleep(min(2.0, 0.05 * 2 ** min(failures, 6)))

    async def _submit(self, client: AsyncFleet, sub: Submitted, sleep_ms: int) -> None:
        """Submit until accepted, with the same turn id every time (the worker dedupes)."""
        failures = 0
        deadline = None if sub.deadline is None else EPOCH + sub.deadline
        while True:
            try:
                if sub.tier == GHOST:
                    await self._submit_raw(client, sub)
                elif self.workload.streamed:  # (the client's submit of a streamed turn: TurnStream's)
                    turn = _build_turn(sub.user, f"text {sub.turn}", sub.tier, {"sleep_ms": sleep_ms},
                                       sub.turn, client.max_turn_bytes, stream=True, deadline=deadline)
                    await client._send([turn], False)
                else:
                    await client.submit(sub.user, f"text {sub.turn}", tier=sub.tier,
                                        meta={"sleep_ms": sleep_ms}, turn_id=sub.turn, deadline=deadline)
                sub.accepted = self.loop.time()
                return
            except RedisError:
                failures += 1
                await asyncio.sleep(min(2.0, 0.05 * 2 ** min(failures, 6)))

    async def _submit_raw(self, client: AsyncFleet, sub: Submitted) -> None:
        """A turn for a tier that exists nowhere, as any Redis client can write one."""
        pipe = client.r.pipeline(transaction=True)
        pipe.xadd(keys.inbox(sub.user), {"text": f"text {sub.turn}", "turn_id": sub.turn, "tier": sub.tier})
        pipe.xadd(keys.ready(sub.tier), {"user": sub.user})
        await pipe.execute()
