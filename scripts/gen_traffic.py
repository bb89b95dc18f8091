"""Write a generated trace (``sim/scaling/generate.py``: seeded hard traffic) as a CSV in the Azure
layout (``TIMESTAMP`` ISO UTC, ``ContextTokens``, ``GeneratedTokens``), for ``fleet replay``,
``scripts/bench_trace --trace FILE`` or any other tool. The same KIND and --seed give the same
file on any machine.

Kinds: mmpp (on/off bursts), diurnal (a day compressed into the run), flash (x10 in a second),
leak (a slow linear rise), heavy (heavy-tailed service times). See the module for the numbers.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from benchlib import OneLineParser

from sim.scaling.generate import DEFAULT_START, KINDS, generate, write_csv


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="scripts/gen_traffic", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--duration", type=float, default=3600.0, help="seconds")
    p.add_argument("--start", default=datetime.fromtimestamp(DEFAULT_START, UTC).isoformat(),
                   help="ISO time of the first second (default: a Monday 00:00 UTC)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        start = datetime.fromisoformat(args.start.replace("Z", "+00:00"))
        if start.tzinfo is None:
            start = start.replace(tzinfo=UTC)
        trace = generate(args.kind, args.seed, args.duration, start.timestamp())
    except ValueError as exc:
        p.error(str(exc))
    write_csv(trace, str(args.out))
    print(f"gen_traffic: {len(trace.requests)} requests ({trace.arrivals}) -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
