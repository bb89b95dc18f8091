"""Spawn latency of the process runtime: workers forked from the template vs fresh interpreters.

For each mode, N trials on a private redis-server. A trial submits a turn to an empty tier
(it is parked in the tier's ready stream), then calls ``spawn()`` and times three moments
from that call: ``spawn()`` returning, the worker registered (its heartbeat key exists),
and the reply to the parked turn, which must come from the new worker. The worker is then
drained before the next trial. One untimed trial per mode warms the page cache first; the
fork mode's template is started (and waited for) before its trials, as a running commander
would have it.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import MachineWatch, OneLineParser, emit, percentile, redis_server

from commander.runtime.process import ProcessRuntime
from fleet.client import Fleet
from protocol import keys
from protocol.policy import TurnsPolicy
from stores.connection import connect_sync
from stores.policies import write_policy

TIER = "spawnbench"
MODES = ("fork", "exec")
PHASES = ("spawn_call_ms", "registered_ms", "first_turn_ms")
TIMEOUT_S = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="scripts/bench_spawn", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10, help="timed trials per mode (default 10)")
    p.add_argument("--quick", action="store_true", help="3 trials per mode (smoke test)")
    p.add_argument("--modes", default="fork,exec", help="comma-separated: fork, exec")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.trials = min(args.trials, 3)
    if args.trials < 1:
        p.error("--trials must be positive")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error("--modes takes fork and/or exec")
    return args


def _until(what: str, cond) -> float:  # type: ignore[no-untyped-def]
    deadline = time.perf_counter() + TIMEOUT_S
    while not cond():
        if time.perf_counter() > deadline:
            raise RuntimeError(f"timed out after {TIMEOUT_S:g}s waiting for {what}")
        time.sleep(0.001)
    return time.perf_counter()


def trial(rt: ProcessRuntime, fleet: Fleet, user: str) -> dict[str, float]:
    """One spawn onto an empty tier with a turn parked; milliseconds from the ``spawn()`` call."""
    handle = fleet.submit(user, f"first turn of {user}", tier=TIER)
    t0 = time.perf_counter()
    (worker_id,) = rt.spawn(TIER, 1)
    t_call = time.perf_counter()
    t_reg = _until(f"{worker_id} to register", lambda: fleet.r.exists(keys.heartbeat(worker_id)))
    reply = handle.result(TIMEOUT_S)
    t_reply = time.perf_counter()
    if not reply.ok or reply.worker != worker_id:
        raise RuntimeError(f"the parked turn was answered by {reply.worker!r}, not {worker_id}: "
                           f"{reply.error or reply.text}")
    retire(rt, worker_id)
    return {"spawn_call_ms": (t_call - t0) * 1e3, "registered_ms": (t_reg - t0) * 1e3,
            "first_turn_ms": (t_reply - t0) * 1e3}


def retire(rt: ProcessRuntime, worker_id: str) -> None:
    """Drain the worker and wait until it is gone: the next trial starts on an empty tier."""
    rt.reap()
    rt.retire(worker_id, "bench", drain_timeout_s=5.0)
    _until(f"{worker_id} to exit", lambda: any(h.worker_id == worker_id for h in rt.reap()))


def run_mode(url: str, mode: str, trials: int, log_dir: Path) -> dict[str, object]:
    """Every trial of one mode, with its own runtime."""
    rt = ProcessRuntime(url, log_dir / mode, spawn_mode=mode)  # type: ignore[arg-type]
    fleet = Fleet(url)
    result: dict[str, object] = {"mode": mode, "trials": trials}
    try:
        if rt.spawner.template is not None:
            began = time.perf_counter()
            if not rt.spawner.template.start(wait=True):
                raise RuntimeError("the fork template did not start (see its log)")
            result["template_ready_ms"] = round((time.perf_counter() - began) * 1e3, 1)
        trial(rt, fleet, f"{mode}-warmup")  # not timed
        rows = []
        for i in range(trials):
            rows.append(trial(rt, fleet, f"{mode}-{i}"))
            print(f"  {mode} {i + 1}/{trials}: first turn {rows[-1]['first_turn_ms']:.1f} ms",
                  file=sys.stderr, flush=True)
    finally:
        rt.stop_all(timeout=5.0)
        rt.close()
        fleet.close()
    for phase in PHASES:
        values = [row[phase] for row in rows]
        result[phase] = {"median": round(statistics.median(values), 1),
                         "p95": round(percentile(values, 95), 1),
                         "min": round(min(values), 1), "max": round(max(values), 1)}
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    results = []
    with redis_server() as url, tempfile.TemporaryDirectory(prefix="fleet-bench-spawn-") as tmp:
        r = connect_sync(url)
        write_policy(r, TIER, TurnsPolicy(handler="echo", min_workers=0))
        r.close()
        print(f"bench_spawn: {args.trials} trials per mode ({', '.join(args.modes)}), echo handler",
              file=sys.stderr)
        for mode in args.modes:
            results.append(run_mode(url, mode, args.trials, Path(tmp)))
    for res in results:
        turn, reg, call = res["first_turn_ms"], res["registered_ms"], res["spawn_call_ms"]
        print(f"{res['mode']}: first turn median {turn['median']} ms  p95 {turn['p95']} ms | "  # type: ignore[index]
              f"registered median {reg['median']} ms  p95 {reg['p95']} ms | "  # type: ignore[index]
              f"spawn() median {call['median']} ms")  # type: ignore[index]
    out = {"tier": TIER, "handler": "echo", "results": results}
    emit(out, args.json, watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
