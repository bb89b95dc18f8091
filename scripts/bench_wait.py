"""The latency cost of ``replica_acks`` (WAIT after the submit, the lane acquire and the turn commit) on a
Redis Cluster of 3 masters + 3 replicas on loopback.

The same load runs with ``replica_acks`` 0 and 1, interleaved (0, 1, 0, 1, ...: a drift of the
machine hits both alike), on one cluster and the same workers: each round, every one of
``--users`` fresh users sends ``--turns`` turns one after another (closed loop per user, all
users at once). Reported per setting: turns/s (turns over the rounds' time), p50/p99
submit->reply latency, and the ratios 1 : 0.

A reply is read on the master as soon as the commit ran, before its WAIT returns: what the
client sees is its submit's two WAITs (inbox entry, notification), one WAIT per lane acquire
and the commit WAIT of the user's previous turn (a lane stays held across a user's queued
turns: the next turn waits for it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import cluster_rig
import redis
from benchlib import ROOT, MachineWatch, OneLineParser, emit, percentile, stop_processes

from fleet.client import AsyncFleet
from protocol.policy import turns_policy
from stores.connection import connect_sync
from stores.policies import write_policy

REFRESH_S = 0.2  # the workers' policy refresh here: a new replica_acks applies within this


def interleaved_parser(prog: str, doc: str | None, users: int) -> OneLineParser:
    """The arguments of an interleaved benchmark on a cluster (this one, scripts/bench_shards)."""
    p = OneLineParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=users)
    p.add_argument("--turns", type=int, default=5, help="turns per user per round")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64, help="slots per worker")
    p.add_argument("--rounds", type=int, default=6, help="rounds in all (half of each setting), interleaved")
    p.add_argument("--url", help="an existing cluster's node (default: start a private 3+3 cluster)")
    p.add_argument("--quick", action="store_true", help="40 users x 3 turns, 2 rounds (smoke test)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p


def interleaved_args(p: OneLineParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse and check what :func:`interleaved_parser` declared (``--quick`` shrinks the load)."""
    args = p.parse_args(argv)
    if args.quick:
        args.users, args.turns, args.rounds = min(args.users, 40), min(args.turns, 3), 2
    if min(args.users, args.turns, args.workers, args.concurrency, args.rounds) < 1:
        p.error("--users, --turns, --workers, --concurrency and --rounds must be positive")
    if args.rounds % 2:
        p.error("--rounds must be even (as many with each setting)")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = interleaved_parser("scripts/bench_wait", __doc__, users=200)
    p.add_argument("--timeout-ms", type=int, default=100, help="replica_ack_timeout_ms")
    return interleaved_args(p, argv)


@contextmanager
def private_cluster(masters: int = 3) -> Iterator[str]:
    """A private cluster of ``masters`` masters + one replica each (scripts/cluster_rig.py, the
    tests' and chaos's rig: processes on free loopback ports, stopped by pid); yields one
    node's URL."""
    with tempfile.TemporaryDirectory(prefix="fleet-bench-wait-") as tmp:
        rig = cluster_rig.start_cluster(Path(tmp), masters=masters)
        try:
            yield rig.url
        finally:
            rig.stop()


@contextmanager
def cluster_workers(url: str, n: int, log_dir: Path,
                    fast_refresh: bool = True) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` workers of tier ``chat`` on ``url`` (a cluster's or a single node's), registered
    before it yields. ``fast_refresh``: they reread the policy every ``REFRESH_S`` and block
    200 ms on the ready stream, so a policy change applies at once; without, the workers'
    defaults (what a deployment's Redis serves)."""
    fast = {"FLEET_WORKER_BLOCK_MS": "200", "FLEET_WORKER_POLICY_REFRESH_S": str(REFRESH_S)}
    env = {**os.environ, "REDIS_URL": url, "PYTHONPATH": str(ROOT), **(fast if fast_refresh else {})}
    env.pop("FLEET_REDIS_CLUSTER", None)  # detected
    procs: list[subprocess.Popen[bytes]] = []
    r = connect_sync(url)
    try:
        for i in range(n):
            with (log_dir / f"worker-{i}.log").open("wb") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", "worker", "--tier", "chat",
                                               "--worker-id", f"chat-wait{i}", "--log-level", "WARNING"],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while r.hlen("fleet:workers") < n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"workers did not register (logs in {log_dir})")
            time.sleep(0.05)
        yield procs
    finally:
        stop_processes(procs, timeout=15)
        r.close()


async def one_round(fleet: AsyncFleet, users: list[str], turns: int) -> tuple[list[float], float]:
    latencies: list[float] = []

    async def user_loop(user: str) -> None:
        for i in range(turns):
            t0 = time.perf_counter()
            reply = await fleet.ask(user, f"turn {i}", timeout=60)
            latencies.append(time.perf_counter() - t0)
            if not reply.ok:
                raise RuntimeError(f"turn {i} of {user} failed: {reply.error}")

    t0 = time.perf_counter()
    await asyncio.gather(*(user_loop(u) for u in users))
    return latencies, time.perf_counter() - t0


def wait_calls(r: redis.RedisCluster) -> int:
    """WAIT commands the masters have served so far (INFO commandstats): proves each round ran
    with the setting it says."""
    total = 0
    for node in r.get_primaries():  # type: ignore[no-untyped-call]
        c = r.get_redis_connection(node)  # the node's client, with the cluster's credentials
        total += int(c.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
    return total


async def run(args: argparse.Namespace, url: str) -> dict[str, object]:
    r = connect_sync(url)
    fleet = AsyncFleet(url)
    lat: dict[int, list[float]] = {0: [], 1: []}
    spent: dict[int, float] = {0: 0.0, 1: 0.0}
    waits: dict[int, int] = {0: 0, 1: 0}
    assert isinstance(r, redis.RedisCluster), "--url must be a node of a Redis Cluster"
    try:
        for rnd in range(-1, args.rounds):  # round -1: a warm-up, not counted
            acks = max(rnd, 0) % 2
            write_policy(r, "chat", turns_policy(handler="echo", concurrency=args.concurrency,
                                                 replica_acks=acks, replica_ack_timeout_ms=args.timeout_ms))
            await asyncio.sleep(5 * REFRESH_S)  # every worker has read it
            fleet.reread_policies()  # and the client's submits take it at once
            users = [f"r{rnd}-u{i:04d}" for i in range(args.users)]
            before = wait_calls(r)
            got, elapsed = await one_round(fleet, users, args.turns)
            if rnd < 0:
                continue
            waited = wait_calls(r) - before
            lat[acks] += got
            spent[acks] += elapsed
            waits[acks] += waited
            print(f"  round {rnd + 1}/{args.rounds} replica_acks={acks}: {len(got)} turns in "
                  f"{elapsed:.2f} s, {waited} WAITs", file=sys.stderr, flush=True)
    finally:
        await fleet.aclose()
        r.close()
    ms = 1000.0
    out: dict[str, object] = {"users": args.users, "turns_per_user": args.turns, "workers": args.workers,
                              "concurrency": args.concurrency, "rounds": args.rounds,
                              "replica_ack_timeout_ms": args.timeout_ms, "handler": "echo",
                              "cluster": "3 masters + 3 replicas, loopback"}
    for acks in (0, 1):
        out[f"replica_acks_{acks}"] = {
            "turns": len(lat[acks]), "wait_commands": waits[acks],
            "turns_per_s": round(len(lat[acks]) / spent[acks], 1),
            "p50_ms": round(percentile(lat[acks], 50) * ms, 2),
            "p99_ms": round(percentile(lat[acks], 99) * ms, 2)}
    a0, a1 = out["replica_acks_0"], out["replica_acks_1"]
    assert isinstance(a0, dict) and isinstance(a1, dict)
    out["ratio_1_to_0"] = {k: round(a1[k] / a0[k], 3) if a0[k] else None
                           for k in ("turns_per_s", "p50_ms", "p99_ms")}
    return out


def shortfalls_logged(log_dir: Path) -> int:
    """WAITs that timed out short of their replicas, as the workers' last warnings count them
    (a warning at most every 10 s per worker, so a lower bound)."""
    total = 0
    for log in log_dir.glob("worker-*.log"):
        counts = [int(n) for n in re.findall(r"(\d+) such shortfalls", log.read_text(errors="replace"))]
        total += max(counts, default=0)
    return total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(private_cluster())
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-bench-wait-logs-")))
        stack.enter_context(cluster_workers(url, args.workers, log_dir))
        print(f"bench_wait: {args.workers} workers, {args.users} users x {args.turns} turns, "
              f"{args.rounds} rounds, replica_acks 0/1 interleaved", file=sys.stderr)
        result = asyncio.run(run(args, url))
        result["wait_shortfalls_logged"] = shortfalls_logged(log_dir)
    for acks in (0, 1):
        x = result[f"replica_acks_{acks}"]
        assert isinstance(x, dict)
        print(f"replica_acks={acks}: {x['turns_per_s']:,} turns/s  p50 {x['p50_ms']} ms  "
              f"p99 {x['p99_ms']} ms")
    ratio = result["ratio_1_to_0"]
    assert isinstance(ratio, dict)
    print(f"1 : 0  turns/s x{ratio['turns_per_s']}  p50 x{ratio['p50_ms']}  p99 x{ratio['p99_ms']}  "
          f"(WAITs short of their replica, logged: {result['wait_shortfalls_logged']})")
    emit(result, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
