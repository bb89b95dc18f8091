"""Two versions of Fleet's functions library side by side: Redis's CPU for the lane acquire and
the turn commit of each, alternated batch by batch on one redis-server.

This machine's speed drifts (by half within minutes, invisible to a benchmark's own watch): two
runs one after the other cannot show a change of a few percent in a script. Here both versions
are loaded in one redis-server (the other under a library name of its own) and every batch of
``--batch`` users takes a turn through the acquire and the commit of one version, then of the
other, in a random order, so the drift falls on both alike. Reported: each version's median µs
per call and the median of the paired differences (this version's less the other's, batch by
batch) with its interquartile range. The users and their turn are scripts/bench_functions'.
``--against`` names the other version: a git ref (its ``stores/lua``) or a directory holding
the Lua files as ``stores/lua`` does.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from bench_functions import TIER, Counters, turn_writes
from bench_peers import reset_and_seed
from benchlib import ROOT, MachineWatch, OneLineParser, emit, percentile, redis_server

from protocol import keys
from stores import functions
from stores.turns import Lease, UserStore

OPS = ("lane acquire", "turn commit")


def parse_args(argv: list[str] | None = None) -> Any:
    p = OneLineParser(prog="scripts/bench_lua_ab", description=__doc__)
    p.add_argument("--against", required=True,
                   help="the other version: a git ref or a directory of Lua files")
    p.add_argument("--users", type=int, default=3000)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--passes", type=int, default=3, help="times every user's batch takes both versions")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if min(args.users, args.batch, args.passes) < 1:
        p.error("--users, --batch and --passes must be positive")
    return args


def reader(against: str) -> Callable[[str], str]:
    """A file of the other version's ``stores/lua`` by its path there."""
    folder = Path(against)
    if folder.is_dir():
        return lambda path: (folder / path).read_text()

    def show(path: str) -> str:
        got = subprocess.run(["git", "-C", str(ROOT), "show", f"{against}:stores/lua/{path}"],
                             capture_output=True, text=True)
        if got.returncode != 0:
            raise SystemExit(f"bench_lua_ab: {against} has no stores/lua/{path} ({got.stderr.strip()})")
        return got.stdout
    return show


def other_library(against: str) -> tuple[str, str]:
    """The other version and its library text, to load beside this version's."""
    read = reader(against)
    sources = {op: functions.resolve(op, read) for op in functions.NAMES}
    version = functions.digest(sources)
    if version == functions.VERSION:
        raise SystemExit(f"bench_lua_ab: {against} holds this very version ({version}): nothing to compare")
    return version, functions.library(sources, version)


async def one_batch(r: redis.Redis, store: UserStore, users: list[str]) -> dict[str, float]:
    """A turn of each of ``users`` through the acquire and the commit (of the version the calls
    name now): Redis's µs per call of each."""
    ids = {u: f"t{time.monotonic_ns()}-{u}" for u in users}
    pipe = r.pipeline(transaction=False)
    for u in users:
        pipe.xadd(keys.inbox(u), {"turn_id": ids[u], "tier": TIER, "text": "what did I say?"})
    pipe.execute()
    counters, leases = Counters(r), []

    async def acquire() -> None:
        leases.extend(await asyncio.gather(*(store.acquire(u) for u in users)))
        assert all(isinstance(lease, Lease) and lease.next is not None for lease in leases), leases[0]

    async def commit() -> None:
        writes = [turn_writes(lease, ids[lease.user], "what did I say?", store.worker) for lease in leases]
        now_ms = int(time.time() * 1000)
        done = await asyncio.gather(*(store.commit(lease, lease.next.entry, ids[lease.user], w, now_ms)  # type: ignore[union-attr]
                                      for lease, w in zip(leases, writes, strict=True)))
        assert all(c.result == "ok" for c in done), done[0]

    got = {name: (await counters.measure(len(users), step))["cpu_us"]
           for name, step in zip(OPS, (acquire, commit), strict=True)}
    r.delete(*(keys.reply(u, ids[u]) for u in users))
    return got


async def compare(url: str, other: tuple[str, str], users: int, batch: int, passes: int) -> dict[str, Any]:
    r = redis.Redis.from_url(url)
    ar = aioredis.Redis.from_url(url)
    r.function_load(other[1])
    names = [f"u{i}" for i in range(users)]
    reset_and_seed(r, names)
    store = UserStore(ar, "bench-w1", tier=TIER)
    versions = {"this": functions.VERSION, "other": other[0]}
    got: dict[str, dict[str, list[float]]] = {side: {op: [] for op in OPS} for side in versions}
    try:
        for _ in range(passes):
            for start in range(0, users, batch):
                part = names[start:start + batch]
                for side in random.sample(list(versions), 2):
                    functions.VERSION = versions[side]  # every call's function name is made from it
                    for op, us in (await one_batch(r, store, part)).items():
                        got[side][op].append(us)
    finally:
        functions.VERSION = versions["this"]
        await ar.aclose()
        r.close()
    out: dict[str, Any] = {"versions": versions}
    for op in OPS:
        diffs = [a - b for a, b in zip(got["this"][op], got["other"][op], strict=True)]
        out[op] = {"this_us": round(statistics.median(got["this"][op]), 2),
                   "other_us": round(statistics.median(got["other"][op]), 2),
                   "paired_difference_us": round(statistics.median(diffs), 2),
                   "difference_iqr_us": [round(percentile(diffs, 25), 2), round(percentile(diffs, 75), 2)],
                   "batches": len(diffs)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    other = other_library(args.against)
    watch = MachineWatch()
    with redis_server() as url:
        out = asyncio.run(compare(url, other, args.users, args.batch, args.passes))
    print(f"this version ({out['versions']['this']}) against {args.against} ({out['versions']['other']}), "
          f"Redis CPU µs a call, medians over {out[OPS[0]]['batches']} batches of {args.batch}:")
    for op in OPS:
        got = out[op]
        print(f"  {op:14s} this {got['this_us']:7.2f}  other {got['other_us']:7.2f}  paired difference "
              f"{got['paired_difference_us']:+.2f} (IQR {got['difference_iqr_us'][0]:+.2f} .. "
              f"{got['difference_iqr_us'][1]:+.2f})")
    emit({"against": args.against, "users": args.users, "batch": args.batch, "passes": args.passes, **out},
         args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
