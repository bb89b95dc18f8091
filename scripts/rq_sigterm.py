"""SIGTERM ``fleet rq-worker`` at random moments and check each warm shutdown.

A pod's RQ worker is retired by the kubelet's SIGTERM (the process runtime sends one too), at
any moment of its life. Each round starts one ``fleet rq-worker`` on a private redis-server,
picks a moment (``start``: while it starts, up to 1.5 s in; ``idle``: registered, waiting for
a job; ``busy``: in a 1 s job), sends SIGTERM, and checks that it exits 0 within ``--bound``
seconds, leaving nothing in its process group. A worker still running after ``--timeout`` is a
hang (SIGKILLed). A SIGTERM while the interpreter still imports, before Fleet's code runs,
kills it with -15 and no output (a kubelet's SIGTERM does the same to any Python process
then): counted apart, as ``import-kills``.

  scripts/rq_sigterm --rounds 20             # short
  scripts/rq_sigterm --rounds 200 --seed 7   # long (about 6 minutes)

Exit 1 if any round is bad (a hang, a slow or failed exit, a leftover process).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import redis_server  # noqa: E402

from protocol.deferral import Deferral  # noqa: E402
from stores import rqjobs  # noqa: E402

QUEUE = "writeback"
MODES = ("start", "idle", "busy")


def one_round(url: str, r: redis.Redis, name: str, mode: str, rng: random.Random, log: Path,
              timeout: float) -> tuple[str, float, bool]:
    """SIGTERM one worker at a moment of ``mode``; (its exit code or HUNG, seconds, leftovers)."""
    fleet = Path(sys.executable).parent / "fleet"
    env = {**os.environ, "REDIS_URL": url, "FLEET_WORKER_POD_NAME": name}
    with log.open("wb") as out:
        proc = subprocess.Popen([str(fleet), "rq-worker", "--queues", QUEUE], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if mode == "start":
            time.sleep(rng.uniform(0, 1.5))
        else:
            deadline = time.monotonic() + 30
            while name not in {w.name for w in rqjobs.workers(r, QUEUE)}:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} never registered: {log.read_text()[-500:]}")
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.5))
            if mode == "busy":
                rqjobs.enqueue(r, Deferral(name="count", kwargs={"sleep_s": 1.0}, queue=QUEUE, user="u0",
                                           turn_id=f"t-{name}", index=0, ts=time.time()))
                time.sleep(rng.uniform(0, 0.8))
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code: str = str(proc.wait(timeout))
        except subprocess.TimeoutExpired:
            code = "HUNG"
        took = time.monotonic() - sent
    finally:
        left = _kill_group(proc)
    return code, took, left


def _kill_group(proc: subprocess.Popen[bytes]) -> bool:
    """SIGKILL what is left of the worker's process group; whether anything was."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        left = True
    except ProcessLookupError:
        left = False
    proc.wait()
    return left


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bound", type=float, default=3.0, help="seconds a warm shutdown may take")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds before a worker counts as hung")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    rng = random.Random(args.seed)
    counts: collections.Counter[str] = collections.Counter()
    bad: list[str] = []
    slowest: dict[str, float] = collections.defaultdict(float)
    with redis_server() as url, tempfile.TemporaryDirectory(prefix="fleet-rq-sigterm-") as tmp:
        r = redis.Redis.from_url(url)
        for i in range(args.rounds):
            mode, name = rng.choice(MODES), f"pod-{args.seed}-{i}"
            log = Path(tmp) / f"{name}.log"
            code, took, left = one_round(url, r, name, mode, rng, log, args.timeout)
            counts[mode] += 1
            quiet = log.stat().st_size == 0
            if code == "-15" and quiet:
                counts["import-kills"] += 1
            elif code != "0" or took > args.bound or left:
                bad.append(f"{name} {mode}: exit {code} after {took:.2f}s"
                           f"{', processes left in its group' if left else ''}\n{log.read_text()[-800:]}")
            else:
                slowest[mode] = max(slowest[mode], took)
            print(f"\r{i + 1}/{args.rounds} rounds, {len(bad)} bad", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(f"rounds {args.rounds} (seed {args.seed}): " + ", ".join(f"{m} {counts[m]}" for m in MODES)
          + f"; import-kills {counts['import-kills']}; bad {len(bad)}")
    print("slowest warm shutdown: " + ", ".join(f"{m} {slowest[m]:.2f}s" for m in MODES if m in slowest))
    for b in bad:
        print(f"BAD {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
