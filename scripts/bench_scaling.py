"""Autoscaling policies on several traces, simulated: the shared Azure LLM conversation trace (when
it is beside the repository) and the seeded hard traffic of ``sim/scaling/generate.py`` (on/off
bursts, a diurnal ramp, a flash crowd, a slow leak, heavy-tailed service times).

On each trace: Fleet's ``decide()`` with the default policy, static for the peak, HPA-like,
KEDA-like and the oracle (``sim/scaling/compare.py``), in one table per trace: p50/p99/max wait,
% of waits over the SLO, worker-seconds and their ratio to the oracle's, scale events. Then the
frontier: each policy over a range of its settings (Fleet: the scale-in hold derived, 0, 60 and
300 s; HPA: target utilization 0.5..0.9; KEDA: backlog per replica x0.25..x2; static counts),
plotted as cost (worker-seconds / oracle) against misses (% over SLO), one panel per trace.
The goals (p99 <= 1 s, <= 0.1 % over SLO, <= 1.25x the oracle, fewer scale events than
HPA-like and KEDA-like) are reported per trace, never asserted.

Users, service times and the simulator are those of ``scripts/bench_trace`` (see its --help).
Writes scaling.json, scaling.md, scaling-frontier.png (cost vs misses) and scaling-events.png (cost
vs scale events) into --out. --from-json DIR re-renders them from a scaling.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench_trace import DEFAULT_TRACE, table
from benchlib import ROOT, OneLineParser

from sim.scaling.compare import Setup, compare, fleet_policy, frontier, rows
from sim.scaling.generate import KINDS, generate
from sim.scaling.trace import TraceModel, assign_users, window
from sim.scaling.tracefile import Trace, TraceSource, read_trace_file

COLUMNS = [("policy", "policy"), ("p50_wait_s", "p50 wait s"), ("p99_wait_s", "p99 wait s"),
           ("max_wait_s", "max wait s"), ("slo_violation_pct", "% > SLO"), ("worker_seconds", "worker-s"),
           ("oracle_ratio", "x oracle"), ("scale_events", "scale events")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="scripts/bench_scaling", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-out" / "scaling")
    p.add_argument("--quick", action="store_true",
                   help="10 minutes of each trace, generated ones too, and a smaller frontier")
    p.add_argument("--traces", default="shared," + ",".join(f"gen:{k}" for k in KINDS),
                   help="comma list: 'shared' (the Azure trace, skipped when absent), gen:KIND[:SEED], paths")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="where 'shared' is")
    p.add_argument("--duration", type=float, default=None, help="simulate this many seconds of each")
    p.add_argument("--seed", type=int, default=7, help="user assignment and generated traffic")
    p.add_argument("--jobs", type=int, default=2, help="traces simulated at once")
    p.add_argument("--no-frontier", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="render from this scaling.json, run nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = args.duration or 600.0
    return args


def load(spec: str, args: argparse.Namespace) -> Trace | None:
    """One trace of the list, or None for a shared trace that is not there."""
    if spec == "shared":
        return read_trace_file(TraceSource(args.trace, name="azure_llm_conv_2023")) \
            if args.trace.is_file() else None
    if spec.startswith("gen:"):
        kind, _, seed = spec[4:].partition(":")
        return generate(kind, int(seed) if seed else args.seed, args.duration or 3600.0)
    return read_trace_file(TraceSource(Path(spec)))


def run_one(spec: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """The comparison and the frontier on one trace (in a worker process)."""
    trace = load(spec, args)
    if trace is None:
        print(f"bench_scaling: no shared trace at {args.trace}: skipped", file=sys.stderr, flush=True)
        return None
    started = time.perf_counter()
    turns = window(assign_users(trace.requests, TraceModel(seed=args.seed)), 0.0, args.duration)
    setup = Setup(policy=fleet_policy(), epoch=trace.epoch)

    def log(line: str) -> None:
        print(f"[{trace.name}] {line.strip()}", file=sys.stderr, flush=True)

    runs = compare(turns, setup, log)
    table = rows(runs)
    points = [] if args.no_frontier else frontier(turns, setup, runs["oracle"].worker_seconds, log)
    return {"trace": trace.name, "arrivals": trace.arrivals, "turns": len(turns),
            "span_s": turns[-1].at if turns else 0.0, "users": len({t.user for t in turns}),
            "comparison": table, "frontier": [asdict(p) for p in points],
            "seconds": round(time.perf_counter() - started, 1)}


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals on one trace, as measured."""
    by = {row["policy"].split(" ")[0]: row for row in result["comparison"]}
    fl = by["fleet"]
    events = min(by["hpa"]["scale_events"], by["keda"]["scale_events"])
    return {"p99_le_1s": fl["p99_wait_s"] <= 1.0, "slo_le_0.1pct": fl["slo_violation_pct"] <= 0.1,
            "cost_le_1.25x": (fl["oracle_ratio"] or 9e9) <= 1.25,
            "fewer_events": fl["scale_events"] < events}


def markdown(results: list[dict[str, Any]]) -> str:
    yes = {True: "yes", False: "**no**"}
    lines = ["| trace | p99 <= 1 s | <= 0.1 % over SLO | <= 1.25x oracle | fewer events than HPA, KEDA |",
             "|---|---|---|---|---|"]
    for r in results:
        g = goals(r)
        lines.append(f"| {r['trace']} | {yes[g['p99_le_1s']]} | {yes[g['slo_le_0.1pct']]} | "
                     f"{yes[g['cost_le_1.25x']]} | {yes[g['fewer_events']]} |")
    lines += ["", "Worker-seconds and scale events are both counted up to the last arrival. The frontier: "
              "Fleet with its scale-in hold derived (the default), fixed at 0, 60 and 300 s, and with the "
              "ledger's compaction margin at 2 and 2.5 (the default 1.5); HPA-like at target utilizations "
              "0.5-0.9; KEDA-like at x0.25-x2 its backlog target; static counts.", ""]
    for r in results:
        lines += [f"#### {r['trace']}", "",
                  f"{r['turns']:,} turns over {r['span_s'] / 60:.0f} min, {r['users']:,} users; arrivals "
                  f"{r['arrivals']}.", "", table(r["comparison"], COLUMNS), ""]
        if r["frontier"]:
            lines += [_frontier_line(r["frontier"]), ""]
    lines += ["![cost vs misses per trace](scaling-frontier.png)", "",
              "![cost vs scale events per trace](scaling-events.png)"]
    return "\n".join(lines)


def _frontier_line(points: list[dict[str, Any]]) -> str:
    """The frontier's points as text: per family, setting: x oracle / % over SLO / scale events."""
    parts = []
    for family in ("fleet", "hpa", "keda", "static"):
        pts = [f"{p['setting']} x{p['oracle_ratio']:.2f} / {p['slo_violation_pct']:g} % / {p['scale_events']}"
               for p in points if p["family"] == family]
        parts.append(f"**{family}**: " + "; ".join(pts))
    return "Frontier (setting: x oracle / % over SLO / scale events): " + ". ".join(parts) + "."


def plot_frontier(results: list[dict[str, Any]], path: Path, y: str = "slo_violation_pct") -> None:
    """One panel per trace: each policy's settings as points of cost (x) and ``y``: the % of
    waits over the SLO (log scale, 0 drawn at 0.001), or the scale events."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r["frontier"]]
    if not shown:
        return
    cols = min(3, len(shown))
    nrows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    marks = {"fleet": ("tab:blue", "o"), "hpa": ("tab:orange", "s"), "keda": ("tab:green", "^"),
             "static": ("tab:gray", "D")}
    for ax, r in zip(axes.flat, shown, strict=False):
        for family, (color, marker) in marks.items():
            pts = sorted((p for p in r["frontier"] if p["family"] == family), key=lambda p: p["oracle_ratio"])
            ax.plot([p["oracle_ratio"] for p in pts], [_y(p, y) for p in pts],
                    color=color, marker=marker, ms=4, lw=0.8, label=family)
            for p in pts:
                if p["default"]:
                    ax.plot(p["oracle_ratio"], _y(p, y), marker=marker, ms=10, mfc="none", mec="k")
        ax.axvline(1.25, color="k", ls=":", lw=0.7)
        if y == "slo_violation_pct":
            ax.axhline(0.1, color="k", ls=":", lw=0.7)
            ax.set_yscale("log")
        ax.set_title(r["trace"], fontsize=9)
        ax.set_xlabel("worker-seconds / oracle", fontsize=8)
        ax.set_ylabel("% of waits over the SLO (0 drawn at 0.001)" if y == "slo_violation_pct"
                      else "scale events", fontsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    what = "misses" if y == "slo_violation_pct" else "scale events"
    fig.suptitle(f"Cost vs {what} (circled: the setting of the comparison; dotted: the goals)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _y(point: dict[str, Any], y: str) -> float:
    return max(float(point[y]), 1e-3) if y == "slo_violation_pct" else float(point[y])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    specs = [s.strip() for s in args.traces.split(",") if s.strip()]
    if args.from_json is not None:
        results = json.loads(args.from_json.read_text())["traces"]
    else:
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = [r for r in pool.map(run_one, specs, [args] * len(specs)) if r is not None]
    args.out.mkdir(parents=True, exist_ok=True)
    for r in results:
        r["goals"] = goals(r)
    (args.out / "scaling.json").write_text(json.dumps({"traces": results}, indent=2))
    (args.out / "scaling.md").write_text(markdown(results) + "\n")
    plot_frontier(results, args.out / "scaling-frontier.png")
    plot_frontier(results, args.out / "scaling-events.png", "scale_events")
    print(markdown(results))
    print(f"bench_scaling: wrote {args.out} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
