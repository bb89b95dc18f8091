"""Render the benchmark JSON into docs/BENCHMARKS.md and PNG plots (used by scripts/bench)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchlib import result_path

NAMES = {"fleet": "Fleet", "rq-simple": "RQ SimpleWorker", "rq-fork": "RQ Worker (fork)",
         "celery": "Celery prefork"}


def _f(v: Any, digits: int = 1) -> str:
    return "–" if v is None else (f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}")


def _systems(peers: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(k, v) for k, v in peers.get("systems", {}).items()]


def throughput_section(peers: dict[str, Any] | None, out: Path) -> list[str]:
    if not peers:
        return ["*(not run)*"]
    rows = ["| system | processes | turns/s | sat p50 ms | sat p99 ms | half-load p50 ms | half-load p99 ms |"
            " CPU µs/turn (workers + Redis) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for key, s in _systems(peers):
        sat, half, cost = s.get("saturation", {}), s.get("half_load") or {}, s.get("cost_per_turn", {})
        cpu = (cost.get("worker_cpu_us") or 0) + (cost.get("redis_cpu_us") or 0)
        if half.get("overloaded"):
            half_cells = "overloaded | capacity below the rate"
        else:
            half_cells = f"{_f(half.get('p50_ms'))} | {_f(half.get('p99_ms'))}"
        rows.append(f"| {NAMES.get(key, key)} | {s.get('processes', '')} | {_f(sat.get('turns_per_s'))} | "
                    f"{_f(sat.get('p50_ms'))} | {_f(sat.get('p99_ms'))} | {half_cells} | "
                    f"{_f(cpu, 0) if cpu else '–'} |")
    fleet = peers.get("systems", {}).get("fleet", {})
    half_rate = peers.get("half_rate_per_s")
    ratios = ["", f"Half load is {_f(half_rate)} turns/s for every system (half of Fleet's saturation). "
              "Ratios Fleet / peer: throughput (above 1: Fleet serves more), half-load p99 (below 1: "
              "Fleet's tail is shorter):", ""]
    for key, s in _systems(peers):
        if key == "fleet":
            continue
        tp = _ratio(fleet.get("saturation", {}).get("turns_per_s"),
                    s.get("saturation", {}).get("turns_per_s"))
        p99 = _ratio((fleet.get("half_load") or {}).get("p99_ms"), (s.get("half_load") or {}).get("p99_ms"))
        ratios.append(f"- vs {NAMES.get(key, key)}: throughput x{tp}, half-load p99 x{p99}")
    _bar_chart(peers, out / "bench-throughput.png")
    return rows + ratios + ["", "![turns/s and half-load p99 per system](bench-throughput.png)"]


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}"


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, imported when a plot is drawn: matplotlib is
    in the `bench` extra, which the suite's first step (and the page's text) does not need."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bar_chart(peers: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    systems = _systems(peers)
    labels = [NAMES.get(k, k) for k, _ in systems]
    tps = [s.get("saturation", {}).get("turns_per_s") or 0 for _, s in systems]
    p99 = [(s.get("half_load") or {}).get("p99_ms") or 0 for _, s in systems]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.bar(labels, tps, color="#4c72b0")
    a.set_title("turns/s at saturation (higher is better)")
    b.bar(labels, p99, color="#dd8452")
    b.set_title("submit→reply p99 at half of Fleet's rate, ms (lower is better)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaleup_section(scaleup: dict[str, Any] | None, peers: dict[str, Any] | None, out: Path) -> list[str]:
    rows = ["| system | how | median ms | p95 ms | trials |", "|---|---|---:|---:|---:|"]
    bars = []
    for mode, res in (scaleup or {}).get("pressure_to_first_turn", {}).items():
        how = "fork from the pre-imported template" if mode == "fork" else "fresh interpreter"
        rows.append(f"| Fleet | {how} | {_f(res['median_ms'])} | {_f(res['p95_ms'])} | {res['trials']} |")
        bars.append((f"Fleet {mode}", res["median_ms"], res["p95_ms"]))
    auto = (peers or {}).get("celery_autoscale")
    if auto:
        rows.append(f"| Celery | `--autoscale {auto.get('autoscale')}` | {_f(auto.get('median_ms'))} | "
                    f"{_f(auto.get('p95_ms'))} | {auto.get('bursts')} |")
        bars.append(("Celery autoscale", auto.get("median_ms") or 0, auto.get("p95_ms") or 0))
    if bars:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.bar([b[0] for b in bars], [b[1] for b in bars], color="#55a868", label="median")
        ax.scatter([b[0] for b in bars], [b[2] for b in bars], color="black", zorder=3, label="p95")
        ax.set_ylabel("ms")
        ax.set_title("first turn of a burst → served by a new worker")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "bench-scaleup.png", dpi=110)
        plt.close(fig)
        rows += ["", "![scale-up reaction](bench-scaleup.png)"]
    return rows


def commander_section(cmd: dict[str, Any] | None) -> list[str]:
    if not cmd:
        return ["*(not run)*"]
    d, i, whole = cmd["decide"], cmd["ingest"], cmd.get("pass")
    passes = [] if not whole else [
        f"- A whole commander pass over {whole['workers']:,} workers in {whole['tiers']} tiers "
        f"({whole['reports_per_pass']:,} reports a pass): median **{whole['cpu_ms_per_pass']['median']} ms** "
        f"of commander CPU, p95 {whole['cpu_ms_per_pass']['p95']} ms; {whole['redis_commands_per_pass']:,} "
        f"Redis commands a pass; commander RSS {whole['commander_rss_mb']} MB (§4b: at 10,000 workers)."]
    return [*passes,
            f"- `decide()` over {d['workers']:,} workers in {d['tiers']} tiers, one full pass: median "
            f"**{d['median_ms']} ms**, p95 {d['p95_ms']} ms ({d['per_tier_us']} µs per tier).",
            f"- Report ingest (XREAD + decode + evaluator window): **{i['reports_per_s']:,} reports/s** "
            f"({i['reports']:,} reports in {i['seconds']} s). 1,000 workers reporting every 5 s send 200/s."]


def goals_section(data: dict[str, Any]) -> list[str]:
    peers, scale, cmd, trace = data.get("peers") or {}, data.get("scaleup") or {}, data.get("commander"), \
        data.get("trace") or {}
    sysd = peers.get("systems", {})
    f_tp = sysd.get("fleet", {}).get("saturation", {}).get("turns_per_s")
    c_tp = sysd.get("celery", {}).get("saturation", {}).get("turns_per_s")
    r_tp = sysd.get("rq-simple", {}).get("saturation", {}).get("turns_per_s")
    f_p99 = (sysd.get("fleet", {}).get("half_load") or {}).get("p99_ms")
    fork = scale.get("pressure_to_first_turn", {}).get("fork", {}).get("median_ms")
    dec = cmd["decide"]["median_ms"] if cmd else None
    rows = ["| goal | measured | met |", "|---|---|---|"]

    def row(goal: str, value: str, ok: bool | None) -> None:
        rows.append(f"| {goal} | {value} | {'yes' if ok else ('no' if ok is not None else '–')} |")

    row("Fleet >= 4x Celery turns/s", f"x{_ratio(f_tp, c_tp)}",
        None if not (f_tp and c_tp) else f_tp >= 4 * c_tp)
    row("Fleet >= 10x RQ turns/s", f"x{_ratio(f_tp, r_tp)} (SimpleWorker)",
        None if not (f_tp and r_tp) else f_tp >= 10 * r_tp)
    row("p99 <= 10 ms at half load", f"{_f(f_p99)} ms", None if f_p99 is None else f_p99 <= 10)
    row("pressure -> new worker serving <= 100 ms median", f"{_f(fork)} ms (fork)",
        None if fork is None else fork <= 100)
    row("decide <= 20 ms at 1,000 workers x 20 tiers", f"{_f(dec, 2)} ms", None if dec is None else dec <= 20)
    runs = {r["policy"].split(" ")[0]: r for r in trace.get("comparison", [])}
    fl, orc = runs.get("fleet"), runs.get("oracle")
    if fl:
        row("trace: p99 wait <= 1 s (simulated)", f"{fl['p99_wait_s']} s", fl["p99_wait_s"] <= 1.0)
    if fl and orc:
        ratio = fl["worker_seconds"] / orc["worker_seconds"]
        row("trace: worker-seconds <= 1.25x oracle", f"x{ratio:.2f}", ratio <= 1.25)
    if fl and "hpa" in runs and "keda" in runs:
        fewer = fl["scale_events"] < min(runs["hpa"]["scale_events"], runs["keda"]["scale_events"])
        row("trace: fewer scale events than HPA-like and KEDA-like",
            f"{fl['scale_events']} vs {runs['hpa']['scale_events']} / {runs['keda']['scale_events']}", fewer)
    traces = (data.get("scaling") or {}).get("traces", [])
    names = {"p99_le_1s": "p99 wait <= 1 s", "slo_le_0.1pct": "<= 0.1 % of waits over the SLO",
             "cost_le_1.25x": "worker-seconds <= 1.25x oracle",
             "fewer_events": "fewer scale events than HPA-like and KEDA-like"}
    for key, goal in names.items() if traces else ():
        met = [t["trace"] for t in traces if t["goals"][key]]
        row(f"every trace of section 3 (simulated): {goal}", f"{len(met)} of {len(traces)}",
            len(met) == len(traces))
    return rows


# the regions of docs/BENCHMARKS.md that scripts/bench writes, and the steps each is made from;
# a region is written only when all of its steps' results are there (else left as it is)
REGIONS = {"goals": ("peers", "scaleup", "commander", "trace", "scaling"), "throughput": ("peers",),
           "scaleup": ("scaleup",), "trace": ("trace",), "scaling": ("scaling",), "commander": ("commander",)}


def measured(data: dict[str, Any], steps: tuple[str, ...], raw: Path, quick: bool) -> str:
    """When and on how quiet a machine the steps ran, from their JSON (its time, its
    ``machine`` verdict)."""
    parts = []
    for step in steps:
        path = result_path(raw, step)
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime)) if path.exists() \
            else "?"
        verdict = (data.get(step) or {}).get("machine")
        if verdict is None:  # (a simulation: its figures do not depend on the machine's load)
            parts.append(f"`{step}` {when}")
            continue
        load = verdict["load_average_at_start"][0]
        valid = "valid" if verdict["valid"] else "INVALID: " + "; ".join(verdict["invalid_because"])
        parts.append(f"`{step}` {when}, load average {load} at its start, {valid}")
    quick_note = " **Quick mode: smoke-test figures, not measurements.**" if quick else ""
    return f"*Written by `scripts/bench`: {'; '.join(parts)}.*{quick_note}"


def render(data: dict[str, Any], out: Path, raw: Path, quick: bool) -> dict[str, str]:
    """The regions of the page whose steps' results are all there, each as Markdown."""
    made: dict[str, list[str]] = {}
    present = {name for name, value in data.items() if value}
    if "peers" in present:
        pipe = data.get("pipeline")
        made["throughput"] = [
            "A turn pulls the user's context pack (session, profile, top-K memories) in one round trip, "
            "runs a no-op model call, writes everything back atomically and pushes the reply. Fleet runs "
            "it in its workers (`noop` handler); the peers run `scripts/peers/turn.py`. 2 worker "
            "processes each, 1,000 users seeded with a full context, one redis-server. Fleet also keeps "
            "per-user order (lanes), fencing, dedupe and acks that the peers do not.", "",
            *throughput_section(data["peers"], out)]
        if pipe:
            made["throughput"] += [
                "", "Fleet alone with the `echo` handler (`scripts/bench_pipeline`, 2 workers, 1,000 users): "
                f"**{_f(pipe['saturation']['turns_per_s'])} turns/s**; at half load "
                f"({_f(pipe['half_load']['rate_per_s'])}/s) p50 {_f(pipe['half_load']['p50_ms'], 2)} ms, "
                f"p99 {_f(pipe['half_load']['p99_ms'], 2)} ms."]
    if "scaleup" in present:
        made["scaleup"] = scaleup_section(data["scaleup"], data.get("peers"), out)
    if "trace" in present:
        made["trace"] = [(raw / "trace" / "trace.md").read_text().strip()]
    if "scaling" in present:
        made["scaling"] = [(raw / "scaling" / "scaling.md").read_text().strip()]
    if "commander" in present:
        made["commander"] = commander_section(data["commander"])
    if present >= set(REGIONS["goals"]):
        made["goals"] = goals_section(data)
    steps = {**REGIONS, "throughput": ("peers", "pipeline") if data.get("pipeline") else ("peers",)}
    return {name: "\n".join([measured(data, steps[name], raw, quick), "", *lines])
            for name, lines in made.items()}


def splice(page: str, regions: dict[str, str]) -> str:
    """``page`` with each region's text between its markers (``<!-- bench:NAME -->`` and
    ``<!-- /bench:NAME -->``) replaced; a region without its markers is an error."""
    for name, text in regions.items():
        opening, closing = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        begin, end = page.find(opening), page.find(closing)
        if begin < 0 or end < begin:
            raise ValueError(f"the page has no region {name} (between {opening} and {closing})")
        page = page[:begin + len(opening)] + "\n" + text.strip() + "\n" + page[end:]
    return page
