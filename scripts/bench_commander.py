"""Commander scale: a whole pass over a large fleet, decide() alone, and the report-ingest rate.

Pass: a simulated fleet on a private redis-server (``--workers`` registry entries with their
heartbeats, each a consumer of its tier's ready stream, over ``--tiers`` tiers, each with its
policy, and between two passes the occupancy reports of one worker in ``--report-every``: by
default the workers report every 5 s and the commander passes every 0.5 s, as their defaults
have it; 1 is a report of every worker every pass), served by a leading commander whose
runtime runs none of them; each of ``--passes`` passes (after warm-up ones: a whole cycle of
reports) is timed in the commander's CPU (its thread's), with the Redis commands it sent and
the commander's resident memory after them, its evaluator's windows full (a minute of rows
for every worker). decide(): one full pass of the pure decision over a synthetic fleet,
median and p95 (scripts/bench_decide.py). Ingest: the workers' reports written, then read by
the commander's Observer into its Evaluator; reports per second end to end (XREAD + decode +
window).
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import redis
from bench_decide import bench as bench_decide
from bench_monitor import Elsewhere, populate, reports, write_reports
from benchlib import MachineWatch, OneLineParser, emit, percentile, redis_server

from commander.commander import Commander, tune_gc
from commander.evaluator import WINDOW_ROWS
from commander.observe import Observer
from commander.settings import CommanderSettings
from protocol import keys
from protocol.codec import encode
from protocol.models import Counters, OccupancyReport, Slots
from protocol.policy import TurnsPolicy
from stores.connection import connect_sync

# passes between two reports of a worker, by default: its report interval over the commander's
REPORT_EVERY = round(TurnsPolicy().scale_rules().scaling.report_interval_s
                     / CommanderSettings.model_fields["interval_s"].default)


def parse_args(argv: list[str] | None = None):
    p = OneLineParser(prog="scripts/bench_commander", description=__doc__)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--tiers", type=int, default=20)
    p.add_argument("--rounds", type=int, default=20, help="reports per worker in the ingest test")
    p.add_argument("--passes", type=int, default=10, help="whole commander passes timed")
    p.add_argument("--report-every", type=int, default=REPORT_EVERY,
                   help="passes between two reports of a worker: a pass reads the reports of a "
                        "tenth of the workers by default (a report every 5 s, the policy's "
                        "default, and a pass every 0.5 s, the commander's); 1: every worker's, "
                        "every pass")
    p.add_argument("--gc", choices=("commander", "python"), default="commander",
                   help="the garbage collector's thresholds in the passes: the ones `fleet commander` "
                        "sets (commander.commander.GC_THRESHOLDS), or Python's own, to see what those buy")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.passes = 3, 3
    if min(args.workers, args.tiers, args.rounds, args.passes, args.report_every) < 1:
        p.error("--workers, --tiers, --rounds, --passes and --report-every must be positive")
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


def commands(r: redis.Redis) -> int:
    return int(r.info("stats")["total_commands_processed"])


class Collections:
    """The garbage collections made inside the timed passes: how many of each generation, and
    the thread's CPU they took (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.counting = False
        self.counts = [0, 0, 0]
        self.cpu_s = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not self.counting:
            return
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.counts[info["generation"]] += 1
            self.cpu_s += time.thread_time() - self._started

    def per_pass(self, passes: int) -> dict[str, object]:
        return {"thresholds": list(gc.get_threshold()),
                "collections_per_pass": {str(g): round(n / passes, 2) for g, n in enumerate(self.counts)},
                "cpu_ms_per_pass": round(self.cpu_s * 1000 / passes, 1)}


def whole_pass(url: str, workers: int, tiers: int, passes: int, every: int,
               collector: str = "commander") -> dict[str, object]:
    """A leading commander's passes over the simulated fleet, each after the reports of one
    worker in ``every``: CPU ms per pass (its thread's), Redis commands per pass, its memory,
    and what the garbage collector took of the passes (with the thresholds ``fleet commander``
    sets, or with Python's own: ``collector`` "python"). The commander's client is the one
    `fleet commander` builds (``connect_sync``)."""
    r = connect_sync(url, retries=2, socket_timeout=5, cluster="no")
    r.flushall()
    names = populate(r, workers, tiers, time.time())
    settings = CommanderSettings(commander_id="bench", metrics_port=None, always_tiers=(),
                                 lease_ttl_ms=600_000)
    if collector == "commander":
        tune_gc()  # as `fleet commander` does (and for the ingest test after this)
    cmd = Commander(r, Elsewhere(), settings)
    assert cmd.campaign()
    # the windows full, as a commander keeps them after a minute: the earlier reports are fed
    # to its evaluator in process (reading them through Redis would take minutes)
    start = time.time() - WINDOW_ROWS
    for rep in reports(names, workers, start, rows=WINDOW_ROWS - 1):
        cmd.observer.evaluator.add(rep)
    cpu, sent, collections = [], [], Collections()
    gc.callbacks.append(collections)
    # warm-up passes: the first reads the registry and policies cold, and until every worker has
    # sent a report (``every`` passes) the newest reports replace the windows' filled ones, which
    # carry no turn counts: the heap grows, and the collector walks it every other pass
    warm = max(2, every)
    for i in range(passes + warm):
        # a report of every ``every``-th worker, each with its turn counts grown by ten turns;
        # written by the workers in a real fleet, so no collection starts while they are written
        # here: one due is made by the pass, whose objects make it due, as in `fleet commander`
        gc.disable()
        try:
            write_reports(r, names, workers, time.time(), rows=1, turns=1000 + 10 * i,
                          every=every, phase=i % every)
        finally:
            gc.enable()
        before, start = commands(r), time.thread_time()
        collections.counting = i >= warm
        cmd.pass_once(time.time())
        elapsed = time.thread_time() - start
        collections.counting = False
        if not cmd.leading:
            raise SystemExit("bench_commander: the commander lost its lease")
        if i >= warm:
            cpu.append(elapsed * 1000)
            sent.append(commands(r) - before - 1)  # (less the INFO that read the counter)
    seen = cmd.board.seen
    judged = len(seen.tiers) if seen is not None else 0
    r.close()
    gc.callbacks.remove(collections)
    collected = collections.per_pass(passes)
    return {"workers": workers, "tiers": tiers, "tiers_judged": judged, "passes": passes,
            "reports_per_pass": len(range(0, workers, every)), "report_every_passes": every,
            "cpu_ms_per_pass": {"median": round(percentile(cpu, 50), 1), "p95": round(percentile(cpu, 95), 1),
                                "max": round(max(cpu), 1)},
            "redis_commands_per_pass": round(sum(sent) / len(sent), 1),
            "commander_rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1), "gc": collected}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    dec = bench_decide(workers=args.workers, tiers=args.tiers, repeats=5 if args.quick else 20)
    with redis_server() as url:
        whole = whole_pass(url, args.workers, args.tiers, args.passes, args.report_every, args.gc)
        ing = ingest(url, args.workers, args.tiers, args.rounds)
    out = {"pass": whole, "decide": dec, "ingest": ing}
    print(f"a whole pass: {whole['cpu_ms_per_pass']['median']} ms of commander CPU median "  # type: ignore[index]
          f"({whole['cpu_ms_per_pass']['p95']} ms p95), {whole['redis_commands_per_pass']} Redis commands, "  # type: ignore[index]
          f"commander RSS {whole['commander_rss_mb']} MB, over {args.workers} workers x {args.tiers} tiers, "
          f"{whole['reports_per_pass']} reports a pass")
    collected: dict[str, Any] = whole["gc"]  # type: ignore[assignment]
    which = "the commander's" if args.gc == "commander" else "Python's"
    print(f"  garbage collections in a pass: {collected['cpu_ms_per_pass']} ms of it, "
          f"{collected['collections_per_pass']} by generation ({which} garbage collector thresholds "
          f"{tuple(collected['thresholds'])})")
    print(f"decide(): {dec['median_ms']} ms median, {dec['p95_ms']} ms p95 per pass over "
          f"{args.workers} workers x {args.tiers} tiers")
    print(f"report ingest: {ing['reports_per_s']:,} reports/s "
          f"({ing['reports']} reports in {ing['seconds']} s)")
    emit(out, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
