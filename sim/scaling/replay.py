"""``fleet replay TRACE.csv``: drive a real fleet with a trace's arrivals, sped up ``--speed`` times.

Each turn of the trace model (``sim.scaling.trace``: users, conversations, think times and
service times derived from the token counts) is submitted at its arrival time divided by
``--speed``, with ``meta={"sleep_ms": service_ms / speed}`` for the ``sleep`` handler (the
tier's policy must run ``handler=sleep``: it is checked, and set with ``--set-handler``).
Replies are awaited concurrently. Per turn: submit and reply times (seconds after the start)
and ``wait = reply - submit - service``; every 0.5 s the tier's live workers (registered with
a heartbeat); at the end the scaling ledger's scale events during the run. A progress line
goes to stderr every second; ``--out DIR`` gets ``replay.json``, ``turns.csv`` and
``workers.csv``.

Bounded: the run stops ``--grace`` seconds after the last submit (unanswered turns are
counted). Loopback only: it refuses a Redis that is not on 127.0.0.1/localhost/::1 or a
unix socket, so a benchmark cannot load a shared server by mistake.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import redis.asyncio as aioredis

from fleet.client import AsyncFleet, TurnTimeout
from protocol import keys
from protocol.codec import CodecError, decode
from protocol.models import LedgerEvent, WorkerInfo
from protocol.policy import TurnsPolicy
from sim.scaling.trace import TraceModel, TraceTurn, load_turns, speed_up
from stores.replies import hash_reply, raw_rows

LOOPBACK = {"127.0.0.1", "localhost", "::1", ""}
SAMPLE_S = 0.5
UP_ACTIONS = {"scale-up"}
DOWN_ACTIONS = {"scale-down", "reclaim-idle", "consolidate"}


@dataclass
class TurnRecord:
    """One replayed turn; times are seconds after the replay started (NaN: no reply)."""

    index: int
    user: str
    turn: int
    at: float
    service_s: float
    submit: float = math.nan
    reply: float = math.nan
    wait_s: float = math.nan
    ok: bool = False
    error: str = ""


@dataclass
class ReplayResult:
    """What a replay measured."""

    speed: float
    tier: str
    turns: list[TurnRecord]
    workers: list[tuple[float, int]] = field(default_factory=list)  # (t, live workers)
    scale_ups: int = 0
    scale_downs: int = 0
    elapsed_s: float = 0.0

    def worker_seconds(self, until: float | None = None) -> float:
        """The integral of the sampled live-worker count up to ``until`` (default: the end)."""
        end = self.elapsed_s if until is None else until
        total = 0.0
        for (t0, n), (t1, _) in zip(self.workers, [*self.workers[1:], (end, 0)], strict=True):
            total += n * max(0.0, min(t1, end) - min(t0, end))
        return total

    def summary(self, slo_s: float) -> dict[str, Any]:
        """p50/p99 wait, SLO violations (wait > ``slo_s`` or no reply), worker-seconds, scale events."""
        from sim.scaling.simulate import quantile

        waits = [max(0.0, r.wait_s) for r in self.turns if r.ok]
        unanswered = sum(1 for r in self.turns if not r.ok)
        over = sum(1 for w in waits if w > slo_s) + unanswered
        horizon = max((r.at for r in self.turns), default=0.0)
        counts = [n for _, n in self.workers] or [0]
        return {"policy": "fleet (real)", "turns": len(self.turns), "unserved": unanswered,
                "p50_wait_s": round(quantile(waits, 50), 3), "p99_wait_s": round(quantile(waits, 99), 3),
                "max_wait_s": round(max(waits, default=0.0), 3), "slo_violations": over,
                "slo_violation_pct": round(100.0 * over / max(1, len(self.turns)), 2),
                "worker_seconds": round(self.worker_seconds(horizon), 1),
                "mean_workers": round(self.worker_seconds(horizon) / max(horizon, 1e-9), 2),
                "peak_workers": max(counts), "scale_ups": self.scale_ups, "scale_downs": self.scale_downs,
                "scale_events": self.scale_ups + self.scale_downs, "elapsed_s": round(self.elapsed_s, 1)}


def check_loopback(url: str) -> None:
    """Raise ``ValueError`` unless ``url`` is a Redis on this machine."""
    parsed = urlparse(url)
    if parsed.scheme == "unix" or (parsed.hostname or "") in LOOPBACK:
        return
    raise ValueError(f"refusing to replay against {parsed.hostname}: loopback Redis only")


async def _live_workers(r: aioredis.Redis, tier: str) -> int:
    infos = []
    for blob in hash_reply(await r.hgetall(keys.WORKERS)).values():
        try:
            info = decode(WorkerInfo, blob)
        except CodecError:
            continue
        if info.tier == tier:
            infos.append(info.worker)
    if not infos:
        return 0
    pipe = r.pipeline(transaction=False)
    for wid in infos:
        pipe.exists(keys.heartbeat(wid))
    return sum(1 for alive in await pipe.execute() if alive)


async def _scale_events(r: aioredis.Redis, tier: str, since_ms: int) -> tuple[int, int]:
    ups = downs = 0
    for _id, fields in raw_rows(await r.xrange(keys.EVENTS, min=f"{since_ms}-0", max="+")):
        try:
            event = decode(LedgerEvent, fields.get(b"m", b""))
        except CodecError:
            continue
        if event.tier == tier:
            ups += event.action in UP_ACTIONS
            downs += event.action in DOWN_ACTIONS
    return ups, downs


class _Run:
    """One replay in progress: the submit schedule, the replies, the samplers."""

    def __init__(self, fleet: AsyncFleet, turns: list[TraceTurn], tier: str, progress: bool) -> None:
        self.fleet, self.tier, self.progress = fleet, tier, progress
        self.records = [TurnRecord(t.index, t.user, t.turn, t.at, t.service_s) for t in turns]
        self.workers: list[tuple[float, int]] = []
        self.t0 = time.monotonic()
        self.submitted = self.replied = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def one(self, rec: TurnRecord, deadline: float) -> None:
        rec.submit = self.now()
        try:
            turn = await self.fleet.submit(rec.user, f"turn {rec.turn} of {rec.user}", tier=self.tier,
                                           meta={"sleep_ms": round(rec.service_s * 1000, 3)})
            self.submitted += 1
            reply = await self.fleet.wait(rec.user, turn.turn_id, timeout=max(0.1, deadline - self.now()))
        except TurnTimeout:
            rec.error = "timeout"
            return
        except Exception as exc:  # one turn's failure is a data point, not the end of the run
            rec.error = f"{type(exc).__name__}: {exc}"[:200]
            return
        rec.reply = self.now()
        rec.ok, rec.error = reply.ok, reply.error or ""
        rec.wait_s = rec.reply - rec.submit - rec.service_s
        self.replied += 1

    async def sample(self, stop: asyncio.Event) -> None:
        last_print = -1.0
        while not stop.is_set():
            t = self.now()
            try:
                self.workers.append((t, await _live_workers(self.fleet.r, self.tier)))
            except Exception as exc:  # a missed sample is a gap, not a failure
                print(f"fleet replay: sampling failed: {exc}", file=sys.stderr)
            if self.progress and t - last_print >= 1.0:
                last_print = t
                live = self.workers[-1][1] if self.workers else 0
                print(f"  t={t:6.1f}s submitted {self.submitted}/{len(self.records)} "
                      f"replied {self.replied} in flight {self.submitted - self.replied} "
                      f"workers {live}", file=sys.stderr, flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_S)

    async def drive(self, grace_s: float) -> None:
        last = self.records[-1].at if self.records else 0.0
        deadline = last + grace_s
        tasks = []
        for rec in self.records:
            delay = rec.at - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(rec, deadline)))
        await asyncio.gather(*tasks)


async def replay(url: str, turns: list[TraceTurn], *, speed: float, tier: str = "chat",
                 grace_s: float = 30.0, progress: bool = True) -> ReplayResult:
    """Submit ``turns`` (already sped up: ``sim.scaling.trace.speed_up``) to the fleet at ``url``."""
    check_loopback(url)
    fleet = AsyncFleet(url)
    since_ms = int(time.time() * 1000)
    run = _Run(fleet, turns, tier, progress)
    stop = asyncio.Event()
    sampler = asyncio.create_task(run.sample(stop))
    try:
        await run.drive(grace_s)
    finally:
        stop.set()
        await sampler
    elapsed = run.now()
    run.workers.append((elapsed, await _live_workers(fleet.r, tier)))
    ups, downs = await _scale_events(fleet.r, tier, since_ms)
    await fleet.aclose()
    return ReplayResult(speed, tier, run.records, run.workers, ups, downs, elapsed)


def write_outputs(result: ReplayResult, out: Path, slo_s: float) -> dict[str, Any]:
    """``replay.json`` (summary, workers, turns), ``turns.csv`` and ``workers.csv`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    summary = result.summary(slo_s)
    body = {"speed": result.speed, "tier": result.tier, "slo_s": slo_s, "summary": summary,
            "workers": result.workers, "turns": [asdict(r) for r in result.turns]}
    (out / "replay.json").write_text(json.dumps(body, indent=1, default=str))
    with open(out / "turns.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "user", "turn", "at_s", "service_s", "submit_s", "reply_s", "wait_s", "ok",
                    "error"])
        for r in result.turns:
            w.writerow([r.index, r.user, r.turn, f"{r.at:.4f}", f"{r.service_s:.4f}", f"{r.submit:.4f}",
                        f"{r.reply:.4f}", f"{r.wait_s:.4f}", int(r.ok), r.error])
    with open(out / "workers.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "workers"])
        w.writerows([(f"{t:.3f}", n) for t, n in result.workers])
    return summary


# --- the command -----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """``fleet replay``'s options; the epilog documents the trace model."""
    from sim.scaling import trace

    p.epilog = "How the trace becomes turns (sim/scaling/trace.py):\n" + (trace.__doc__ or "")
    p.add_argument("trace", type=Path, help="CSV with TIMESTAMP,ContextTokens,GeneratedTokens")
    p.add_argument("--speed", type=float, default=10.0, help="replay K times faster (default 10)")
    p.add_argument("--tier", default="chat")
    p.add_argument("--start", type=float, default=0.0, help="slice start, trace seconds")
    p.add_argument("--duration", type=float, default=None, help="slice length, trace seconds")
    p.add_argument("--limit", type=int, default=None, help="at most N turns")
    p.add_argument("--service-scale", type=float, default=1.0,
                   help="multiply every service time (default 1: mean ~5.6 s before --speed)")
    p.add_argument("--mean-turns", type=float, default=3.5, help="mean turns per conversation")
    p.add_argument("--think-s", type=float, default=20.0, help="mean think time between a user's turns")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--slo", type=float, default=1.0,
                   help="a wait above SLO/speed seconds is a violation (default 1 trace second)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds to wait for replies after the last submit")
    p.add_argument("--set-handler", action="store_true",
                   help="set the tier's policy to handler=sleep if it runs another handler")
    p.add_argument("--out", type=Path, default=None, help="directory for replay.json, turns.csv, workers.csv")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def model_from(args: argparse.Namespace) -> TraceModel:
    """The trace model of the command-line options."""
    return TraceModel(mean_turns=args.mean_turns, think_mean_s=args.think_s,
                      think_min_s=min(2.0, args.think_s), service_scale=args.service_scale, seed=args.seed)


def ensure_sleep_handler(url: str, tier: str, set_it: bool) -> None:
    """Check (or set) ``handler=sleep`` in the tier's policy; ``ValueError`` when it is not."""
    from stores.connection import connect_sync
    from stores.policies import read_policy, write_policy

    r = connect_sync(url)
    try:
        policy = read_policy(r, tier).policy
        if not isinstance(policy, TurnsPolicy):
            raise ValueError(f"tier {tier} is an rq tier; replay sends turns")
        if policy.handler == "sleep":
            return
        if not set_it:
            raise ValueError(f"tier {tier} runs handler={policy.handler}; replay needs handler=sleep "
                             f"(`fleet policy set {tier} handler=sleep`, or --set-handler)")
        write_policy(r, tier, policy.model_copy(update={"handler": "sleep"}))
        print(f"fleet replay: tier {tier}: handler set to sleep", file=sys.stderr)
    finally:
        r.close()


def run_command(args: argparse.Namespace, url: str) -> int:
    """``fleet replay``: returns the exit code (1 when some turn got no ok reply)."""
    if args.speed <= 0:
        raise ValueError("--speed must be positive")
    check_loopback(url)
    ensure_sleep_handler(url, args.tier, args.set_handler)
    turns = speed_up(load_turns(args.trace, model_from(args), args.start, args.duration, args.limit),
                     args.speed)
    if not turns:
        raise ValueError("no turns in that slice of the trace")
    span = turns[-1].at
    print(f"fleet replay: {len(turns)} turns over {span:.1f} s (x{args.speed:g}) on tier {args.tier}",
          file=sys.stderr)
    result = asyncio.run(replay(url, turns, speed=args.speed, tier=args.tier, grace_s=args.grace,
                                progress=not args.quiet))
    slo = args.slo / args.speed
    summary = write_outputs(result, args.out, slo) if args.out else result.summary(slo)
    print(json.dumps(summary))
    return 0 if summary["unserved"] == 0 else 1
