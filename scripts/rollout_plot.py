"""A canary rollout on a real fleet, recorded: per-group worker counts over time and the ledger.

Starts a private redis-server on a free port (never 6379), a commander on the process runtime
(in this process) and, through it, real workers; a tier ``chat`` with two groups of the
``sleep`` handler (blue 90 %, green 10 %), and USERS users each sending a turn, waiting for the
reply, thinking THINK_S, again. Then the operator's steps at fixed times: ``fleet rollout chat
green --weight 50``, ``--to 100``, ``--abort``. Every 0.5 s it samples the live workers of
each pool; at the end it writes the plot and the samples with the ledger as JSON, and stops
every process it started (by pid).

With ``--guard``, green is a bad release (its handler fails each turn's first attempt; the
retry answers it) under a ``rollout_guard``: the operator only raises it to 50 %, and the
commander aborts it by itself once green's error rate over the window passes blue's by the
margin.

    .venv/bin/python scripts/rollout_plot.py [--out docs/groups-rollout]
    .venv/bin/python scripts/rollout_plot.py --guard [--out docs/groups-guard]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from commander.commander import Commander  # noqa: E402
from commander.runtime.process import ProcessRuntime  # noqa: E402
from commander.settings import CommanderSettings  # noqa: E402
from fleet.cli import main as fleet_main  # noqa: E402
from fleet.client import Fleet  # noqa: E402
from protocol.codec import decode  # noqa: E402
from protocol.models import LedgerEvent  # noqa: E402
from protocol.policy import parse_policy  # noqa: E402
from stores import functions  # noqa: E402
from stores.ledger import ledger_page  # noqa: E402
from stores.policies import write_policy  # noqa: E402
from stores.registry import read_registry  # noqa: E402

USERS = 40
THINK_S = 0.5
STEPS = ((20.0, ["--weight", "50"]), (40.0, ["--to", "100"]), (65.0, ["--abort"]))
GUARD_STEPS = ((20.0, ["--weight", "50"]),)  # the rollout guard does the rest
END_S = 90.0
POOLS = ("chat.blue", "chat.green")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            if int(client.info("server")["process_id"]) != proc.pid:
                raise SystemExit(f"port {port} is another redis-server's")
            functions.install(client)  # Fleet's functions library, as an admin would (`fleet install`)
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.02)
    raise SystemExit("redis-server did not start")


def policy(guard: bool = False) -> Any:
    one = {"handler": "sleep", "min_workers": 1, "max_workers": 6}
    green: dict[str, Any] = {"name": "green", "weight": 10, **one}
    extra: dict[str, Any] = {}
    if guard:
        green["handler_options"] = {"sleep_ms": 150, "fail_attempts": 1}
        extra = {"canary": "green", "rollout_guard": {"window_s": 20, "min_turns": 20,
                                                      "error_rate_margin": 0.2, "latency_margin": None}}
    return parse_policy({"min_workers": 0, "concurrency": 2, "users_per_instance": 4,
                         "handler_options": {"sleep_ms": 150}, "report_interval_s": 0.5,
                         "scale_down_stabilization_s": 5, "active_window_s": 5, **extra,
                         "groups": [{"name": "blue", "weight": 90, **one}, green]})


def users_loop(url: str, stop: threading.Event, served: dict[str, int]) -> None:
    """Every user: a turn, its reply, THINK_S of thought, again (one batch per round)."""
    client = Fleet(url)
    n = 0
    while not stop.is_set():
        handles = client.submit_many([(f"user-{i}", f"turn {n}") for i in range(USERS)])
        for h in handles:
            reply = h.result(timeout=60)
            served["ok" if reply.ok else "error"] = served.get("ok" if reply.ok else "error", 0) + 1
            if not reply.ok:
                served[f"error: {reply.error}"[:200]] = served.get(f"error: {reply.error}"[:200], 0) + 1
        n += 1
        if n % 10 == 0:
            client.reread_policies()
        stop.wait(THINK_S)
    client.close()


def counts(r: redis.Redis) -> dict[str, int]:
    out = dict.fromkeys(POOLS, 0)
    for info, alive in read_registry(r).workers.values():
        if alive and info.tier in out:
            out[info.tier] += 1
    return out


def run(workdir: Path, guard: bool = False) -> dict[str, Any]:
    redis_proc, url = start_redis(workdir)
    os.environ.update({"FLEET_WORKER_BLOCK_MS": "200", "FLEET_WORKER_POLICY_REFRESH_S": "0.5"})
    runtime = ProcessRuntime(url, log_dir=workdir / "logs")
    r = redis.Redis.from_url(url)
    stop, users_stop = threading.Event(), threading.Event()
    served: dict[str, int] = {}
    try:
        write_policy(r, "chat", policy(guard))
        settings = CommanderSettings(commander_id="c-plot", metrics_port=None, interval_s=0.3,
                                     always_tiers=())
        cmd = threading.Thread(target=Commander(redis.Redis.from_url(url), runtime, settings).run,
                               args=(stop,), daemon=True)
        cmd.start()
        load = threading.Thread(target=users_loop, args=(url, users_stop, served), daemon=True)
        load.start()
        t0, samples, steps = time.time(), [], list(GUARD_STEPS if guard else STEPS)
        while (now := time.time() - t0) < END_S:
            if steps and now >= steps[0][0]:
                fleet_main(["--redis-url", url, "rollout", "chat", "green", *steps.pop(0)[1]])
            samples.append({"t": round(now, 2), **counts(r)})
            time.sleep(0.5)
        users_stop.set()
        load.join(timeout=90)
        events = [decode(LedgerEvent, f[b"m"]) for _i, f in ledger_page(r, "+", 10_000)]
        ledger = [{"t": round(e.ts - t0, 2), "tier": e.tier, "action": e.action, "from": e.from_count,
                   "to": e.to_count, "reason": e.reason} for e in sorted(events, key=lambda e: e.ts)]
        return {"samples": samples, "ledger": ledger, "served": served}
    finally:
        stop.set()
        users_stop.set()
        runtime.stop_all(timeout=5.0)
        runtime.reap()
        runtime.close()
        r.close()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


def plot(data: dict[str, Any], out: Path, guard: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    t = [s["t"] for s in data["samples"]]
    for pool, colour in zip(POOLS, ("tab:blue", "tab:green"), strict=True):
        ax.step(t, [s[pool] for s in data["samples"]], where="post", color=colour, label=f"{pool} workers")
    for e in data["ledger"]:
        if e["action"] in ("rollout", "rollout-abort"):
            ax.axvline(e["t"], color="grey", linestyle=":")
            label = ("guard abort: green 0" if e["action"] == "rollout-abort"
                     else e["reason"].partition("-> ")[2].split(" (")[0])
            ax.text(e["t"], ax.get_ylim()[1] * 0.98, label, rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_ylabel("live workers")
    what = "a failing canary aborted by the rollout guard" if guard else "canary rollout"
    ax.set_title(f"{what}, tier chat: {USERS} users, sleep handler 150 ms, concurrency 2")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guard", action="store_true", help="green fails; the rollout guard aborts it")
    p.add_argument("--out", help="path without suffix (default: docs/groups-rollout, or docs/groups-guard)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-rollout-") as tmp:
        data = run(Path(tmp), args.guard)
    out = Path(args.out or ROOT / "docs" / ("groups-guard" if args.guard else "groups-rollout"))
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    plot(data, out, args.guard)
    for e in data["ledger"]:
        if e["action"] != "leader":
            print(f"{e['t']:7.1f}s  {e['tier']:<11} {e['action']:<15} {e['from']}->{e['to']}  "
                  f"{e['reason'][:110]}")
    print(f"served: {data['served']}; wrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
