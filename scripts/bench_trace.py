"""Autoscaling policies on the Azure LLM conversation trace, simulated; and the simulator checked
against a real fleet.

1. Comparison (simulated, the whole trace by default): Fleet's ``decide()`` with the default
   policy (only concurrency and max_workers set), static provisioning for the peak, an
   HPA-like and a KEDA-like policy, and the oracle (per-minute fewest workers that keep that
   minute's p99 wait <= 1 s, found by search with perfect foresight). The simulator is
   ``sim/scaling/simulate.py``; the policies ``sim/scaling/policies.py``.
2. Validation: one slice of the trace, sped up --speed times, simulated and replayed on a
   real fleet (private redis-server, ``python -m commander`` forking workers, ``fleet replay``
   submitting the turns for the ``sleep`` handler) with the same policy; its time constants
   (report interval, active window, down-stabilization) are divided by the speed too.

Users and service times come from ``sim/scaling/trace.py`` (see ``fleet replay --help``).
Writes ``trace.json``, ``trace.md`` (tables) and PNGs into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchlib import ROOT, OneLineParser, redis_server

from protocol.policy import Policy
from sim.scaling.policies import (
    FleetDecide,
    HpaLike,
    KedaLike,
    Static,
    oracle_schedule,
    peak_static_workers,
)
from sim.scaling.replay import ReplayResult, replay
from sim.scaling.simulate import SimConfig, SimResult, quantile, simulate
from sim.scaling.trace import TraceModel, TraceTurn, assign_users, read_trace, speed_up, window

TRACE_NAME = Path("shared") / "traces" / "azure_llm_conv_2023.csv"


def default_trace(root: Path = ROOT) -> Path:
    """The trace beside the repository, <repo>/../shared/traces (not in git), else in the
    nearest folder above that has shared/traces (a clone a level deeper, as CI may make);
    --trace or $FLEET_TRACE anywhere else."""
    for folder in root.parents:
        if (folder / TRACE_NAME).is_file():
            return folder / TRACE_NAME
    return root.parent / TRACE_NAME


DEFAULT_TRACE = default_trace()
SPAWN_DELAY = {"fork": 0.1, "exec": 0.35}
COLUMNS = [("policy", "policy"), ("p50_wait_s", "p50 wait s"), ("p99_wait_s", "p99 wait s"),
           ("max_wait_s", "max wait s"), ("slo_violations", "waits > SLO"),
           ("slo_violation_pct", "% > SLO"), ("worker_seconds", "worker-s"),
           ("mean_workers", "mean workers"), ("peak_workers", "peak"), ("scale_ups", "ups"),
           ("scale_downs", "downs")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="scripts/bench_trace", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=Path(os.environ.get("FLEET_TRACE", DEFAULT_TRACE)),
                   help="the Azure LLM conversation trace CSV (default: $FLEET_TRACE, else the nearest "
                        "shared/traces/azure_llm_conv_2023.csv above the repository)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-out")
    p.add_argument("--quick", action="store_true",
                   help="compare on the first 10 minutes; validate on 60 trace seconds")
    p.add_argument("--duration", type=float, default=None, help="compare on this many trace seconds")
    p.add_argument("--concurrency", type=int, default=8, help="slots per worker (every policy)")
    p.add_argument("--max-workers", type=int, default=32)
    p.add_argument("--service-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--speed", type=float, default=10.0, help="validation speed-up")
    p.add_argument("--val-start", type=float, default=600.0, help="validation slice start (trace s)")
    p.add_argument("--val-duration", type=float, default=300.0, help="validation slice (trace s)")
    p.add_argument("--spawn-mode", choices=sorted(SPAWN_DELAY), default="fork")
    p.add_argument("--no-validation", action="store_true", help="simulate only")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = args.duration or 600.0
        args.val_duration = min(args.val_duration, 60.0)
    if not args.trace.is_file():
        p.error(f"no trace at {args.trace} (--trace or $FLEET_TRACE)")
    if args.concurrency < 1 or args.max_workers < 1 or args.speed <= 0 or args.val_duration <= 0:
        p.error("--concurrency, --max-workers, --speed and --val-duration must be positive")
    return args


# --- the comparison --------------------------------------------------------------------
def fleet_policy(args: argparse.Namespace) -> Policy:
    """The default policy; only what a user sets: the handler, its concurrency, max_workers."""
    return Policy(handler="sleep", concurrency=args.concurrency, max_workers=args.max_workers)


def compare(turns: list[TraceTurn], args: argparse.Namespace) -> dict[str, SimResult]:
    policy = fleet_policy(args)
    cfg = SimConfig(concurrency=args.concurrency, spawn_delay_s=SPAWN_DELAY[args.spawn_mode],
                    view_policy=policy)
    peak = peak_static_workers(turns, args.concurrency)
    runs: dict[str, SimResult] = {}
    for pol in (FleetDecide(policy), Static(peak, name=f"static (peak: {peak})"),
                HpaLike(max_replicas=args.max_workers), KedaLike(max_replicas=args.max_workers,
                                                                 target_per_replica=0.75 * args.concurrency)):
        runs[pol.name] = simulate(turns, pol, cfg)
        print(f"  simulated {pol.name}: {runs[pol.name].runtime_s:.2f} s", file=sys.stderr, flush=True)
    started = time.perf_counter()
    schedule = oracle_schedule(turns, cfg, args.max_workers)
    search_s = time.perf_counter() - started
    runs["oracle"] = simulate(turns, schedule, replace(cfg, spawn_delay_s=0.0))
    runs["oracle"].runtime_s += search_s
    print(f"  oracle: search + run {runs['oracle'].runtime_s:.2f} s", file=sys.stderr, flush=True)
    return runs


# --- the validation --------------------------------------------------------------------
def validation_policy(args: argparse.Namespace) -> Policy:
    """The comparison's policy with its time constants divided by the speed-up."""
    base = fleet_policy(args)
    k = args.speed
    return base.model_copy(update={"report_interval_s": base.report_interval_s / k,
                                   "active_window_s": base.active_window_s / k,
                                   "scale_down_stabilization_s": base.scale_down_stabilization_s / k})


def _live(r: Any) -> int:
    from protocol import keys

    return sum(1 for w in r.hkeys(keys.WORKERS) if r.exists(keys.heartbeat(w.decode())))


def real_run(turns: list[TraceTurn], policy: Policy, args: argparse.Namespace) -> ReplayResult:
    """Replay ``turns`` (sped up) on a private redis-server with a real commander."""
    import redis

    from stores.policies import write_policy

    with redis_server() as url, tempfile.TemporaryDirectory(prefix="fleet-trace-") as tmp:
        r = redis.Redis.from_url(url)
        write_policy(r, "chat", policy)
        env = {**os.environ, "REDIS_URL": url, "PYTHONPATH": str(ROOT)}
        with open(Path(tmp) / "commander.log", "wb") as log:
            cmd = subprocess.Popen([sys.executable, "-m", "commander", "--no-metrics",
                                    "--stop-workers-on-exit", "--spawn-mode", args.spawn_mode,
                                    "--log-dir", str(Path(tmp) / "logs"), "--log-level", "WARNING"],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while _live(r) < max(1, policy.min_workers):
                if time.monotonic() > deadline or cmd.poll() is not None:
                    raise RuntimeError("the commander started no worker: "
                                       + (Path(tmp) / "commander.log").read_text()[-1000:])
                time.sleep(0.05)
            return asyncio.run(replay(url, turns, speed=args.speed, grace_s=max(10.0, 60 / args.speed)))
        finally:
            cmd.send_signal(signal.SIGTERM)
            try:
                cmd.wait(timeout=60)
            except subprocess.TimeoutExpired:
                cmd.kill()
                cmd.wait()


def validate(all_turns: list[TraceTurn], args: argparse.Namespace) -> dict[str, Any]:
    turns = speed_up(window(all_turns, args.val_start, args.val_duration), args.speed)
    policy = validation_policy(args)
    slo = 1.0 / args.speed
    cfg = SimConfig(concurrency=args.concurrency, spawn_delay_s=SPAWN_DELAY[args.spawn_mode],
                    view_policy=policy, slo_s=slo, sample_s=0.5)
    sim = simulate(turns, FleetDecide(policy), cfg)
    print(f"  validation: {len(turns)} turns over {turns[-1].at:.1f} s (x{args.speed:g}); replaying",
          file=sys.stderr, flush=True)
    real = real_run(turns, policy, args)
    sim_row = {**sim.summary(), "policy": "fleet (simulated)"}
    return {"turns": len(turns), "speed": args.speed, "slo_s": slo, "start_s": args.val_start,
            "duration_s": args.val_duration, "policy": policy.model_dump(mode="json"),
            "simulated": sim_row, "real": real.summary(slo), "sim_timeline": sim.timeline,
            "real_workers": real.workers,
            "real_waits": [(r.at, r.wait_s) for r in real.turns if r.ok],
            "sim_waits": list(zip(sim.arrivals, sim.waits, strict=True))}


# --- output ----------------------------------------------------------------------------
def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]] = COLUMNS) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"
    body = ["| " + " | ".join(str(row.get(key, "")) for key, _ in columns) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def per_minute_p99(arrivals: list[float], waits: list[float],
                   minute: float = 60.0) -> list[tuple[float, float]]:
    buckets: dict[int, list[float]] = {}
    for at, w in zip(arrivals, waits, strict=True):
        buckets.setdefault(int(at // minute), []).append(w if w == w else 1e9)
    return [((m + 0.5) * minute, quantile(v, 99)) for m, v in sorted(buckets.items())]


def plot_comparison(turns: list[TraceTurn], runs: dict[str, SimResult], concurrency: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    minutes = [t.at / 60 for t in turns]
    per_min: dict[int, int] = {}
    for m in minutes:
        per_min[int(m)] = per_min.get(int(m), 0) + 1
    ax1.bar([m + 0.5 for m in per_min], [n / 60 for n in per_min.values()], width=0.9, color="#bbb",
            label="arrivals/s (per minute)")
    ax1.set_ylabel("turns/s")
    need = [(s[0] / 60, s[4] / concurrency) for s in runs["oracle"].timeline]
    ax1b = ax1.twinx()
    ax1b.plot([x for x, _ in need], [y for _, y in need], lw=0.6, color="tab:red",
              label=f"turns in service / {concurrency} (oracle run)")
    ax1b.set_ylabel("worker-equivalents")
    ax1.legend(loc="upper left", fontsize=8)
    ax1b.legend(loc="upper right", fontsize=8)
    for name, run in runs.items():
        ax2.step([s[0] / 60 for s in run.timeline], [s[1] for s in run.timeline], where="post", lw=1,
                 label=name)
        p99 = per_minute_p99(run.arrivals, run.waits)
        ax3.plot([t / 60 for t, _ in p99], [max(v, 1e-3) for _, v in p99], marker=".", lw=0.8, label=name)
    ax2.set_ylabel("workers")
    ax2.legend(fontsize=8, ncol=3)
    ax3.set_yscale("log")
    ax3.axhline(1.0, color="k", ls=":", lw=0.8)
    ax3.set_ylabel("p99 wait per minute, s")
    ax3.set_xlabel("minutes into the trace")
    ax3.legend(fontsize=8, ncol=3)
    fig.suptitle("Azure LLM conversation trace: demand, workers and wait by policy (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_validation(val: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    sim = val["sim_timeline"]
    ax1.step([s[0] for s in sim], [s[1] for s in sim], where="post", label="simulated")
    ax1.step([t for t, _ in val["real_workers"]], [n for _, n in val["real_workers"]], where="post",
             label="real fleet")
    ax1.set_ylabel("workers")
    ax1.legend()
    ax2.scatter([a for a, _ in val["sim_waits"]], [max(w, 1e-4) for _, w in val["sim_waits"]], s=3,
                label="simulated")
    ax2.scatter([a for a, _ in val["real_waits"]], [max(w, 1e-4) for _, w in val["real_waits"]], s=3,
                label="real fleet")
    ax2.axhline(val["slo_s"], color="k", ls=":", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_ylabel("wait, s")
    ax2.set_xlabel(f"seconds (trace x{val['speed']:g})")
    ax2.legend()
    fig.suptitle("Validation: the same slice simulated and replayed on a real fleet")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(args: argparse.Namespace, turns: list[TraceTurn], runs: dict[str, SimResult],
             val: dict[str, Any] | None, model: TraceModel) -> str:
    span = turns[-1].at if turns else 0.0
    users = len({t.user for t in turns})
    mean_s = sum(t.service_s for t in turns) / max(1, len(turns))
    sim_s = sum(r.runtime_s for r in runs.values())
    lines = [
        "### Autoscaling on the Azure LLM conversation trace (simulated)", "",
        f"{len(turns):,} turns over {span / 60:.0f} min, {users:,} users (conversations: geometric, "
        f"mean {model.mean_turns:g} turns; think time {model.think_min_s:g} s + exponential, mean "
        f"{model.think_mean_s:g} s, after the previous reply). Service time = "
        f"{model.overhead_ms:g} ms + ContextTokens / {model.prefill_tokens_per_ms:g} tokens/ms + "
        f"GeneratedTokens x {model.decode_ms_per_token:g} ms (x{model.service_scale:g}): mean "
        f"{mean_s:.2f} s. Workers: {args.concurrency} slots each, spawn delay "
        f"{SPAWN_DELAY[args.spawn_mode] * 1000:.0f} ms ({args.spawn_mode}), max {args.max_workers}. "
        f"Wait = start of service - arrival; SLO: wait <= 1 s. Worker-seconds up to the last arrival. "
        f"All five simulations took {sim_s:.1f} s together.", "",
        table([r.summary() for r in runs.values()]), "",
        "fleet: `decide()` with the default policy (handler=sleep, concurrency, max_workers set). "
        "static: workers for the peak turns in service at zero wait. hpa: every 15 s, target slot "
        "utilization 0.7, tolerance 0.1, up <= max(2x, +4), 300 s down-stabilization. keda: every 30 s, "
        f"backlog (lag + pending) / {0.75 * args.concurrency:g} per replica, same tolerance and "
        "stabilization. oracle: per-minute fewest workers keeping that minute's p99 wait <= 1 s, "
        "perfect foresight, no spawn delay.", "",
        "![demand, workers and wait by policy](trace-comparison.png)", "",
    ]
    if val is not None:
        lines += [
            "### Validation: simulator vs a real fleet", "",
            f"Trace seconds {val['start_s']:g}-{val['start_s'] + val['duration_s']:g} ({val['turns']} turns) "
            f"at x{val['speed']:g}: service and inter-arrival times / {val['speed']:g}; the policy's "
            "report interval, active window and down-stabilization / the same factor. Real: private "
            "redis-server, `python -m commander` forking workers, `fleet replay`; waits in replay "
            f"seconds, SLO {val['slo_s']:g} s (= 1 trace second).", "",
            table([val["simulated"], val["real"]]), "",
            "![simulated vs real](trace-validation.png)", "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = TraceModel(service_scale=args.service_scale, seed=args.seed)
    started = time.perf_counter()
    all_turns = assign_users(read_trace(args.trace), model)
    turns = window(all_turns, 0.0, args.duration)
    print(f"bench_trace: {len(turns)} turns, {len({t.user for t in turns})} users "
          f"({time.perf_counter() - started:.1f} s to read and assign)", file=sys.stderr, flush=True)
    runs = compare(turns, args)
    val = None if args.no_validation else validate(all_turns, args)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_comparison(turns, runs, args.concurrency, args.out / "trace-comparison.png")
    if val is not None:
        plot_validation(val, args.out / "trace-validation.png")
    result = {"trace": Path(args.trace).name, "model": vars(model), "concurrency": args.concurrency,
              "max_workers": args.max_workers, "comparison": [r.summary() for r in runs.values()],
              "validation": None if val is None else {k: v for k, v in val.items()
                                                      if not k.endswith(("timeline", "workers", "waits"))}}
    (args.out / "trace.json").write_text(json.dumps(result, indent=2))
    (args.out / "trace.md").write_text(markdown(args, turns, runs, val, model) + "\n")
    print(table([r.summary() for r in runs.values()]))
    if val is not None:
        print(table([val["simulated"], val["real"]]))
    print(f"bench_trace: wrote {args.out}/trace.md, trace.json, PNGs in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
