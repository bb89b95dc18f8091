"""``fleet top``: a live terminal view of tiers, workers, occupancy, the leader and the ledger.

Each frame is read afresh: the registry and heartbeats (as ``fleet status``), the tier
policies and streams, the newest ``REPORT_ROWS`` occupancy reports fed oldest first to an
``Evaluator`` (so the bars are the occupancy the commander judges by), the commanders and
the last ledger events. ``collect`` reads, ``render`` is a pure function of what it read.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import redis

from commander.evaluator import Evaluator, Occupancy, memory_limit_bytes
from fleet.events import Entry, format_event, read_events
from fleet.status import tier_backlog
from fleet.status import workers as registry_workers
from protocol import keys
from protocol.codec import CodecError, decode
from protocol.models import CommanderInfo, OccupancyReport
from stores.policies import PolicyRead, list_tiers, read_policy

REPORT_ROWS = 500
LAST_EVENTS = 5
BAR_WIDTH = 20
MIN_INTERVAL_S = 0.1
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen


@dataclass(frozen=True)
class WorkerRow:
    """One worker as a frame shows it."""

    worker: str
    tier: str
    state: str  # the latest report's state, "starting" before any, "dead" without heartbeat
    occupancy: Occupancy
    busy: int = 0
    total: int = 0
    users: int = 0
    active_users: int = 0
    cpu: float | None = None
    rss: int = 0
    report_age_s: float | None = None


@dataclass(frozen=True)
class TierRow:
    """One tier's policy bounds and signals."""

    tier: str
    min_workers: int
    max_workers: int
    policy_source: str
    policy_error: str | None
    running: int
    starting: int
    draining: int
    dead_workers: int
    backlog: int
    active_users: int
    dead_letters: int


@dataclass(frozen=True)
class Frame:
    """Everything one frame shows."""

    ts: float
    tiers: list[TierRow]
    workers: list[WorkerRow]
    leader: str | None  # "<commander>|<epoch>"
    leader_ttl_ms: int | None
    commanders: list[CommanderInfo | str] = field(default_factory=list)  # a str: a corrupt entry
    events: list[Entry] = field(default_factory=list)
    corrupt_reports: int = 0


def _s(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


# --- reading --------------------------------------------------------------------------
def load_reports(r: redis.Redis, evaluator: Evaluator, count: int = REPORT_ROWS) -> int:
    """Feed the newest ``count`` reports to ``evaluator``, oldest first; returns the corrupt ones."""
    corrupt = 0
    for _id, fields in reversed(r.xrevrange(keys.REPORTS, count=count)):
        blob = fields.get(b"m", fields.get("m"))
        try:
            if blob is None:
                raise CodecError("no field 'm'")
            evaluator.add(decode(OccupancyReport, blob if isinstance(blob, bytes) else _s(blob).encode()))
        except CodecError:
            corrupt += 1
    return corrupt


def _commanders(r: redis.Redis) -> list[CommanderInfo | str]:
    out: list[CommanderInfo | str] = []
    for cid, blob in sorted(r.hgetall(keys.COMMANDERS).items()):
        try:
            out.append(decode(CommanderInfo, blob))
        except CodecError as exc:
            out.append(f"{_s(cid)}: corrupt entry ({exc})")
    return out


def _worker_row(info: dict[str, Any], evaluator: Evaluator, limit: float | None, now: float) -> WorkerRow:
    latest = evaluator.latest(info["worker"])
    occupancy = evaluator.occupancy(info["worker"], limit)
    if latest is None:
        state = "starting" if info["alive"] else "dead"
        return WorkerRow(info["worker"], info["tier"], state, occupancy)
    return WorkerRow(
        worker=info["worker"], tier=info["tier"], state=latest.state if info["alive"] else "dead",
        occupancy=occupancy, busy=latest.slots.busy, total=latest.slots.total, users=latest.users,
        active_users=latest.active_users, cpu=latest.cpu, rss=latest.rss,
        report_age_s=max(0.0, now - latest.ts),
    )


def _tier_row(r: redis.Redis, tier: str, read: PolicyRead, rows: list[WorkerRow], now: float) -> TierRow:
    mine = [w for w in rows if w.tier == tier]
    count = {s: sum(1 for w in mine if w.state == s) for s in ("ready", "starting", "draining", "dead")}
    window = read.policy.active_window_s
    return TierRow(
        tier=tier, min_workers=read.policy.min_workers, max_workers=read.policy.max_workers,
        policy_source=read.source, policy_error=read.error, running=count["ready"],
        starting=count["starting"], draining=count["draining"], dead_workers=count["dead"],
        backlog=tier_backlog(r, tier)["backlog"],
        active_users=int(r.zcount(keys.active(tier), now - window, "+inf")),
        dead_letters=int(r.xlen(keys.dead(tier))),
    )


def _tiers(r: redis.Redis, only: str | None) -> list[str]:
    return [only] if only else sorted(set(list_tiers(r)) | {"chat"})


def collect(r: redis.Redis, tier: str | None = None, handlers: Iterable[str] | None = None,
            now: float | None = None) -> Frame:
    """Read one frame's worth of state."""
    now = time.time() if now is None else now
    handlers = list(handlers) if handlers is not None else None
    evaluator = Evaluator()
    corrupt = load_reports(r, evaluator)
    reads = {t: read_policy(r, t, handlers) for t in _tiers(r, tier)}
    rows = []
    for info in sorted(registry_workers(r), key=lambda w: (w["tier"], w["worker"])):
        if tier is not None and info["tier"] != tier:
            continue
        read = reads.get(info["tier"])
        limit = memory_limit_bytes(read.policy) if read else None
        rows.append(_worker_row(info, evaluator, limit, now))
    tiers = [_tier_row(r, t, read, rows, now) for t, read in reads.items()]
    leader = r.get(keys.LEADER)
    ttl = r.pttl(keys.LEADER) if leader is not None else None
    return Frame(ts=now, tiers=tiers, workers=rows, leader=_s(leader) if leader is not None else None,
                 leader_ttl_ms=ttl if ttl is not None and ttl >= 0 else None,
                 commanders=_commanders(r), events=read_events(r, tier, LAST_EVENTS),
                 corrupt_reports=corrupt)


# --- rendering ------------------------------------------------------------------------
def bar(value: float, width: int = BAR_WIDTH) -> str:
    """``[#####.....]``: ``value`` in [0, 1] as a bar (clipped; the number says the rest)."""
    filled = round(min(max(value, 0.0), 1.0) * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _leader_line(frame: Frame) -> str:
    if frame.leader is None:
        return "leader: none (no commander leads: nothing scales)"
    who, _, epoch = frame.leader.rpartition("|")
    ttl = f", lease {frame.leader_ttl_ms / 1000:.1f}s" if frame.leader_ttl_ms is not None else ""
    return f"leader: {who or frame.leader} (epoch {epoch}{ttl})"


def _commander_lines(frame: Frame) -> list[str]:
    lines = []
    for c in frame.commanders:
        if isinstance(c, str):
            lines.append(f"  {c}")
            continue
        metrics = f"  metrics {c.metrics}" if c.metrics else ""
        lines.append(f"  {c.commander:<24} {c.role:<8} epoch {c.epoch:<4} pid {c.pid} on {c.host}{metrics}")
    return lines


def _tier_lines(frame: Frame) -> list[str]:
    lines = [f"{'TIER':<12}{'MIN':>4}{'MAX':>4}{'RUN':>5}{'START':>6}{'DRAIN':>6}{'DEAD':>5}"
             f"{'BACKLOG':>9}{'ACTIVE':>8}{'DLQ':>6}  POLICY"]
    for t in frame.tiers:
        policy = t.policy_source + (f" (REJECTED: {t.policy_error})" if t.policy_error else "")
        lines.append(f"{t.tier:<12}{t.min_workers:>4}{t.max_workers:>4}{t.running:>5}{t.starting:>6}"
                     f"{t.draining:>6}{t.dead_workers:>5}{t.backlog:>9}{t.active_users:>8}"
                     f"{t.dead_letters:>6}  {policy}")
    return lines


def _worker_line(w: WorkerRow) -> str:
    if w.report_age_s is None:  # no report in the window: nothing is known, not "idle"
        return f"{w.worker[:24]:<25}{w.tier[:10]:<11}{w.state:<10}(no report)"
    occ = f"{bar(w.occupancy.value)} {w.occupancy.value:4.2f}"
    slots = f"{w.busy}/{w.total}"
    users = f"{w.users}/{w.active_users}"
    cpu = "-" if w.cpu is None else f"{w.cpu * 100:.0f}%"
    rss = f"{w.rss / (1024 * 1024):.0f}MB" if w.rss else "-"
    age = "-" if w.report_age_s is None else f"{w.report_age_s:.0f}s"
    return (f"{w.worker[:24]:<25}{w.tier[:10]:<11}{w.state:<10}{occ:<28}{slots:>6}{users:>8}"
            f"{cpu:>6}{rss:>8}{age:>6}")


def _worker_lines(frame: Frame) -> list[str]:
    head = (f"{'WORKER':<25}{'TIER':<11}{'STATE':<10}{'OCCUPANCY':<28}{'SLOTS':>6}{'USERS':>8}"
            f"{'CPU':>6}{'RSS':>8}{'AGE':>6}")
    return [head] + ([_worker_line(w) for w in frame.workers] or ["  (no workers registered)"])


def _event_lines(frame: Frame) -> list[str]:
    lines = [f"LAST {LAST_EVENTS} EVENTS"]
    for entry_id, event in frame.events:
        lines.append("  " + format_event(entry_id, event))
    if not frame.events:
        lines.append("  (the ledger is empty)")
    return lines


def render(frame: Frame) -> str:
    """The frame as text (no terminal codes)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(frame.ts))
    lines = [f"fleet top  {stamp}   {_leader_line(frame)}   commanders: {len(frame.commanders)}"]
    lines += _commander_lines(frame)
    lines += ["", *_tier_lines(frame), "", *_worker_lines(frame)]
    if frame.corrupt_reports:
        lines.append(f"  ({frame.corrupt_reports} corrupt report(s) skipped)")
    lines += ["", *_event_lines(frame)]
    return "\n".join(lines)


# --- the command ----------------------------------------------------------------------
def run_top(r: redis.Redis, interval: float = 2.0, once: bool = False, tier: str | None = None,
            handlers: Iterable[str] | None = None, out: TextIO | None = None) -> int:
    """``fleet top``: one frame with ``once``, else a frame every ``interval`` until Ctrl-C (exit 0).

    With ``once`` a Redis error propagates (the CLI reports it); live, it is shown and retried.
    """
    out = out or sys.stdout
    handlers = list(handlers) if handlers is not None else None
    if once:
        print(render(collect(r, tier, handlers)), file=out, flush=True)
        return 0
    try:
        while True:
            try:
                text = render(collect(r, tier, handlers))
            except redis.RedisError as exc:
                text = f"fleet top: Redis error: {exc} (retrying every {interval:g}s; Ctrl-C quits)"
            out.write(CLEAR + text + "\n")
            out.flush()
            time.sleep(max(interval, MIN_INTERVAL_S))
    except KeyboardInterrupt:
        return 0
