"""Throughput and latency of the turn pipeline: N workers, the echo handler, many users.

Phase 1 (saturation): every user keeps one turn in flight (closed loop) for --seconds;
turns/s is the pipeline's capacity. Phase 2 (half load): turns arrive as a Poisson process
at half the measured capacity, spread over the users; submit->reply p50/p99 is the latency a
user sees when the fleet is not the bottleneck. The load generator shares the machine's
cores with the workers and Redis, as it would on a one-box deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

from benchlib import MachineWatch, OneLineParser, emit, percentile, redis_server, worker_processes

from fleet.client import AsyncFleet
from protocol.policy import TurnsPolicy
from stores.connection import connect_sync
from stores.policies import write_policy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="scripts/bench_pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64, help="slots per worker")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    p.add_argument("--quick", action="store_true", help="100 users, 3 s phases (smoke test)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.users, args.seconds = min(args.users, 100), min(args.seconds, 3.0)
    if args.users < 1 or args.workers < 1 or args.seconds <= 0:
        p.error("--users, --workers and --seconds must be positive")
    return args


class Progress:
    """One line a second: what a person watching wants to know."""

    def __init__(self, phase: str) -> None:
        self.phase, self.done, self.start, self.last = phase, 0, time.monotonic(), time.monotonic()

    def tick(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= 1.0:
            self.last = now
            rate = self.done / (now - self.start)
            print(f"  {self.phase}: {self.done} turns, {rate:,.0f}/s", file=sys.stderr, flush=True)


async def saturation(fleet: AsyncFleet, users: list[str], seconds: float) -> tuple[list[float], float]:
    """Closed loop: each user has one turn in flight. Returns (latencies, elapsed seconds)."""
    latencies: list[float] = []
    progress = Progress("saturation")
    stop = time.monotonic() + seconds

    async def user_loop(user: str) -> None:
        i = 0
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            reply = await fleet.ask(user, f"turn {i}", timeout=60)
            latencies.append(time.perf_counter() - t0)
            assert reply.ok, reply.error
            progress.tick()
            i += 1

    t0 = time.monotonic()
    await asyncio.gather(*(user_loop(u) for u in users))
    return latencies, time.monotonic() - t0


async def open_loop(fleet: AsyncFleet, users: list[str], rate: float, seconds: float) -> list[float]:
    """Poisson arrivals at ``rate``/s on random users. Returns latencies."""
    latencies: list[float] = []
    progress = Progress(f"open loop {rate:,.0f}/s")
    rng = random.Random(7)
    tasks = []

    async def one(user: str, i: int) -> None:
        t0 = time.perf_counter()
        reply = await fleet.ask(user, f"open {i}", timeout=60)
        latencies.append(time.perf_counter() - t0)
        assert reply.ok, reply.error
        progress.tick()

    start = time.perf_counter()
    next_at, i = start, 0
    while next_at - start < seconds:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(rng.choice(users), i)))
        i += 1
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return latencies


async def run(args: argparse.Namespace, url: str) -> dict[str, object]:
    fleet = AsyncFleet(url)
    users = [f"u{i:05d}" for i in range(args.users)]
    await fleet.ask(users[0], "warm up", timeout=30)
    lat, elapsed = await saturation(fleet, users, args.seconds)
    turns = len(lat)
    capacity = turns / elapsed
    half = await open_loop(fleet, users, capacity / 2, args.seconds)
    await fleet.aclose()
    ms = 1000.0
    return {
        "workers": args.workers, "users": args.users, "concurrency": args.concurrency,
        "handler": "echo", "phase_seconds": args.seconds,
        "saturation": {"turns": turns, "turns_per_s": round(capacity, 1),
                       "p50_ms": round(percentile(lat, 50) * ms, 2),
                       "p99_ms": round(percentile(lat, 99) * ms, 2)},
        "half_load": {"rate_per_s": round(capacity / 2, 1), "turns": len(half),
                      "p50_ms": round(percentile(half, 50) * ms, 2),
                      "p99_ms": round(percentile(half, 99) * ms, 2)},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    with redis_server() as url:
        r = connect_sync(url)
        write_policy(r, "chat", TurnsPolicy(handler="echo", concurrency=args.concurrency))
        with worker_processes(url, args.workers):
            print(f"bench_pipeline: {args.workers} workers, {args.users} users, echo handler, "
                  f"{args.seconds:g} s per phase", file=sys.stderr)
            result = asyncio.run(run(args, url))
    sat, half = result["saturation"], result["half_load"]
    print(f"saturation: {sat['turns_per_s']:,} turns/s  p50 {sat['p50_ms']} ms  p99 {sat['p99_ms']} ms")
    print(f"half load ({half['rate_per_s']:,}/s): p50 {half['p50_ms']} ms  p99 {half['p99_ms']} ms")
    emit(result, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
