"""Deferred jobs, measured on a private redis-server, in three phases:

1. relay: N deferrals of job ``noop`` sit committed in 100 users' outboxes with their
   notifications (written as ``turn_commit.lua`` and the worker write them); one relay
   (in-process) moves them into RQ: deferrals per second, enqueued once each.
2. rq workers: K ``fleet rq-worker`` processes drain those N jobs: jobs per second, from the
   first job started to the last one finished (RQ's own timestamps).
3. from zero: a commander (interval 0.2 s) runs an rq tier with ``min_workers=0``; a job is
   enqueued into its empty queue and the time until an RQ worker registers and until the job
   starts is measured (a fresh interpreter importing RQ: no fork template for RQ workers); then
   the tier goes back to zero before the next trial.
4. burst: B jobs of ``count`` (``sleep_s`` each) land at once in an rq tier (min 0, max M);
   its RQ workers and queue length are sampled every 0.1 s until it is back to zero: the
   worker-seconds it used, against a fixed pool of M workers (sized for the peak) over the same
   span, and with ``--plot`` a PNG of both curves (matplotlib, the bench extra).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from benchlib import ROOT, MachineWatch, OneLineParser, emit, redis_server, stop_processes

from protocol import keys
from protocol.codec import encode
from protocol.deferral import Deferral
from protocol.policy import rq_policy
from stores import outbox, rqjobs
from stores.policies import write_policy
from worker.rq.relay import Relay, RelaySettings

BENCH_Q = "benchq"
COLD_TIER = "coldq"
BURST_TIER = "burstq"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="scripts/bench_rq", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=2000, help="deferrals relayed and run (default 2000)")
    p.add_argument("--workers", type=int, default=2, help="RQ worker processes of phase 2 (default 2)")
    p.add_argument("--trials", type=int, default=3, help="from-zero trials of phase 3 (default 3)")
    p.add_argument("--burst", type=int, default=200, help="jobs of the burst phase (default 200)")
    p.add_argument("--job-s", type=float, default=0.05, help="seconds each burst job takes (default 0.05)")
    p.add_argument("--max-workers", type=int, default=4, help="the burst tier's max_workers (default 4)")
    p.add_argument("--plot", type=Path, help="write the burst phase's plot (PNG) here")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    if min(args.jobs, args.workers, args.trials, args.burst, args.max_workers) < 1 or args.job_s < 0:
        p.error("--jobs, --workers, --trials, --burst and --max-workers must be at least 1, --job-s >= 0")
    return args


def fill_outboxes(r: redis.Redis, n: int) -> None:
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        user = f"u{i % 100}"
        d = Deferral(name="noop", queue=BENCH_Q, user=user, turn_id=f"t{i}", index=0, ts=time.time())
        pipe.xadd(keys.outbox(user), {"job": d.job_id, "d": encode(d)})
        pipe.xadd(keys.OUTBOX_READY, {"user": user})
    pipe.execute()


def relay_phase(r: redis.Redis, n: int) -> dict[str, float]:
    fill_outboxes(r, n)
    relay = Relay(RelaySettings(relay_id="bench", block_ms=10, sweep_interval_s=3600), r=r)
    outbox.join_relay_group(r)
    start = time.perf_counter()
    while relay.stats.enqueued + relay.stats.duplicates < n:
        relay.step()
    took = time.perf_counter() - start
    assert rqjobs.queue_stats(r, BENCH_Q).queued == n, "each deferral once in RQ"
    return {"deferrals": n, "seconds": round(took, 3), "deferrals_per_s": round(n / took, 1)}


def env_for(url: str) -> dict[str, str]:
    return {**os.environ, "REDIS_URL": url, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def workers_phase(r: redis.Redis, url: str, n: int, k: int, log_dir: Path) -> dict[str, float]:
    argv = [sys.executable, "-m", "worker.rq.rq_worker", "--queues", BENCH_Q, "--name"]
    procs = [subprocess.Popen([*argv, f"b{i}"], env=env_for(url), stdout=(log_dir / f"rq-{i}.log").open("wb"),
                              stderr=subprocess.STDOUT) for i in range(k)]
    try:
        while rqjobs.queue_stats(r, BENCH_Q).finished < n:
            time.sleep(0.2)
    finally:
        stop_processes(procs)
    from rq.job import Job
    from rq.registry import FinishedJobRegistry

    reg = FinishedJobRegistry(queue=rqjobs.queue(r, BENCH_Q))
    jobs = [j for j in Job.fetch_many(reg.get_job_ids(), connection=r, serializer=rqjobs.JSONSerializer) if j]
    first = min(j.started_at for j in jobs if j.started_at)
    last = max(j.ended_at for j in jobs if j.ended_at)
    span = (last - first).total_seconds()
    return {"jobs": len(jobs), "workers": k, "seconds": round(span, 3),
            "jobs_per_s": round(len(jobs) / span, 1)}


def start_commander(r: redis.Redis, url: str, log_dir: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "commander", "--commander-id", "bench", "--no-metrics", "--interval", "0.2",
           "--log-dir", str(log_dir), "--stop-workers-on-exit"]
    commander = subprocess.Popen(cmd, env=env_for(url), stdout=(log_dir / "commander.log").open("wb"),
                                 stderr=subprocess.STDOUT)
    while not r.get(keys.LEADER):  # a leader first
        time.sleep(0.05)
    return commander


def cold_phase(r: redis.Redis, trials: int) -> dict[str, object]:
    registered, started = [], []
    for i in range(trials):
        while rqjobs.workers(r, COLD_TIER):  # back to zero first
            time.sleep(0.1)
        d = Deferral(name="noop", queue=COLD_TIER, user="cold", turn_id=f"c{i}", index=0, ts=time.time())
        t0 = time.time()
        rqjobs.enqueue(r, d)
        while not rqjobs.workers(r, COLD_TIER):
            time.sleep(0.01)
        registered.append(time.time() - t0)
        from rq.job import Job

        while True:
            job = Job.fetch(d.job_id, connection=r, serializer=rqjobs.JSONSerializer)
            if job.started_at is not None:
                started.append(job.started_at.timestamp() - t0)
                break
            time.sleep(0.01)
    return {"trials": trials, "to_worker_registered_s": [round(x, 3) for x in registered],
            "to_job_started_s": [round(x, 3) for x in started],
            "median_to_job_started_s": round(statistics.median(started), 3)}


def burst_phase(r: redis.Redis, args: argparse.Namespace) -> dict[str, object]:
    t0 = time.time()
    pipe_jobs = [Deferral(name="count", kwargs={"sleep_s": args.job_s}, queue=BURST_TIER, user=f"b{i % 50}",
                          turn_id=f"b{i}", index=0, ts=t0) for i in range(args.burst)]
    for d in pipe_jobs:
        rqjobs.enqueue(r, d)
    samples: list[tuple[float, int, int]] = []
    seen_work = False
    while time.time() - t0 < 300:
        n, q = len(rqjobs.workers(r, BURST_TIER)), rqjobs.queue_stats(r, BURST_TIER).queued
        samples.append((time.time() - t0, n, q))
        seen_work = seen_work or n > 0
        if seen_work and n == 0 and q == 0:
            break
        time.sleep(0.1)
    span = samples[-1][0]
    used = sum(a[1] * (b[0] - a[0]) for a, b in itertools.pairwise(samples))  # registered RQ workers
    drained = next(t for t, n, q in samples if q == 0 and t > 0)
    out: dict[str, object] = {
        "jobs": args.burst, "job_s": args.job_s, "max_workers": args.max_workers,
        "peak_workers": max(n for _, n, _ in samples), "queue_empty_after_s": round(drained, 2),
        "back_to_zero_after_s": round(span, 2), "worker_seconds": round(used, 1),
        "fixed_pool_worker_seconds": round(args.max_workers * span, 1),
        "work_seconds": round(args.burst * args.job_s, 1)}
    if args.plot:
        plot(samples, args, args.plot)
        out["plot"] = str(args.plot)
    return out


def plot(samples: list[tuple[float, int, int]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [s[0] for s in samples]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.step(ts, [s[1] for s in samples], where="post", label="rq tier's RQ workers (commander)")
    ax.axhline(args.max_workers, color="grey", linestyle="--",
               label=f"fixed pool for the peak ({args.max_workers})")
    ax.set_xlabel("seconds since the burst")
    ax.set_ylabel("workers")
    ax2 = ax.twinx()
    ax2.plot(ts, [s[2] for s in samples], color="tab:orange", alpha=0.6, label="queued jobs")
    ax2.set_ylabel("queued jobs")
    fig.legend(loc="center right", fontsize=8, bbox_to_anchor=(0.88, 0.6))
    ax.set_title(f"{args.burst} jobs x {args.job_s}s into an rq tier (min 0, max {args.max_workers})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    with redis_server() as url, tempfile.TemporaryDirectory(prefix="fleet-bench-rq-") as tmp:
        r = redis.Redis.from_url(url)
        result: dict[str, object] = {"relay": relay_phase(r, args.jobs),
                                     "rq_workers": workers_phase(r, url, args.jobs, args.workers, Path(tmp))}
        for tier, top in ((COLD_TIER, 1), (BURST_TIER, args.max_workers)):
            write_policy(r, tier, rq_policy(min_workers=0, max_workers=top, target_backlog_per_worker=10,
                                            scale_down_stabilization_s=1, drain_timeout_s=10))
        commander = start_commander(r, url, Path(tmp))
        try:
            result["from_zero"] = cold_phase(r, args.trials)
            result["burst"] = burst_phase(r, args)
        finally:
            stop_processes([commander], timeout=30)
        result["load"] = os.getloadavg()[0]
    emit(result, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
