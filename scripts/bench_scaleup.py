"""Scale-up reaction: from a turn the current workers cannot absorb to its reply by a new worker.

Each trial starts a clean tier with one worker whose single slot is held by a long turn,
then submits a probe turn. The submit finds no free slot and appends a pressure event; the
commander wakes on it, decides, spawns a worker, and the new worker serves the probe. The
figure is submit -> reply of the probe, with workers forked from the commander's
pre-imported template (``fork``) and started as fresh interpreters (``exec``). It also times
``decide()`` over 1,000 workers in 20 tiers (``scripts/bench_decide.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from bench_decide import bench as bench_decide
from benchlib import ROOT, MachineWatch, OneLineParser, emit, percentile, redis_server

from fleet.client import Fleet
from protocol import keys
from protocol.policy import turns_policy
from stores.policies import write_policy
from stores.registry import read_registry

POLICY = turns_policy(handler="sleep", handler_options={"sleep_ms": 0}, concurrency=1, min_workers=1,
                      max_workers=4, users_per_instance=None, target_backlog_per_worker=None,
                      report_interval_s=0.5, scale_down_stabilization_s=600, drain_timeout_s=1, max_step_up=1)


def parse_args(argv: list[str] | None = None):
    p = OneLineParser(prog="scripts/bench_scaleup", description=__doc__)
    p.add_argument("--trials", type=int, default=10, help="trials per spawn mode")
    p.add_argument("--modes", default="fork,exec", help="comma-separated: fork, exec")
    p.add_argument("--quick", action="store_true", help="2 trials per mode, small decide bench")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in ("fork", "exec") for m in args.modes) or not args.modes:
        p.error("--modes takes fork and/or exec")
    if args.quick:
        args.trials = min(args.trials, 2)
    if args.trials < 1:
        p.error("--trials must be positive")
    return args


def _live(r: redis.Redis) -> list[str]:
    return [info.worker for info in read_registry(r).live()]


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return value


def trial(url: str, mode: str, workdir: Path) -> float:
    """One clean trial; returns seconds from the probe's submit to its reply."""
    r = redis.Redis.from_url(url)
    r.flushall()
    write_policy(r, "chat", POLICY)
    env = {**os.environ, "REDIS_URL": url, "PYTHONPATH": str(ROOT)}
    with open(workdir / f"commander-{mode}.log", "ab") as log:
        cmd = subprocess.Popen([sys.executable, "-m", "commander", "--no-metrics", "--spawn-mode", mode,
                                "--log-dir", str(workdir / "logs"), "--stop-workers-on-exit"],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        first = _wait(lambda: _live(r), 30, "the first worker")[0]
        fleet = Fleet(url)
        fleet.submit("hog", "hold the only slot", meta={"sleep_ms": 30_000})
        _wait(lambda: r.get(keys.lane("hog")), 10, "the hog to hold its slot")
        time.sleep(1.2)  # let the commander see a settled tier (reports after its first pass)
        t0 = time.perf_counter()
        reply = fleet.submit("probe", "first turn of a burst").result(30)
        elapsed = time.perf_counter() - t0
        if not reply.ok or reply.worker == first:
            raise RuntimeError(f"probe not served by a new worker: {reply}")
        return elapsed
    finally:
        cmd.send_signal(signal.SIGTERM)
        cmd.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    results: dict[str, dict[str, float | int]] = {}
    with redis_server() as url, tempfile.TemporaryDirectory(prefix="fleet-scaleup-") as tmp:
        for mode in args.modes:
            times = []
            for i in range(args.trials):
                times.append(trial(url, mode, Path(tmp)))
                print(f"  {mode} trial {i + 1}/{args.trials}: {times[-1] * 1000:.0f} ms", file=sys.stderr,
                      flush=True)
            results[mode] = {"trials": len(times), "median_ms": round(percentile(times, 50) * 1000, 1),
                             "p95_ms": round(percentile(times, 95) * 1000, 1),
                             "min_ms": round(min(times) * 1000, 1), "max_ms": round(max(times) * 1000, 1)}
    dec = bench_decide(workers=1000 if not args.quick else 200, tiers=20, repeats=20 if not args.quick else 3)
    out = {"pressure_to_first_turn": results, "decide": dec}
    for mode, res in results.items():
        print(f"pressure -> first turn by a new worker ({mode}): median {res['median_ms']} ms, "
              f"p95 {res['p95_ms']} ms over {res['trials']} trials")
    print(f"decide(): {json.dumps(dec)}")
    emit(out, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
