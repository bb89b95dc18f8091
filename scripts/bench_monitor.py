"""The monitor's cost on the commander: CPU and bytes per page refresh (200 workers by default).

A private redis-server gets ``--workers`` registered workers (heartbeats, ``--rows`` occupancy
reports each: 60, a full evaluator window) over ``--tiers`` tiers, some ledger events and dead
letters. A real ``Commander`` (on a runtime that starts nothing: the workers are "elsewhere",
in the registry) runs its passes, so its board holds what a leader's does; the monitor is
served from this process on a loopback port, as the commander serves it. A client in another
process then makes ``--cycles`` refreshes, each after two new reports per worker and a new
pass (so nothing a refresh computed is reused by the next), of what the open page polls every
2 s (``/api/overview``: per-tier counts; ``/api/workers``: its first page, 100 workers; and one
``/api/history`` per tier, which the page reads every 5 s: counted at every refresh, an upper
bound). Neither of the first two grows with the workers, only with the tiers: ``--workers
10000 --tiers 50 --rows 2`` shows it at a large fleet's size without writing 600,000 reports.
This process's CPU time over those requests, divided by the refreshes, is the commander's CPU
per refresh (the commander's loop is not running meanwhile: nothing else spends CPU here).
Also reported: each endpoint's server time (its last call), the bytes of one refresh, and what
publishing the board costs a pass.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from benchlib import MachineWatch, OneLineParser, emit, free_port, redis_server

from commander.commander import Commander
from commander.metrics import Metrics
from commander.monitor.api import Monitor
from commander.monitor.board import Board
from commander.runtime import Handles, Runtime, UnknownWorker, WorkerIds
from commander.settings import CommanderSettings
from protocol import keys
from protocol.codec import encode
from protocol.models import (
    BUCKET_COUNT,
    Counters,
    OccupancyReport,
    Slots,
    TurnHistogram,
    TurnStats,
    WorkerInfo,
)
from protocol.policy import TurnsPolicy
from stores.policies import write_policy

CLIENT = r"""
import json, sys, time, urllib.request
base, tiers = sys.argv[1], sys.argv[2].split(",")
paths = ["/api/overview", "/api/workers"] + [f"/api/history?tier={t}" for t in tiers]
sizes = {}
for line in sys.stdin:  # one refresh per line, then "done" (the parent times each refresh)
    for p in paths:
        with urllib.request.urlopen(base + p, timeout=30) as resp:
            body = resp.read()
            assert resp.status == 200, (p, resp.status)
            sizes[p] = len(body)
    print(json.dumps(sizes), flush=True)
"""


class Elsewhere(Runtime):
    """Starts nothing: every worker runs elsewhere (the registry has them)."""

    name = "elsewhere"

    def spawn(self, tier: str, n: int = 1) -> WorkerIds:
        return []

    def retire(self, worker_id: str, reason: str = "", drain_timeout_s: float | None = None) -> None:
        raise UnknownWorker(worker_id)

    def reap(self) -> Handles:
        return []

    def adopt(self) -> Handles:
        return []

    def stop_all(self, timeout: float | None = None) -> Handles:
        return []

    def list(self) -> Handles:
        return []


def parse_args(argv: list[str] | None = None) -> Any:
    p = OneLineParser(prog="scripts/bench_monitor", description=__doc__)
    p.add_argument("--workers", type=int, default=200)
    p.add_argument("--tiers", type=int, default=2)
    p.add_argument("--cycles", type=int, default=50, help="page refreshes timed")
    p.add_argument("--rows", type=int, default=60,
                   help="occupancy reports per worker before the refreshes (60: a full evaluator window)")
    p.add_argument("--quick", action="store_true", help="20 workers, 5 refreshes")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.cycles = min(args.workers, 20), 5
    if min(args.workers, args.tiers, args.cycles, args.rows) < 1:
        p.error("--workers, --tiers, --cycles and --rows must be positive")
    return args


def populate(r: redis.Redis, workers: int, tiers: int, now: float) -> list[str]:
    """Registered workers, each a consumer of its tier's ready stream holding 0-7 notifications
    (``w % 8``: its jobs in progress), a policy per tier that keeps them all, dead letters. The
    entries say they renew every minute: they stand for workers that claim their notifications
    in time (a commander counts one idle past two renews as no job's), which these simulated
    ones never do."""
    names = [f"t{i}" for i in range(tiers)]
    per_tier = -(-workers // tiers)
    pipe = r.pipeline(transaction=False)
    for tier in names:
        write_policy(r, tier, TurnsPolicy(min_workers=per_tier, max_workers=per_tier, concurrency=8))
        pipe.xgroup_create(keys.ready(tier), keys.GROUP, id="0", mkstream=True)
    for w in range(workers):
        tier, wid = names[w % tiers], f"{names[w % tiers]}-w{w:04d}"
        info = WorkerInfo(worker=wid, tier=tier, pid=10_000 + w, host="bench", started=now - 3600,
                          handlers=["echo", "noop", "sleep"], renew_interval_s=60.0)
        pipe.hset(keys.WORKERS, wid, encode(info))
        pipe.incr(keys.WORKERS_VERSION)  # (as a worker registering does)
        pipe.set(keys.heartbeat(wid), "1", px=600_000)
        pipe.xgroup_createconsumer(keys.ready(tier), keys.GROUP, wid)
        for k in range(w % 8):
            pipe.xadd(keys.ready(tier), {"user": f"u{w}-{k}"})
        if w % 8:
            pipe.xreadgroup(keys.GROUP, wid, {keys.ready(tier): ">"}, count=w % 8)
    for i in range(50):
        pipe.xadd(keys.dead(names[i % tiers]), {"user": f"u{i}", "turn_id": f"t{i}", "reason": "max attempts",
                                                "worker": "x", "ts": str(now)})
    pipe.execute()
    return names


def turn_stats(turns: int) -> TurnStats:
    """A busy worker's cumulative turn counts after ``turns`` turns (histograms filled)."""
    def histogram(scale: float) -> TurnHistogram:
        counts = tuple((turns * (i + 1)) // 40 for i in range(BUCKET_COUNT))
        return TurnHistogram(counts=counts, sum=turns * scale)

    return TurnStats(ok=turns, error=turns // 100, dup=turns // 500, retries=turns // 50,
                     queue_wait=histogram(0.002), handler=histogram(0.4), latency=histogram(0.41))


def reports(names: list[str], workers: int, now: float, rows: int = 60, turns: int | None = None,
            every: int = 1, phase: int = 0) -> Iterator[OccupancyReport]:
    """``rows`` occupancy reports per worker, one a second up to ``now`` (60: a full window);
    with ``turns``, each carries its worker's turn counts, about ``turns`` and growing. Only
    the workers ``w`` with ``w % every == phase`` (by default all)."""
    tiers = len(names)
    for w in range(phase, workers, every):
        tier, wid = names[w % tiers], f"{names[w % tiers]}-w{w:04d}"
        for k in range(rows):
            stats = turn_stats(turns + 10 * k + w % 7) if turns is not None else TurnStats()
            yield OccupancyReport(worker=wid, tier=tier, ts=now - rows + k + 1, state="ready", users=5,
                                  active_users=2, slots=Slots(busy=(w + k) % 9, total=8), cpu=0.3,
                                  rss=50_000_000, counters=Counters(turns=k * 10, handler_seconds=k * 1.5),
                                  load=(0.5, 0.5, 0.5), turn_stats=stats)


def write_reports(r: redis.Redis, names: list[str], workers: int, now: float, rows: int = 60,
                  turns: int | None = None, every: int = 1, phase: int = 0) -> None:
    """:func:`reports`, written to the reports' stream."""
    pipe = r.pipeline(transaction=False)
    for i, rep in enumerate(reports(names, workers, now, rows, turns, every, phase)):
        pipe.xadd(keys.REPORTS, {"m": encode(rep)})
        if i % (20 * rows) == 0:
            pipe.execute()
    pipe.execute()


def commander(r: redis.Redis, names: list[str], workers: int,
              rows: int) -> tuple[Commander, dict[str, float]]:
    """A leading commander that read ``rows`` reports of every worker (written after
    its first pass: a new leader warms up from the newest few thousand only); the board's
    publish cost."""
    # its passes are run by hand, apart (12,000 reports are written between the first two, and
    # each refresh is timed between two): the default 3 s lease lapsed there on a loaded machine,
    # the monitor then answered 503 as a standby and the run died on a broken pipe
    settings = CommanderSettings(commander_id="bench", metrics_port=None, always_tiers=(),
                                 lease_ttl_ms=600_000)
    cmd = Commander(r, Elsewhere(), settings)
    assert cmd.campaign()
    cmd.pass_once(time.time())
    write_reports(r, names, workers, time.time(), rows=rows)
    for _ in range(2):
        cmd.pass_once(time.time())
    seen = cmd.board.seen
    assert seen is not None and seen.tiers, "the commander judged no tier"
    times = []
    for _ in range(20):  # on a board of its own: the commander's keeps the last pass
        board = Board()
        for tier in seen.tiers.values():
            board.tier(tier)
        start = time.perf_counter()
        board.publish(time.time(), seen.registry, cmd.observer.evaluator)
        times.append(time.perf_counter() - start)
    return cmd, {"board_publish_ms": round(statistics.median(times) * 1000, 3)}


def measure(url: str, workers: int, tiers: int, cycles: int, rows: int = 60) -> dict[str, Any]:
    r = redis.Redis.from_url(url)
    names = populate(r, workers, tiers, time.time())
    cmd, publish = commander(r, names, workers, rows)
    monitor = Monitor(board=cmd.board, leading=lambda: cmd.leading, commander_id="bench",
                      r=redis.Redis.from_url(url))
    metrics = Metrics()
    host, port = metrics.serve("127.0.0.1", free_port(), monitor=monitor)
    base = f"http://{host}:{port}"
    client = subprocess.Popen([sys.executable, "-c", CLIENT, base, ",".join(names)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert client.stdin is not None and client.stdout is not None
    cpu = wall = 0.0
    try:
        for cycle in range(cycles + 1):  # the first refresh warms up (imports, connections): not counted
            write_reports(r, names, workers, time.time(), rows=2)  # ~2 s of reports, as between refreshes
            cmd.pass_once(time.time())  # a new pass: nothing the last refresh computed is reused
            if not cmd.leading:
                raise SystemExit("bench_monitor: the commander lost its lease; the monitor would answer 503")
            cpu0, wall0 = time.process_time(), time.perf_counter()
            client.stdin.write("refresh\n")
            client.stdin.flush()
            done = client.stdout.readline()
            if cycle:
                cpu, wall = cpu + time.process_time() - cpu0, wall + time.perf_counter() - wall0
        timings = dict(monitor.timings)
    finally:
        client.stdin.close()
        client.wait(timeout=30)
        client.stdout.close()
        metrics.stop()
    sizes = json.loads(done)
    return {"workers": workers, "tiers": tiers, "cycles": cycles, "rows": rows,
            "requests_per_refresh": 2 + tiers,
            "overview_and_page_bytes": sizes["/api/overview"] + sizes["/api/workers"],
            "cpu_ms_per_refresh": round(cpu / cycles * 1000, 2),
            "wall_ms_per_refresh": round(wall / cycles * 1000, 2),
            "bytes_per_refresh": sum(sizes.values()), "bytes": sizes,
            "last_handler_ms": {p: round(v * 1000, 2) for p, v in timings.items()}, **publish}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    with redis_server() as url:
        out = measure(url, args.workers, args.tiers, args.cycles, args.rows)
    print(f"monitor refresh at {out['workers']} workers x {out['tiers']} tiers: "
          f"{out['cpu_ms_per_refresh']} ms CPU on the commander per refresh "
          f"({out['requests_per_refresh']} requests, {out['bytes_per_refresh']:,} bytes; "
          f"{out['wall_ms_per_refresh']} ms wall), over {out['cycles']} refreshes")
    print(f"overview + one page of workers: {out['overview_and_page_bytes']:,} bytes "
          "(the rest: the tier charts)")
    print(f"last call per endpoint (ms, server side): {out['last_handler_ms']}")
    print(f"publishing the board: {out['board_publish_ms']} ms per pass")
    emit(out, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
