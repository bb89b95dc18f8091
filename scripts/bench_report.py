"""Run every benchmark in sequence and write the report: its regions of ``docs/BENCHMARKS.md``
(between ``<!-- bench:NAME -->`` markers; the rest of the page is written by hand from dedicated
runs, and kept) and PNG plots. A region whose steps did not all run is left as it is.

    scripts/bench            # the full run (about 15 minutes), writes docs/
    scripts/bench --quick    # a smoke run (about 2 minutes), writes docs/bench-out/ (git-ignored)

Benchmarks run one after another, never together: on a 2-core machine any overlap would be
measured as the system's own slowness. Each writes JSON; this script only assembles.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import ROOT, OneLineParser, result_path, settle_load

GOALS = "Fleet >= 4x Celery and >= 10x RQ turns/s; p99 <= 10 ms at half load; pressure -> new worker " \
        "serving <= 100 ms median; trace p99 wait <= 1 s, worker-seconds <= 1.25x oracle, fewer scale " \
        "events than HPA-like and KEDA-like (on every trace of bench_scaling); decide <= 20 ms at " \
        "1,000 workers x 20 tiers"


def parse_args(argv: list[str] | None = None):
    p = OneLineParser(prog="scripts/bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="short runs of everything (smoke test)")
    p.add_argument("--out", type=Path, default=None, help="default: docs/ (full) or docs/bench-out/ (quick)")
    p.add_argument("--only", default="", help="comma list: pipeline,peers,scaleup,commander,trace,scaling")
    p.add_argument("--from-json", type=Path, default=None,
                   help="skip running: assemble the report from JSON files already in this directory")
    return p.parse_args(argv)


STEPS = {
    "pipeline": ["bench_pipeline.py"],
    "peers": ["bench_peers.py"],
    "scaleup": ["bench_scaleup.py"],
    "commander": ["bench_commander.py"],
    "trace": ["bench_trace.py"],
    "scaling": ["bench_scaling.py"],
}


def run_step(name: str, quick: bool, raw: Path) -> None:
    script = ROOT / "scripts" / STEPS[name][0]
    args = [sys.executable, str(script)] + (["--quick"] if quick else [])
    if name in ("trace", "scaling"):
        args += ["--out", str(raw / name)]
    else:
        args += ["--json", str(raw / f"{name}.json")]
    print(f"== {name}: {' '.join(Path(a).name if a.startswith('/') else a for a in args[1:])}", flush=True)
    if not quick:
        settle_load()  # (the last step's load: this one would start invalid)
    started = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, text=True, capture_output=True, timeout=3600)
    (raw / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        log = raw / f"{name}.log"
        raise SystemExit(f"scripts/bench: {name} failed (exit {proc.returncode}); see {log}")
    print(f"   done in {time.monotonic() - started:.0f} s", flush=True)


def load(raw: Path, name: str) -> dict[str, Any] | None:
    path = result_path(raw, name)
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or (ROOT / "docs" / ("bench-out" if args.quick else ""))
    raw = args.from_json or (out / "bench-raw")
    raw.mkdir(parents=True, exist_ok=True)
    only = [s for s in args.only.split(",") if s] or list(STEPS)
    unknown = set(only) - set(STEPS)
    if unknown:
        print(f"scripts/bench: unknown step(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if args.from_json is None:
        for name in only:
            run_step(name, args.quick, raw)
    data = {name: load(raw, name) for name in STEPS}
    from bench_render import render, splice  # noqa: PLC0415 - matplotlib only when rendering

    regions = render(data, out, raw, quick=args.quick)
    page = out / "BENCHMARKS.md"
    template = page if page.exists() else ROOT / "docs" / "BENCHMARKS.md"
    try:
        page.write_text(splice(template.read_text(), regions))
    except ValueError as exc:
        print(f"scripts/bench: {template}: {exc}", file=sys.stderr)
        return 1
    for sub in ("trace", "scaling"):
        for png in (raw / sub).glob("*.png") if (raw / sub).exists() else []:
            shutil.copy(png, out / png.name)
    print(f"scripts/bench: wrote {out / 'BENCHMARKS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
