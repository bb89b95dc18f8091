"""Where Redis's CPU for a turn goes: each operation of a turn alone, and a request's own cost.

``scripts/bench_peers`` measures Redis's CPU per turn whole, under load. This takes it apart on
a private redis-server (AOF on, as there), with bench_peers' users (a session of 20 entries, 20
memories, a profile each) and its turn (the ``noop`` handler's write-back): every user's turn
goes through each operation in turn, through Fleet's own code (the client's submit command, the
worker's ``UserStore``), the operations of ``--batch`` users sent together in one request, so a
request's reading and writing is shared out and what is left is the operation's own cost. For
each: Redis's CPU per call (``INFO cpu``, user + system) and the commands it ran (``INFO
commandstats``: a function's inner commands count). Then what a request costs Redis by itself:
``PING`` one request at a time on 100 connections. ``--rounds`` rounds; the median is reported.

Read with bench_peers' round trips per turn: a turn costs Redis about the sum of its
operations plus its requests times a request's cost; what bench_peers measures above that is
what two shared cores add (a Redis that waits for a core wakes for fewer requests at a time).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from bench_peers import reset_and_seed
from benchlib import MachineWatch, OneLineParser, emit, redis_server

from fleet.client import _ClientCore
from protocol import keys
from protocol.codec import encode
from protocol.models import Reply, SessionEntry
from stores.memory import new_member
from stores.submit import submit_call
from stores.turns import Committed, Lease, StoreConfig, UserStore, Writes
from stores.worker_ops import join_ready_group

TIER = "chat"
CONNECTIONS = 100  # the request test's clients
TURN_OPERATIONS = ("submit", "notification read and ack", "lane acquire", "turn commit", "reply read")


def parse_args(argv: list[str] | None = None) -> Any:
    p = OneLineParser(prog="scripts/bench_functions", description=__doc__)
    p.add_argument("--users", type=int, default=1000, help="users, each with one turn a round")
    p.add_argument("--batch", type=int, default=50, help="operations sent together in one request")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context-turns", type=int, default=StoreConfig.context_turns,
                   help="session entries in a context pack (the workers' default; the users have 20)")
    p.add_argument("--memories", type=int, default=StoreConfig.memory_k,
                   help="memories in a context pack (the workers' default; the users have 20)")
    p.add_argument("--quick", action="store_true", help="100 users, 2 rounds (a smoke test)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.users, args.rounds = 100, 2
    if min(args.users, args.batch, args.rounds, args.context_turns, args.memories) < 1:
        p.error("--users, --batch, --rounds, --context-turns and --memories must be positive")
    return args


class Counters:
    """Redis's CPU seconds and commands run, read before and after an operation."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def read(self) -> tuple[float, dict[str, int]]:
        cpu = self.r.info("cpu")
        stats = self.r.info("commandstats")
        return (cpu["used_cpu_user"] + cpu["used_cpu_sys"],
                {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()})

    async def measure(self, calls: int, run: Callable[[], Awaitable[None]]) -> dict[str, Any]:
        """Redis's CPU µs per call and commands per call while ``run`` makes ``calls`` calls
        (less the two INFO commands that read the counters)."""
        cpu0, cmds0 = self.read()
        await run()
        cpu1, cmds1 = self.read()
        ran = {k: n - cmds0.get(k, 0) for k, n in cmds1.items()}
        ran["info"] = ran.get("info", 0) - 2
        return {"cpu_us": (cpu1 - cpu0) * 1e6 / calls,
                "commands": {k: n / calls for k, n in sorted(ran.items()) if n > 0}}


def turn_writes(lease: Lease, turn_id: str, text: str, worker: str) -> Writes:
    """What the ``noop`` handler's turn writes back (worker.job, ``_writes``): the session
    entry, the reply, one memory, one profile field and the usage counters."""
    now = time.time()
    nxt = lease.next
    assert nxt is not None and nxt.pulled is not None, "the acquire handed back no turn"
    pack = nxt.pulled.pack
    reply = Reply(turn_id=turn_id, user=lease.user, ok=True, text="", worker=worker, ts=now,
                  attempts=nxt.pulled.attempts,
                  context={"session_turns": pack.session_size, "memories": [m.text for m in pack.memories],
                           "profile": pack.profile})
    entry = SessionEntry(turn_id=turn_id, entry=nxt.entry, text=text, reply="", ts=now)
    return Writes(turn_id=turn_id, session_entry=encode(entry), reply=encode(reply),
                  profile={"last_text": text}, memories=[new_member(text, 0.5, now)],
                  usage={"turns": 1, "chars_in": len(text), "chars_out": 0, "handler_ms": 0})


class TurnRound:
    """One turn of every user, taken through each operation of a turn in order."""

    def __init__(self, ar: aioredis.Redis, users: list[str], batch: int, config: StoreConfig) -> None:
        self.ar, self.users, self.batch = ar, users, batch
        self.store = UserStore(ar, "bench-w1", config, tier=TIER)
        self.texts = {u: f"what did I say about item {i}?" for i, u in enumerate(users)}
        self.built = {u: _ClientCore.build([(u, self.texts[u])], TIER, None, None, 1 << 20) for u in users}
        self.leases: dict[str, Lease] = {}

    def parts(self) -> Iterable[list[str]]:
        for i in range(0, len(self.users), self.batch):
            yield self.users[i:i + self.batch]

    def turn_id(self, user: str) -> str:
        return self.built[user][0][0].turn_id

    async def submit(self) -> None:
        for part in self.parts():
            async with self.ar.pipeline(transaction=False) as pipe:
                for u in part:  # one script call a turn, as a client submits one turn
                    pipe.execute_command(*submit_call(self.built[u], TIER))
                await pipe.execute()

    async def notifications(self) -> None:
        ready = keys.ready(TIER, 0)
        for _ in self.parts():
            got: Any = await self.ar.xreadgroup(keys.GROUP, self.store.worker, {ready: ">"}, count=self.batch)
            entries = [entry for _stream, rows in got for entry, _fields in rows]
            await self.ar.xack(ready, keys.GROUP, *entries)

    async def acquire(self) -> None:
        for part in self.parts():  # one loop pass: the batcher sends them in one request
            got_all = await asyncio.gather(*(self.store.acquire(u) for u in part))
            for u, got in zip(part, got_all, strict=True):
                assert isinstance(got, Lease) and got.next is not None, f"{u}: {got}"
                self.leases[u] = got

    async def commit(self) -> None:
        for part in self.parts():
            done = await asyncio.gather(*(self._commit(u) for u in part))
            assert all(c.result == "ok" and c.released for c in done), done

    async def _commit(self, user: str) -> Committed:
        lease = self.leases[user]
        assert lease.next is not None
        writes = turn_writes(lease, self.turn_id(user), self.texts[user], self.store.worker)
        now_ms = int(time.time() * 1000)
        return await self.store.commit(lease, lease.next.entry, self.turn_id(user), writes, now_ms)

    async def replies(self) -> None:
        for part in self.parts():
            async with self.ar.pipeline(transaction=False) as pipe:
                for u in part:  # what BLPOP does for a reply that is there
                    pipe.lpop(keys.reply(u, self.turn_id(u)))
                got = await pipe.execute()
            assert all(got), "a reply was missing"

    async def measure(self, r: redis.Redis) -> dict[str, Any]:
        """The cost of each operation, in a turn's order."""
        counters = Counters(r)
        steps = (self.submit, self.notifications, self.acquire, self.commit, self.replies)
        return {name: await counters.measure(len(self.users), step)
                for name, step in zip(TURN_OPERATIONS, steps, strict=True)}


async def request_cost(url: str, r: redis.Redis, requests: int) -> dict[str, Any]:
    """Redis's CPU for one request by itself: PINGs, one at a time on each of ``CONNECTIONS``."""
    clients = [aioredis.Redis.from_url(url, single_connection_client=True) for _ in range(CONNECTIONS)]
    per = max(1, requests // CONNECTIONS)

    async def ping(c: aioredis.Redis) -> None:
        for _ in range(per):
            await c.ping()

    async def run() -> None:
        await asyncio.gather(*(ping(c) for c in clients))

    try:
        return await Counters(r).measure(per * CONNECTIONS, run)
    finally:
        for c in clients:
            await c.aclose()


async def bench(url: str, users: int, batch: int, rounds: int, config: StoreConfig) -> dict[str, Any]:
    r = redis.Redis.from_url(url)
    ar = aioredis.Redis.from_url(url)
    names = [f"u{i}-{uuid.uuid4().hex[:6]}" for i in range(users)]
    reset_and_seed(r, names)
    await join_ready_group(ar, TIER)
    runs = []
    for _ in range(rounds):
        ops = await TurnRound(ar, names, batch, config).measure(r)
        ops["request (PING, one at a time)"] = await request_cost(url, r, 20 * users)
        runs.append(ops)
    await ar.aclose()
    r.close()
    out = {}
    for name in runs[0]:
        cpu = [run[name]["cpu_us"] for run in runs]
        out[name] = {"cpu_us_median": round(statistics.median(cpu), 2), "cpu_us_range": [round(min(cpu), 2),
                                                                                         round(max(cpu), 2)],
                     "commands_per_call": {k: round(v, 2) for k, v in runs[-1][name]["commands"].items()}}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()
    with redis_server() as url:
        config = StoreConfig(context_turns=args.context_turns, memory_k=args.memories)
        ops = asyncio.run(bench(url, args.users, args.batch, args.rounds, config))
    print(f"Redis CPU per call, median of {args.rounds} rounds ({args.users} users, "
          f"{args.batch} calls a request):")
    for name, got in ops.items():
        inner = sum(got["commands_per_call"].values())
        print(f"  {name:32s} {got['cpu_us_median']:7.2f} µs  (range {got['cpu_us_range'][0]}-"
              f"{got['cpu_us_range'][1]}; {inner:.1f} commands a call)")
    turn = round(sum(got["cpu_us_median"] for name, got in ops.items() if name in TURN_OPERATIONS), 2)
    print(f"  a turn's operations together: {turn:.2f} µs, before its requests "
          f"(bench_peers' round trips a turn x the request's cost)")
    emit({"users": args.users, "batch": args.batch, "rounds": args.rounds,
          "context_turns": args.context_turns, "memories": args.memories, "operations": ops,
          "turn_operations_cpu_us": turn}, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
