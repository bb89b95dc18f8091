"""What Fleet's client costs the process that submits turns: CPU per call, one call at a time.

A chat front end submits its users' turns and waits for their replies; what that costs its
process is part of a turn's cost (``scripts/bench_peers`` counts it with its load generator's
own). On a private redis-server with the functions loaded and the tier's policy written, this
times in the process's CPU (``time.process_time``: user and system, which on a VM includes the
system calls of a round trip):

- ``round trip``: a bare ``PING`` on the client's own connection, what any request costs;
- ``submit``: ``Fleet.submit`` / ``AsyncFleet.submit`` of a new turn (building, validating and
  encoding it, the script call, and the tier's pressure check when it is due);
- ``reply wait``: ``TurnHandle.result`` / ``AsyncFleet.wait`` for a reply already there (the
  ``BLPOP`` and the decode; the replies are pushed beforehand, as a worker pushes them);

on the blocking client and on the asyncio one (the default event loop), ``--calls`` calls a
batch, the three alternated batch by batch for ``--rounds`` rounds. This machine's speed
drifts by a third within minutes, so Fleet's own part of a call (the call less a round trip)
is the median of the differences within each round.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis
from benchlib import MachineWatch, OneLineParser, emit, redis_server

from fleet.client import AsyncFleet, Fleet, TurnHandle
from protocol import keys
from protocol.codec import encode
from protocol.models import Reply
from protocol.policy import TurnsPolicy
from stores.functions import install
from stores.policies import write_policy

TIER = "chat"
TEXT = "what did I say about the second item?"
CALLS = ("round trip", "submit", "reply wait")


def parse_args(argv: list[str] | None = None) -> Any:
    p = OneLineParser(prog="scripts/bench_client", description=__doc__)
    p.add_argument("--calls", type=int, default=500, help="calls in a batch")
    p.add_argument("--rounds", type=int, default=20, help="batches of each call, alternated")
    p.add_argument("--users", type=int, default=1000, help="the users the turns go to, in turn")
    p.add_argument("--quick", action="store_true", help="100 calls, 3 rounds (a smoke test)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.rounds = 100, 3
    if min(args.calls, args.rounds, args.users) < 1:
        p.error("--calls, --rounds and --users must be positive")
    return args


def push_replies(r: redis.Redis, turns: list[tuple[str, str]]) -> None:
    """The replies of ``turns`` (user, turn id), where a worker leaves them."""
    pipe = r.pipeline(transaction=False)
    for user, turn_id in turns:
        pipe.rpush(keys.reply(user, turn_id), encode(Reply(turn_id=turn_id, user=user, ok=True, text="ok")))
    pipe.execute()


def cpu_us(calls: int, run: Callable[[], None]) -> float:
    """CPU µs of this process per call while ``run`` makes ``calls`` calls."""
    start = time.process_time()
    run()
    return (time.process_time() - start) * 1e6 / calls


async def acpu_us(calls: int, run: Callable[[], Awaitable[None]]) -> float:
    start = time.process_time()
    await run()
    return (time.process_time() - start) * 1e6 / calls


def blocking_round(fleet: Fleet, r: redis.Redis, users: list[str], calls: int) -> dict[str, float]:
    """One batch of each call on the blocking client."""
    handles: list[TurnHandle] = []

    def ping() -> None:
        for _ in range(calls):
            fleet.r.ping()

    def submit() -> None:
        handles.extend(fleet.submit(users[i % len(users)], TEXT) for i in range(calls))

    def wait() -> None:
        for handle in handles:
            handle.result(timeout=5)

    out = {"round trip": cpu_us(calls, ping), "submit": cpu_us(calls, submit)}
    push_replies(r, [(h.user, h.turn_id) for h in handles])
    out["reply wait"] = cpu_us(calls, wait)
    return out


async def asyncio_round(fleet: AsyncFleet, r: redis.Redis, users: list[str], calls: int) -> dict[str, float]:
    """One batch of each call on the asyncio client."""
    turns: list[tuple[str, str]] = []

    async def ping() -> None:
        for _ in range(calls):
            await fleet.r.ping()

    async def submit() -> None:
        for i in range(calls):
            turn = await fleet.submit(users[i % len(users)], TEXT)
            turns.append((turn.user, turn.turn_id))

    async def wait() -> None:
        for user, turn_id in turns:
            await fleet.wait(user, turn_id, timeout=5)

    out = {"round trip": await acpu_us(calls, ping), "submit": await acpu_us(calls, submit)}
    push_replies(r, turns)
    out["reply wait"] = await acpu_us(calls, wait)
    return out


def summary(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Per call its median µs and range; Fleet's part: the median of (call - round trip) by round."""
    out: dict[str, Any] = {}
    for name in CALLS:
        got = [one[name] for one in rounds]
        out[name] = {"cpu_us_median": round(statistics.median(got), 1),
                     "cpu_us_range": [round(min(got), 1), round(max(got), 1)]}
        if name != "round trip":
            out[name]["over_a_round_trip_us"] = round(statistics.median(
                [one[name] - one["round trip"] for one in rounds]), 1)
    return out


async def bench_asyncio(url: str, r: redis.Redis, users: list[str], calls: int,
                        rounds: int) -> list[dict[str, float]]:
    fleet = AsyncFleet(url)
    try:
        await fleet.submit(users[0], "warm up")  # the tier's check and options, read once
        return [await asyncio_round(fleet, r, users, calls) for _ in range(rounds)]
    finally:
        await fleet.aclose()


def bench(url: str, users: int, calls: int, rounds: int) -> dict[str, Any]:
    """Each client's figures, and what the calls left in Redis: the turns in the inboxes (every
    submit's) and the replies no wait took (none)."""
    r = redis.Redis.from_url(url)
    install(r)
    write_policy(r, TIER, TurnsPolicy())
    names = [f"u{i:05d}" for i in range(users)]
    with Fleet(url) as fleet:
        fleet.submit(names[0], "warm up")
        blocking = [blocking_round(fleet, r, names, calls) for _ in range(rounds)]
    on_asyncio = asyncio.run(bench_asyncio(url, r, names, calls, rounds))
    inboxed = sum(r.xlen(keys.inbox(user)) for user in names)
    replies_left = sum(1 for _ in r.scan_iter(match=f"{keys.PREFIX}:u:*:reply:*"))
    r.close()
    return {"clients": {"blocking": summary(blocking), "asyncio": summary(on_asyncio)},
            "turns_submitted": inboxed, "replies_left": replies_left}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()
    with redis_server() as url:
        result = bench(url, args.users, args.calls, args.rounds)
    got = result["clients"]
    print(f"Fleet's client, CPU of this process per call, median of {args.rounds} batches of {args.calls}:")
    for client, calls in got.items():
        for name, one in calls.items():
            extra = one.get("over_a_round_trip_us")
            over = "" if extra is None else f"; over a round trip {extra:.1f}"
            print(f"  {client:8s} {name:11s} {one['cpu_us_median']:7.1f} µs  (range {one['cpu_us_range'][0]}-"
                  f"{one['cpu_us_range'][1]}{over})")
    emit({"calls": args.calls, "rounds": args.rounds, "users": args.users, **result}, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
