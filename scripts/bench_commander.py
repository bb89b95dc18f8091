"""Commander scale: decide() over 1,000 workers in 20 tiers, and the report-ingest rate.

decide(): one full pass (every tier once) over a synthetic fleet, median and p95
(scripts/bench_decide.py). Ingest: 1,000 simulated workers' occupancy reports are written to
a private redis-server, then read by the commander's Observer into its Evaluator, the path
every pass takes; the figure is reports per second end to end (XREAD + decode + window).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import redis
from bench_decide import bench as bench_decide
from benchlib import MachineWatch, OneLineParser, emit, redis_server

from commander.observe import Observer
from protocol import keys
from protocol.codec import encode
from protocol.models import Counters, OccupancyReport, Slots


def parse_args(argv: list[str] | None = None):
    p = OneLineParser(prog="scripts/bench_commander", description=__doc__)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--tiers", type=int, default=20)
    p.add_argument("--rounds", type=int, default=20, help="reports per worker in the ingest test")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 3
    if min(args.workers, args.tiers, args.rounds) < 1:
        p.error("--workers, --tiers and --rounds must be positive")
    return args


def ingest(url: str, workers: int, tiers: int, rounds: int) -> dict[str, float]:
    r = redis.Redis.from_url(url)
    observer = Observer(r)
    observer.read_reports()  # start at the stream's end
    pipe = r.pipeline(transaction=False)
    for k in range(rounds):
        for w in range(workers):
            tier = f"t{w % tiers}"
            rep = OccupancyReport(worker=f"{tier}-w{w}", tier=tier, ts=1000.0 + k, state="ready", users=5,
                                  active_users=2, slots=Slots(busy=w % 8, total=8), cpu=0.3,
                                  rss=50_000_000, counters=Counters(turns=k * 10, handler_seconds=k * 1.5),
                                  load=(0.5, 0.5, 0.5))
            pipe.xadd(keys.REPORTS, {"m": encode(rep)})
        pipe.execute()
    start = time.perf_counter()
    n = observer.read_reports()
    elapsed = time.perf_counter() - start
    return {"reports": n, "seconds": round(elapsed, 3), "reports_per_s": round(n / elapsed)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    dec = bench_decide(workers=args.workers, tiers=args.tiers, repeats=5 if args.quick else 20)
    with redis_server() as url:
        ing = ingest(url, args.workers, args.tiers, args.rounds)
    out = {"decide": dec, "ingest": ing}
    print(f"decide(): {dec['median_ms']} ms median, {dec['p95_ms']} ms p95 per pass over "
          f"{args.workers} workers x {args.tiers} tiers")
    print(f"report ingest: {ing['reports_per_s']:,} reports/s "
          f"({ing['reports']} reports in {ing['seconds']} s)")
    emit(out, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
