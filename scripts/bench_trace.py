"""Autoscaling policies on one trace, simulated; and the simulator checked against a real fleet.

1. Comparison (simulated, the whole trace by default): Fleet's ``decide()`` with the default
   policy (the sleep handler, --concurrency, --max-workers, and any field of --policy FILE),
   static provisioning for the peak, an HPA-like and a KEDA-like policy, and the oracle (per
   --oracle-step-s, the fewest workers that keep that step's --oracle-quantile wait <= the
   SLO, found by search with perfect foresight). The simulator is
   ``sim/scaling/simulate.py``; the policies ``sim/scaling/policies.py`` and
   ``sim/scaling/compare.py``.
2. Validation: one slice of the trace, sped up --speed times, simulated and replayed on a
   real fleet (private redis-server, ``python -m commander`` forking workers, ``fleet replay``
   submitting the turns for the ``sleep`` handler) with the same policy; its time constants
   (report interval, active window, target wait, scale-in hold) are divided by the speed too.

Any trace: --trace takes a CSV, TSV or JSON-lines file (``sim/scaling/tracefile.py``: columns
by --columns ts=...,in=...,out=...[,count=...][,user=...] or by their usual names; ISO
timestamps with T/Z/offsets, naive ones read in --tz; numbers in --ts-unit, offsets from
--start when below 10^9 s; a BOM; rate-only rows turned into that many seeded uniform arrivals
per window), or gen:KIND[:SEED[:SECONDS]] for generated traffic (``sim/scaling/generate.py``).
Users: conversations of a geometric number of turns (--mean-turns) with a think time
(--think-min-s + exponential, mean --think-mean-s) after each reply, unless the trace names
its users; service times from --service-model (``sim/scaling/service.py``).
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchlib import ROOT, OneLineParser, redis_server

from protocol.policy import PolicyError, TurnsPolicy, turns_policy
from sim.scaling.compare import Setup, compare
from sim.scaling.compare import rows as comparison_rows
from sim.scaling.generate import generate, parse_generated
from sim.scaling.policies import FleetDecide
from sim.scaling.replay import ReplayResult, replay
from sim.scaling.service import parse_service
from sim.scaling.simulate import SimConfig, SimResult, quantile, simulate
from sim.scaling.trace import TraceModel, TraceTurn, assign_users, speed_up, window
from sim.scaling.tracefile import Trace, TraceSource, parse_columns, parse_iso, read_trace_file, zone
from stores.registry import read_registry

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


def _add_trace_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the trace")
    g.add_argument("--trace", default=os.environ.get("FLEET_TRACE", str(DEFAULT_TRACE)),
                   help="a CSV/TSV/JSON-lines trace, or gen:KIND[:SEED[:SECONDS]] (default: $FLEET_TRACE, "
                        "else the nearest shared/traces/azure_llm_conv_2023.csv above the repository)")
    g.add_argument("--name", default=None, help="the trace's name in titles (default: the file's stem)")
    g.add_argument("--columns", default="", help="ts=COL,in=COL,out=COL[,count=COL][,user=COL]")
    g.add_argument("--ts-unit", choices=["auto", "s", "ms", "us"], default="auto",
                   help="numeric timestamps (auto: ms in JSON lines, s in CSV)")
    g.add_argument("--tz", default="UTC", help="time zone of naive timestamps (IANA name)")
    g.add_argument("--start", default="0",
                   help="unix seconds or ISO time that relative timestamps count from")
    g.add_argument("--window-s", type=float, default=None, help="a rate-only trace's window (default: "
                   "the median gap between rows)")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("users and service times")
    g.add_argument("--mean-turns", type=float, default=3.5)
    g.add_argument("--think-mean-s", type=float, default=20.0)
    g.add_argument("--think-min-s", type=float, default=2.0)
    g.add_argument("--service-model", default="tokens",
                   help="tokens | const:S | lognormal:MEDIAN,SIGMA[,CAP] | pareto:MIN,ALPHA[,CAP]")
    g.add_argument("--overhead-ms", type=float, default=50.0)
    g.add_argument("--prefill-tokens-per-ms", type=float, default=5.0)
    g.add_argument("--decode-ms-per-token", type=float, default=25.0)
    g.add_argument("--service-scale", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=7)


def _add_policy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the tier and the goals")
    g.add_argument("--policy", type=Path, default=None, help="a JSON file of policy fields over the default")
    g.add_argument("--concurrency", type=int, default=8, help="slots per worker (every policy)")
    g.add_argument("--max-workers", type=int, default=32)
    g.add_argument("--spawn-mode", choices=sorted(SPAWN_DELAY), default="fork")
    g.add_argument("--spawn-delay-s", type=float, default=None, help="a start time (overrides --spawn-mode)")
    g.add_argument("--slo-s", type=float, default=1.0, help="a wait over this misses the SLO")
    g.add_argument("--oracle-quantile", type=float, default=99.0, help="the oracle keeps this wait quantile")
    g.add_argument("--oracle-step-s", type=float, default=60.0, help="... <= the SLO in every step this long")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="scripts/bench_trace", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_trace_flags(p)
    _add_model_flags(p)
    _add_policy_flags(p)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-out")
    p.add_argument("--quick", action="store_true",
                   help="compare on the first 10 minutes; validate on 60 trace seconds")
    p.add_argument("--duration", type=float, default=None, help="compare on this many trace seconds")
    p.add_argument("--speed", type=float, default=10.0, help="validation speed-up")
    p.add_argument("--val-start", type=float, default=600.0, help="validation slice start (trace s)")
    p.add_argument("--val-duration", type=float, default=300.0, help="validation slice (trace s)")
    p.add_argument("--no-validation", action="store_true", help="simulate only")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = args.duration or 600.0
        args.val_duration = min(args.val_duration, 60.0)
    if not str(args.trace).startswith("gen:") and not Path(args.trace).is_file():
        p.error(f"no trace at {args.trace} (--trace or $FLEET_TRACE)")
    if args.concurrency < 1 or args.max_workers < 1 or args.speed <= 0 or args.val_duration <= 0 \
            or args.slo_s <= 0 or not 0 < args.oracle_quantile <= 100 or args.oracle_step_s <= 0:
        p.error("--concurrency, --max-workers, --speed, --val-duration, --slo-s and --oracle-step-s must "
                "be positive, --oracle-quantile in (0, 100]")
    try:
        args.fleet_policy = fleet_policy(args)
        args.model = trace_model(args)
    except (ValueError, PolicyError, OSError) as exc:
        p.error(str(exc))
    return args


def trace_model(args: argparse.Namespace) -> TraceModel:
    """The user and service-time model of the flags."""
    return TraceModel(mean_turns=args.mean_turns, think_mean_s=args.think_mean_s,
                      think_min_s=args.think_min_s, overhead_ms=args.overhead_ms,
                      prefill_tokens_per_ms=args.prefill_tokens_per_ms,
                      decode_ms_per_token=args.decode_ms_per_token, service_scale=args.service_scale,
                      seed=args.seed, service=parse_service(args.service_model))


def load_trace(args: argparse.Namespace) -> Trace:
    """The trace of --trace with the reading flags (a generated one for gen:...)."""
    if str(args.trace).startswith("gen:"):
        kind, seed, duration = parse_generated(args.trace)
        trace = generate(kind, seed, duration or 3600.0)
    else:
        numeric = args.start.replace(".", "", 1).isdigit()
        start = float(args.start) if numeric else parse_iso(args.start, zone(args.tz))
        trace = read_trace_file(TraceSource(Path(args.trace), parse_columns(args.columns), args.ts_unit,
                                            args.tz, start, args.window_s, args.seed, args.name))
    if args.name:
        trace = Trace(args.name, trace.requests, trace.has_lengths, trace.arrivals)
    if not trace.has_lengths and args.model.service.needs_lengths:
        raise ValueError(f"{trace.name} has no input/output lengths: pick --service-model const:S, "
                         "lognormal:... or pareto:...")
    if not trace.requests:
        raise ValueError(f"{trace.name} has no requests")
    return trace


# --- the comparison --------------------------------------------------------------------
def fleet_policy(args: argparse.Namespace) -> TurnsPolicy:
    """The default policy with what a user sets: the handler, concurrency, max_workers, and every
    field of --policy FILE (a turns policy, in either layout, validated as a whole)."""
    fields: dict[str, Any] = {}
    if args.policy is not None:
        fields = json.loads(args.policy.read_text())
        if not isinstance(fields, dict):
            raise ValueError(f"{args.policy}: a policy file is a JSON object")
    return turns_policy(handler="sleep", concurrency=args.concurrency, max_workers=args.max_workers, **fields)


def setup_of(args: argparse.Namespace, trace: Trace) -> Setup:
    delay = args.spawn_delay_s if args.spawn_delay_s is not None else SPAWN_DELAY[args.spawn_mode]
    return Setup(policy=args.fleet_policy, spawn_delay_s=delay, slo_s=args.slo_s,
                 oracle_quantile=args.oracle_quantile, oracle_step_s=args.oracle_step_s, epoch=trace.epoch)


# --- the validation --------------------------------------------------------------------
def validation_policy(args: argparse.Namespace) -> TurnsPolicy:
    """The comparison's policy with its time constants divided by the speed-up."""
    base: TurnsPolicy = args.fleet_policy
    k, scaling = args.speed, base.scaling
    hold = scaling.scale_in_hold
    update: dict[str, Any] = {
        "report_interval_s": scaling.report_interval_s / k, "active_window_s": scaling.active_window_s / k,
        "target_wait_s": scaling.target_wait_s / k,
        "scale_in_hold": {"min_s": hold.min_s / k, "max_s": hold.max_s / k,
                          "unmeasured_s": hold.unmeasured_s / k}}
    if scaling.scale_down_stabilization_s is not None:
        update["scale_down_stabilization_s"] = scaling.scale_down_stabilization_s / k
    return turns_policy(base, **update)


def _live(r: Any) -> int:
    return len(read_registry(r).live())


def real_run(turns: list[TraceTurn], policy: TurnsPolicy, args: argparse.Namespace) -> ReplayResult:
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


def validate(all_turns: list[TraceTurn], args: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    turns = speed_up(window(all_turns, args.val_start, args.val_duration), args.speed)
    policy = validation_policy(args)
    slo = setup.slo_s / args.speed
    cfg = SimConfig(concurrency=args.concurrency, spawn_delay_s=setup.spawn_delay_s,
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


def plot_comparison(turns: list[TraceTurn], runs: dict[str, SimResult], concurrency: int, path: Path,
                    name: str, slo_s: float) -> None:
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
    ax3.axhline(slo_s, color="k", ls=":", lw=0.8)
    ax3.set_ylabel("p99 wait per minute, s")
    ax3.set_xlabel("minutes into the trace")
    ax3.legend(fontsize=8, ncol=3)
    fig.suptitle(f"{name}: demand, workers and wait by policy (simulated)")
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


def describe(args: argparse.Namespace, trace: Trace, turns: list[TraceTurn], setup: Setup) -> str:
    """How the trace became turns, for the report."""
    model: TraceModel = args.model
    span = turns[-1].at if turns else 0.0
    users = len({t.user for t in turns})
    mean_s = sum(t.service_s for t in turns) / max(1, len(turns))
    who = "users named by the trace" if trace.requests[0].user is not None else (
        f"conversations: geometric, mean {model.mean_turns:g} turns; think time {model.think_min_s:g} s + "
        f"exponential, mean {model.think_mean_s:g} s, after the previous reply")
    if model.service.needs_lengths:
        service = (f"{model.overhead_ms:g} ms + input tokens / {model.prefill_tokens_per_ms:g} tokens/ms + "
                   f"output tokens x {model.decode_ms_per_token:g} ms")
    else:
        service = f"`{model.service.spec()}` (seed {model.seed})"
    return (f"{len(turns):,} turns over {span / 60:.0f} min, {users:,} users ({who}); arrivals "
            f"{trace.arrivals}. "
            f"Service time = {service} (x{model.service_scale:g}): mean {mean_s:.2f} s. Workers: "
            f"{args.concurrency} slots each, start time {setup.spawn_delay_s * 1000:.0f} ms, max "
            f"{args.max_workers}. Wait = start of service - arrival; SLO: wait <= {setup.slo_s:g} s. "
            f"Worker-seconds up to the last arrival.")


def markdown(args: argparse.Namespace, trace: Trace, turns: list[TraceTurn], runs: dict[str, SimResult],
             val: dict[str, Any] | None, setup: Setup) -> str:
    sim_s = sum(r.runtime_s for r in runs.values())
    hold = setup.policy.scaling.scale_down_stabilization_s
    lines = [
        f"### Autoscaling on {trace.name} (simulated)", "",
        describe(args, trace, turns, setup) + f" All five simulations took {sim_s:.1f} s together.", "",
        table(comparison_rows(runs), COLUMNS + [("oracle_ratio", "x oracle")]), "",
        "fleet: `decide()` with the default policy (handler=sleep, concurrency, max_workers"
        + (", the --policy file" if args.policy else "") + " set; scale-in hold "
        + ("derived from the measured start cost" if hold is None else f"{hold:g} s") + "). "
        "static: workers for the peak turns in service at zero wait. hpa: every 15 s, target slot "
        "utilization 0.7, tolerance 0.1, up <= max(2x, +4), 300 s down-stabilization. keda: every 30 s, "
        f"backlog (lag + pending) / {0.75 * args.concurrency:g} per replica, same tolerance and "
        f"stabilization. oracle: per {setup.oracle_step_s:g} s, the fewest workers keeping that step's "
        f"p{setup.oracle_quantile:g} wait <= {setup.slo_s:g} s, perfect foresight, no spawn delay.", "",
        "![demand, workers and wait by policy](trace-comparison.png)", "",
    ]
    if val is not None:
        lines += [
            "### Validation: simulator vs a real fleet", "",
            f"Trace seconds {val['start_s']:g}-{val['start_s'] + val['duration_s']:g} ({val['turns']} turns) "
            f"at x{val['speed']:g}: service and inter-arrival times / {val['speed']:g}; the policy's "
            "report interval, active window, target wait and scale-in hold / the same factor. Real: private "
            "redis-server, `python -m commander` forking workers, `fleet replay`; waits in replay "
            f"seconds, SLO {val['slo_s']:g} s (= {setup.slo_s:g} trace seconds).", "",
            table([val["simulated"], val["real"]]), "",
            "![simulated vs real](trace-validation.png)", "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        trace = load_trace(args)
    except ValueError as exc:
        print(f"scripts/bench_trace: {exc}", file=sys.stderr)
        return 2
    setup = setup_of(args, trace)
    all_turns = assign_users(trace.requests, args.model)
    turns = window(all_turns, 0.0, args.duration)
    print(f"bench_trace: {trace.name}: {len(turns)} turns, {len({t.user for t in turns})} users "
          f"({time.perf_counter() - started:.1f} s to read and assign)", file=sys.stderr, flush=True)
    runs = compare(turns, setup)
    val = None if args.no_validation else validate(all_turns, args, setup)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_comparison(turns, runs, args.concurrency, args.out / "trace-comparison.png", trace.name, setup.slo_s)
    if val is not None:
        plot_validation(val, args.out / "trace-validation.png")
    model = asdict(args.model)
    model["service"] = args.model.service.spec()
    result = {"trace": trace.name, "arrivals": trace.arrivals, "epoch": trace.epoch, "model": model,
              "concurrency": args.concurrency, "max_workers": args.max_workers, "slo_s": setup.slo_s,
              "policy": setup.policy.model_dump(mode="json"), "comparison": comparison_rows(runs),
              "validation": None if val is None else {k: v for k, v in val.items()
                                                      if not k.endswith(("timeline", "workers", "waits"))}}
    (args.out / "trace.json").write_text(json.dumps(result, indent=2))
    (args.out / "trace.md").write_text(markdown(args, trace, turns, runs, val, setup) + "\n")
    print(table(comparison_rows(runs), COLUMNS + [("oracle_ratio", "x oracle")]))
    if val is not None:
        print(table([val["simulated"], val["real"]]))
    print(f"bench_trace: wrote {args.out}/trace.md, trace.json, PNGs in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
