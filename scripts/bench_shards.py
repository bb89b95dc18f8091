"""One tier on ``ready_shards`` 1 vs 3, on a Redis Cluster of 3 masters + 3 replicas on
loopback: does spreading a tier's ready stream spread its Redis load?

The same load runs with ``ready_shards`` 1 and 3, interleaved (1, 3, 1, 3, ...: a drift of the
machine hits both alike), on one cluster and the same workers: each round, every one of
``--users`` fresh users sends ``--turns`` turns one after another, all users at once.
Reported per setting: turns/s, p50/p99 submit->reply latency, and each master's CPU time per
turn (``INFO cpu`` deltas). On this 2-core machine the workers and clients, not Redis, limit
turns/s, so the figure that says what sharding buys is the **hottest master's CPU per turn**:
its inverse is the tier's ceiling on these Redis processes (a master is one thread), and the
ratio of the two ceilings is the speed-up once the cores are not the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from pathlib import Path

import redis
from bench_wait import (
    REFRESH_S,
    cluster_workers,
    interleaved_args,
    interleaved_parser,
    one_round,
    private_cluster,
)
from benchlib import MachineWatch, emit, percentile

from fleet.client import AsyncFleet
from protocol.policy import TurnsPolicy
from stores.connection import connect_sync
from stores.policies import write_policy

SETTINGS = (1, 3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return interleaved_args(interleaved_parser("scripts/bench_shards", __doc__, users=300), argv)


def masters_cpu(r: redis.RedisCluster) -> dict[str, float]:
    """CPU seconds (user + sys) each master has used so far, by ``host:port``."""
    return {node: seconds for node, (seconds, _cmds) in masters_stats(r).items()}


Commands = dict[str, tuple[int, int]]  # command -> (calls, usec), from INFO commandstats


def masters_stats(r: redis.RedisCluster) -> dict[str, tuple[float, Commands]]:
    """Per master (``host:port``): the CPU seconds it has used so far and its commandstats."""
    out = {}
    for node in r.get_primaries():  # type: ignore[no-untyped-call]
        c = r.get_redis_connection(node)  # the node's client, with the cluster's credentials
        cpu = c.info("cpu")
        stats = c.info("commandstats")
        cmds = {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
                for name, v in stats.items()}
        out[f"{node.host}:{node.port}"] = (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), cmds)
    return out


def commands_delta(before: Commands, after: Commands) -> Commands:
    return {name: (calls - before.get(name, (0, 0))[0], usec - before.get(name, (0, 0))[1])
            for name, (calls, usec) in after.items() if calls != before.get(name, (0, 0))[0]}


def top_commands(cmds: Commands, turns: int, n: int = 8) -> dict[str, dict[str, float]]:
    """The ``n`` commands that took a master longest, per turn: calls and microseconds."""
    ranked = sorted(cmds.items(), key=lambda kv: -kv[1][1])[:n]
    return {name: {"calls_per_turn": round(calls / turns, 2), "us_per_turn": round(usec / turns, 1)}
            for name, (calls, usec) in ranked}


async def run(args: argparse.Namespace, url: str) -> dict[str, object]:
    r = connect_sync(url)
    assert isinstance(r, redis.RedisCluster), "--url must be a node of a Redis Cluster"
    fleet = AsyncFleet(url)
    lat: dict[int, list[float]] = {n: [] for n in SETTINGS}
    spent = dict.fromkeys(SETTINGS, 0.0)
    cpu: dict[int, dict[str, float]] = {n: {} for n in SETTINGS}
    cmds: dict[int, dict[str, Commands]] = {n: {} for n in SETTINGS}
    try:
        for rnd in range(-2, args.rounds):  # rounds -2, -1: a warm-up of each, not counted
            shards = SETTINGS[rnd % 2]
            write_policy(r, "chat",
                         TurnsPolicy(handler="echo", concurrency=args.concurrency, ready_shards=shards))
            await asyncio.sleep(max(5 * REFRESH_S, 6.0))  # workers and the client's 5 s cache have it
            users = [f"r{rnd}-u{i:04d}" for i in range(args.users)]
            before = masters_stats(r)
            got, elapsed = await one_round(fleet, users, args.turns)
            after = masters_stats(r)
            if rnd < 0:
                continue
            lat[shards] += got
            spent[shards] += elapsed
            for node, (seconds, now) in after.items():
                was_cpu, was_cmds = before.get(node, (seconds, now))
                cpu[shards][node] = cpu[shards].get(node, 0.0) + seconds - was_cpu
                acc = cmds[shards].setdefault(node, {})
                for name, (calls, usec) in commands_delta(was_cmds, now).items():
                    c0, u0 = acc.get(name, (0, 0))
                    acc[name] = (c0 + calls, u0 + usec)
            print(f"  round {rnd + 1}/{args.rounds} ready_shards={shards}: {len(got)} turns in "
                  f"{elapsed:.2f} s", file=sys.stderr, flush=True)
    finally:
        await fleet.aclose()
        r.close()
    out: dict[str, object] = {"users": args.users, "turns_per_user": args.turns, "workers": args.workers,
                              "concurrency": args.concurrency, "rounds": args.rounds, "handler": "echo",
                              "cluster": "3 masters + 3 replicas, loopback"}
    for n in SETTINGS:
        turns = len(lat[n])
        per_turn_us = {node: round(s / turns * 1e6, 1) for node, s in sorted(cpu[n].items())}
        hottest = max(per_turn_us.values())
        hot_node = max(per_turn_us, key=lambda k: per_turn_us[k])
        out[f"ready_shards_{n}"] = {
            "turns": turns, "turns_per_s": round(turns / spent[n], 1),
            "p50_ms": round(percentile(lat[n], 50) * 1000, 2),
            "p99_ms": round(percentile(lat[n], 99) * 1000, 2),
            "master_cpu_us_per_turn": per_turn_us, "hottest_master_cpu_us_per_turn": hottest,
            "ceiling_turns_per_s": round(1e6 / hottest, 0) if hottest else None,
            "hottest_master_top_commands": top_commands(cmds[n].get(hot_node, {}), turns) if turns else {}}
    one, three = out["ready_shards_1"], out["ready_shards_3"]
    assert isinstance(one, dict) and isinstance(three, dict)
    out["ratio_3_to_1"] = {k: round(three[k] / one[k], 3) if one[k] else None
                           for k in ("turns_per_s", "p50_ms", "p99_ms", "ceiling_turns_per_s")}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(private_cluster())
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-bench-shards-logs-")))
        stack.enter_context(cluster_workers(url, args.workers, log_dir))
        print(f"bench_shards: {args.workers} workers, {args.users} users x {args.turns} turns, "
              f"{args.rounds} rounds, ready_shards 1/3 interleaved", file=sys.stderr)
        result = asyncio.run(run(args, url))
    for n in SETTINGS:
        x = result[f"ready_shards_{n}"]
        assert isinstance(x, dict)
        print(f"ready_shards={n}: {x['turns_per_s']:,} turns/s  p50 {x['p50_ms']} ms  p99 {x['p99_ms']} ms  "
              f"hottest master {x['hottest_master_cpu_us_per_turn']} us/turn "
              f"(ceiling {x['ceiling_turns_per_s']:,.0f} turns/s); per master {x['master_cpu_us_per_turn']}")
        top = x["hottest_master_top_commands"]
        assert isinstance(top, dict)
        print("    its commands per turn (calls, us): " + ", ".join(
            f"{name} {c['calls_per_turn']:g}/{c['us_per_turn']:g}" for name, c in top.items()))
    ratio = result["ratio_3_to_1"]
    assert isinstance(ratio, dict)
    print(f"3 : 1  turns/s x{ratio['turns_per_s']}  ceiling x{ratio['ceiling_turns_per_s']}  "
          f"p50 x{ratio['p50_ms']}  p99 x{ratio['p99_ms']}")
    emit(result, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
