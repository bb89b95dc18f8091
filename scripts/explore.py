"""Explore the data plane's schedules deterministically; on a violation, shrink it and say
how to replay it.

Each schedule runs the real worker and client code on a simulated Redis (fakeredis with
Fleet's Lua scripts) and a controlled event loop with virtual time (see sim/). Schedule i
of a run has seed S+i; its workload is drawn from the seed unless --workers/--users/--turns/
--concurrency fix it; --stop P makes clients cancel a share of their turns and give another
share deadlines. Strategies: random (uniform pick of the next ready callback), pct
(random task priorities with --depth priority changes: bounded preemptions), fifo (asyncio's
own order; only latencies and faults vary), sweep (systematic, preemption bound 1: every
single deviation from one FIFO run, in order).

Exit status 0 if every schedule held the invariants, 1 on a violation (the shrunk schedule is
written to --out and the replay command printed), 2 on a bad argument.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchlib import OneLineParser

from sim.explore import Outcome, Schedule, run
from sim.shrink import shrink
from sim.world import Workload

STRATEGIES = ("random", "pct", "fifo", "sweep")


def parse_args(argv: list[str] | None = None):
    p = OneLineParser(prog="scripts/explore", description=__doc__)
    p.add_argument("--schedules", type=int, default=200, help="how many schedules to run")
    p.add_argument("--seed", type=int, default=1, help="seed of the first schedule")
    p.add_argument("--strategy", choices=STRATEGIES, default="random")
    p.add_argument("--depth", type=int, default=3, help="pct: priority change points")
    p.add_argument("--workers", type=int)
    p.add_argument("--users", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--ready-shards", type=int, help="the tier's ready_shards (drawn: 1-3, sometimes "
                   "changed mid-run)")
    p.add_argument("--streamed", action="store_true", help="submit every turn as streamed: the checks "
                   "also read each turn's reply stream (chunks fenced, restarts, the end)")
    p.add_argument("--faults", type=int, default=3, help="at most this many faults per schedule")
    p.add_argument("--stop", type=float, default=0.0, help="the share of the clients' turns they stop: "
                   "half cancelled at a drawn moment, half given a drawn deadline (default: 0)")
    p.add_argument("--replay", help="a schedule file (or its JSON) to run once, exactly")
    p.add_argument("--no-shrink", action="store_true", help="report a violation as found")
    p.add_argument("--keep-going", action="store_true", help="count violations instead of stopping")
    p.add_argument("--out", type=Path, default=Path(".explore"), help="where failing schedules go")
    p.add_argument("--json", type=Path, help="also write the summary here")
    p.add_argument("--jobs", type=int, default=1, help="processes exploring side by side")
    args = p.parse_args(argv)
    for name in ("schedules", "workers", "users", "turns", "concurrency", "ready_shards"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    if args.faults < 0 or args.depth < 0:
        p.error("--faults and --depth must not be negative")
    return args


def workload(args, seed: int) -> Workload:
    drawn = Workload.draw(random.Random(seed))
    fixed = {k: getattr(args, k) for k in ("workers", "users", "turns", "concurrency", "ready_shards",
                                           "streamed") if getattr(args, k)}
    return replace(drawn, **fixed, stop=args.stop)


def schedules(args):
    """The schedules of this run, in order."""
    if args.strategy != "sweep":
        for i in range(args.schedules):
            seed = args.seed + i
            yield Schedule(seed=seed, workload=workload(args, seed), strategy=args.strategy,
                           depth=args.depth, max_faults=args.faults)
        return
    base = run(Schedule(seed=args.seed, workload=workload(args, args.seed), strategy="fifo",
                        max_faults=args.faults))
    yield base.schedule
    made = 1
    for step, ready in base.branches:
        for alt in range(1, ready):
            if made >= args.schedules:
                return
            made += 1
            yield replace(base.schedule, choices={step: alt})


def report_failure(args, outcome: Outcome) -> None:
    print(f"\nVIOLATION in schedule seed={outcome.schedule.seed}:", flush=True)
    for v in outcome.violations[:10]:
        print(f"  {v}")
    if not args.no_shrink:
        print("shrinking...", flush=True)
        outcome = shrink(outcome, progress=lambda m: print(f"  {m}", flush=True))
        print("minimal schedule:")
        for v in outcome.violations[:10]:
            print(f"  {v}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fail-{outcome.schedule.seed}.json"
    path.write_text(outcome.schedule.to_json() + "\n")
    s = outcome.schedule
    print(f"  faults: {s.faults}\n  non-FIFO choices: {len(s.choices or {})}  workload: {s.workload}")
    print(f"replay: scripts/explore --replay {path}")


def replay(args) -> int:
    text = args.replay
    if not text.lstrip().startswith("{"):
        text = Path(text).read_text()
    outcome = run(Schedule.from_json(text))
    print(f"replayed seed={outcome.schedule.seed}: {outcome.steps} steps, {outcome.virtual_s:.1f} s virtual, "
          f"{outcome.commands} Redis commands, faults {outcome.schedule.faults}")
    for v in outcome.violations:
        print(f"  {v}")
    print("invariants hold" if outcome.ok else f"{len(outcome.violations)} violations")
    return 0 if outcome.ok else 1


CHUNK = 4  # schedules handed to a worker process at a time
RECYCLE = 200  # schedules a worker process runs before it is replaced


def _run_one(text: str) -> Outcome:
    return run(Schedule.from_json(text))


def outcomes(args):
    """Each schedule's outcome, in order: in this process, or in ``--jobs`` processes."""
    if args.jobs == 1:
        yield from map(run, schedules(args))
        return
    # a process is replaced after RECYCLE schedules: each leaves ~1 MB behind (fakeredis and
    # Lua runtimes), which over a 20,000-schedule run would grow each process past 10 GB
    with multiprocessing.get_context("fork").Pool(args.jobs, maxtasksperchild=RECYCLE // CHUNK) as pool:
        yield from pool.imap(_run_one, (s.to_json() for s in schedules(args)), chunksize=CHUNK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replay:
        return replay(args)
    t0 = last = time.monotonic()
    done = failed = steps = faults = 0
    virtual = 0.0
    wait_all: list[float] = []
    for outcome in outcomes(args):
        done += 1
        steps += outcome.steps
        virtual += outcome.virtual_s
        faults += len(outcome.schedule.faults or [])
        wait_all += outcome.waits
        if not outcome.ok:
            failed += 1
            report_failure(args, outcome)
            if not args.keep_going:
                break
        if time.monotonic() - last > 10:
            last = time.monotonic()
            print(f"  {done}/{args.schedules} schedules, {done / (last - t0) * 60:.0f}/min, "
                  f"{failed} failing", flush=True)
    return summarize(args, done, failed, steps, virtual, faults, wait_all, time.monotonic() - t0)


def summarize(args, done: int, failed: int, steps: int, virtual: float, faults: int,
              wait_all: list[float], elapsed: float) -> int:
    wait_all.sort()
    summary = {"schedules": done, "failing": failed, "strategy": args.strategy, "seed": args.seed,
               "jobs": args.jobs, "seconds": round(elapsed, 1),
               "per_minute": round(done / elapsed * 60, 1) if elapsed else None,
               "steps": steps, "virtual_seconds": round(virtual, 1), "faults": faults,
               "turn_wait_p99_s": round(wait_all[int(0.99 * (len(wait_all) - 1))], 3) if wait_all else None,
               "turn_wait_max_s": round(wait_all[-1], 3) if wait_all else None}
    seeds = (f"seed {args.seed}: one FIFO run and its single deviations" if args.strategy == "sweep"
             else f"seeds {args.seed}..{args.seed + done - 1}")
    print(f"explored {done} schedules ({args.strategy}, {seeds}, "
          f"{args.jobs} jobs) in {elapsed:.1f}s: {summary['per_minute']}/min, {steps} steps, "
          f"{virtual:.0f} s virtual, {faults} faults; {failed} failing")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if failed else 0


def _pin_hash_seed() -> None:
    """Run under PYTHONHASHSEED=0: the order of a set of strings follows the hash seed, and
    the workers' and the commander's sets (lanes taken over, live consumers) take part in the
    schedule, so a seed replays exactly only under the same hash seed. ./scripts/test runs the
    suite's schedules under 0 too. An explicit PYTHONHASHSEED is kept (and printed)."""
    if "PYTHONHASHSEED" not in os.environ:
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    if os.environ["PYTHONHASHSEED"] != "0":
        print(f"explore: PYTHONHASHSEED={os.environ['PYTHONHASHSEED']} (replays need the same)",
              file=sys.stderr)


if __name__ == "__main__":
    _pin_hash_seed()
    sys.exit(main())
