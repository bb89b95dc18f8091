"""Streamed turns, measured: what streaming costs and how fast stop is.

On a private redis-server with real worker processes (the built-in ``echo_stream`` handler,
``delay_ms`` between words; its ``stamp`` option tags each word with the time it was emitted):

1. **emit -> client**: the time from a handler's emit to the client seeing the chunk
   (``AsyncFleet.stream``), p50/p99, at half the load the workers sustain (a closed loop first
   finds that load: streamed turns per second with every slot busy);
2. **Redis cost**: Redis CPU (``INFO`` CPU counters) and commands per turn of a streamed turn
   of ``--chunks`` chunks against the same turn read as a plain one (the same handler and
   pacing: the chunks go into the reply, nothing is streamed);
3. **stop**: ``AsyncFleet.cancel`` -> the handler cancelled (its exit in the worker's handler
   trace), and -> the ``cancelled`` reply at the client, p50/p99;
4. **in flight**: how many streamed turns of a ~2 s model call one worker process holds at once
   (``--hold`` submitted together), and how long each took.

Figures are reported, never asserted: run it alone on the machine (``uptime`` first; the load
average at the start is in the output). ``scripts/bench_stream --json out.json``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.client import AsyncFleet, Restart  # noqa: E402
from protocol.models import Reply  # noqa: E402
from protocol.policy import TurnsPolicy  # noqa: E402
from scripts.benchlib import MachineWatch, OneLineParser, emit, percentile, redis_server, worker_processes  # noqa: E402
from stores.policies import write_policy  # noqa: E402


def parse_args(argv: list[str] | None) -> Any:
    p = OneLineParser(prog="scripts/bench_stream", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0, help="length of the load phases")
    p.add_argument("--workers", type=int, default=2, help="worker processes of the load phases")
    p.add_argument("--concurrency", type=int, default=32, help="slots per worker in the load phases")
    p.add_argument("--words", type=int, default=20, help="chunks of a turn in the load phases")
    p.add_argument("--delay-ms", type=float, default=20.0, help="between two chunks")
    p.add_argument("--chunks", type=int, default=100, help="chunks of a turn in the Redis-cost phase")
    p.add_argument("--cost-turns", type=int, default=200, help="turns of each kind in the Redis-cost phase")
    p.add_argument("--cancels", type=int, default=50, help="turns stopped in the stop phase")
    p.add_argument("--hold", type=int, default=1000, help="streamed turns submitted at once to one worker")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if min(args.seconds, args.workers, args.concurrency, args.words, args.chunks, args.cost_turns,
           args.cancels, args.hold) <= 0:
        p.error("every count and length must be positive")
    return args


def text(words: int, prefix: str = "w") -> str:
    return " ".join(f"{prefix}{i}" for i in range(words))


def redis_cost(r: redis.Redis) -> tuple[float, int]:
    """Redis's CPU seconds (user + sys) and commands processed so far."""
    cpu, stats = r.info("cpu"), r.info("stats")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), int(stats["total_commands_processed"])


async def stream_turn(fleet: AsyncFleet, user: str, words: str, tier: str, lags: list[float] | None) -> Reply:
    """One streamed turn read to its reply; with ``lags``, each stamped chunk's emit -> seen."""
    reply = None
    async for item in fleet.stream(user, words, tier=tier, timeout=120):
        seen = time.time()
        if isinstance(item, Reply):
            reply = item
        elif isinstance(item, str) and lags is not None:
            for word in item.split():
                lags.append(seen - float(word.rsplit("@", 1)[1]))
        elif isinstance(item, Restart) and lags is not None:
            lags.clear()  # (never in this bench: no attempt fails)
    assert reply is not None and reply.ok, reply
    return reply


async def closed_loop(fleet: AsyncFleet, users: int, seconds: float, words: str) -> float:
    """Streamed turns per second with ``users`` each streaming turn after turn."""
    done = 0
    end = time.monotonic() + seconds

    async def user(i: int) -> None:
        nonlocal done
        while time.monotonic() < end:
            await stream_turn(fleet, f"cap{i}", words, "stream", None)
            done += 1

    start = time.monotonic()
    await asyncio.gather(*(user(i) for i in range(users)))
    return done / (time.monotonic() - start)


async def open_loop(fleet: AsyncFleet, rate: float, seconds: float, words: str) -> tuple[list[float], int]:
    """Streamed turns started at ``rate`` per second (each user one at a time): the chunks'
    emit -> seen lags, and the turns done."""
    lags: list[float] = []
    tasks: list[asyncio.Task[Reply]] = []
    start, n = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        tasks.append(asyncio.create_task(stream_turn(fleet, f"half{n}", words, "stream", lags)))
        n += 1
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
    await asyncio.gather(*tasks)
    return lags, n


async def cost(fleet: AsyncFleet, r: redis.Redis, words: str, turns: int, streamed: bool) -> dict[str, float]:
    """Redis CPU and commands per turn of ``turns`` turns of the paced ``echo_stream`` (tier
    ``costly``), 20 users at a time, read as streams or (``streamed`` false) as plain turns: the
    same handler and the same pacing, so what Redis spends meanwhile on its own (its timers,
    the workers' blocking reads) weighs on both alike."""
    sem = asyncio.Semaphore(20)

    async def one(i: int) -> None:
        async with sem:
            user = f"{'s' if streamed else 'p'}{i}"
            if streamed:
                await stream_turn(fleet, user, words, "costly", None)
            else:
                reply = await fleet.ask(user, words, tier="costly", timeout=120)
                assert reply.ok, reply

    await one(-1)  # warm
    cpu0, cmds0 = redis_cost(r)
    await asyncio.gather(*(one(i) for i in range(turns)))
    cpu1, cmds1 = redis_cost(r)
    return {"redis_cpu_us_per_turn": round((cpu1 - cpu0) / turns * 1e6, 1),
            "redis_commands_per_turn": round((cmds1 - cmds0) / turns, 1)}


def trace_exits(path: Path) -> dict[str, float]:
    """turn id -> its handler's last exit, from the workers' handler trace."""
    out: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev["ev"] == "exit":
                out[ev["turn"]] = ev["t"]
    return out


async def stop(fleet: AsyncFleet, trace: Path, n: int) -> dict[str, Any]:
    """Stop ``n`` running streamed turns once their first chunk is seen."""
    to_exit, to_reply = [], []
    for i in range(n):
        s = fleet.stream(f"stop{i}", text(200), tier="hold", timeout=60)
        it = s.__aiter__()
        first = await it.__anext__()
        assert isinstance(first, str), first
        asked = time.time()
        await fleet.cancel(f"stop{i}", s.turn_id)
        async for item in it:
            if isinstance(item, Reply):
                assert item.status == "cancelled", item
                to_reply.append(time.time() - asked)
        exits = trace_exits(trace)
        if s.turn_id in exits:
            to_exit.append(exits[s.turn_id] - asked)
    return {"stops": n, "to_handler_cancelled_ms": ms(to_exit), "to_cancelled_reply_ms": ms(to_reply)}


async def hold(fleet: AsyncFleet, trace: Path, n: int, words: int) -> dict[str, Any]:
    """``n`` streamed turns of ~2 s submitted together to one worker."""
    start = time.time()
    turns = (stream_turn(fleet, f"hold{i}", text(words), "hold", None) for i in range(n))
    replies = await asyncio.gather(*turns)
    took = time.time() - start
    events = []
    for line in trace.read_text().splitlines():
        ev = json.loads(line)
        if ev["user"].startswith("hold"):
            events.append((ev["t"], 1 if ev["ev"] == "enter" else -1))
    inflight = peak = 0
    for _t, d in sorted(events):
        inflight += d
        peak = max(peak, inflight)
    return {"turns": n, "answered": len(replies), "peak_in_flight": peak, "all_done_s": round(took, 2)}


def ms(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": round(percentile(values, 50) * 1000, 1),
            "p99": round(percentile(values, 99) * 1000, 1), "max": round(max(values, default=0.0) * 1000, 1)}


async def run(args: Any, url: str, trace: Path, watch: MachineWatch) -> dict[str, Any]:
    r = redis.Redis.from_url(url)
    fleet = AsyncFleet(url)
    try:
        words = text(args.words)
        users = 2 * args.concurrency * args.workers
        with watch.phase("saturation"):
            rate = await closed_loop(fleet, users, args.seconds, words)
        print(f"bench_stream: {rate:.0f} streamed turns/s with every slot busy ({users} users)",
              file=sys.stderr, flush=True)
        with watch.phase("half load"):
            lags, n = await open_loop(fleet, rate / 2, args.seconds, words)
        print(f"bench_stream: half load, {n} turns, {len(lags)} chunks", file=sys.stderr, flush=True)
        with watch.phase("Redis cost, plain"):
            plain = await cost(fleet, r, text(args.chunks), args.cost_turns, streamed=False)
        with watch.phase("Redis cost, streamed"):
            streamed = await cost(fleet, r, text(args.chunks), args.cost_turns, streamed=True)
        print("bench_stream: Redis cost measured; stopping turns", file=sys.stderr, flush=True)
        stopped = await stop(fleet, trace, args.cancels)
        held = await hold(fleet, trace, args.hold, max(1, round(2000 / args.delay_ms)))
    finally:
        await fleet.aclose()
    ratio = streamed["redis_cpu_us_per_turn"] / max(plain["redis_cpu_us_per_turn"], 1e-9)
    return {"saturated_turns_per_s": round(rate, 1), "half_load_turns_per_s": round(rate / 2, 1),
            "emit_to_client_ms": ms(lags), "plain_turn": plain,
            f"streamed_turn_{args.chunks}_chunks": streamed,
            "streamed_over_plain_redis_cpu": round(ratio, 2), "stop": stopped, "hold": held}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    options = {"delay_ms": args.delay_ms, "stamp": True}
    with tempfile.TemporaryDirectory(prefix="fleet-bench-stream-") as tmp, redis_server() as url:
        r = redis.Redis.from_url(url)
        write_policy(r, "stream", TurnsPolicy(handler="echo_stream", handler_options=options,
                                              concurrency=args.concurrency, min_workers=args.workers))
        paced = {"delay_ms": args.delay_ms}
        write_policy(r, "costly", TurnsPolicy(handler="echo_stream", handler_options=paced, concurrency=20))
        write_policy(r, "hold", TurnsPolicy(handler="echo_stream", handler_options=paced,
                                            concurrency=min(1024, args.hold)))
        trace = Path(tmp) / "trace.jsonl"
        env = {"FLEET_WORKER_HANDLER_TRACE": str(trace)}
        with worker_processes(url, args.workers, "stream"), worker_processes(url, 1, "costly"), \
                worker_processes(url, 1, "hold", extra_env=env):
            result = asyncio.run(run(args, url, trace, watch))
    emit(result, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
