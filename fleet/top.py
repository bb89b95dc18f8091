"""``fleet top``: a live terminal view of tiers, workers, occupancy, the leader and the ledger.

Each frame is read afresh: the registry and heartbeats (as ``fleet status``), the tier
policies and streams, the newest ``REPORT_ROWS`` occupancy reports fed oldest first to an
``Evaluator`` (so the bars are the occupancy the commander judges by), the commanders and
the last ledger events. ``collect`` reads, ``render`` is a pure function of what it read
(and of the width it must fit: the terminal's, or unlimited into a pipe).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import redis
from redis.exceptions import RedisClusterException

from commander.evaluator import Evaluator, Occupancy, memory_limit_bytes
from fleet.events import clip, duration, format_event
from fleet.status import rq_status, tier_backlog
from fleet.status import workers as registry_workers
from fleet.top_rq import rq_lines
from protocol.codec import CodecError, as_str, decode
from protocol.models import CommanderInfo, OccupancyReport
from protocol.policy import RqPolicy
from stores.backlog import active_users
from stores.commanders import commander_entries
from stores.deadletters import dead_letter_count
from stores.group_assignment import read_pool_policy, with_group_pools
from stores.leader_lease import lease_holder, lease_ttl_ms
from stores.ledger import Entry, read_events
from stores.policies import PolicyRead, list_tiers
from stores.reports import newest_reports

REPORT_ROWS = 500
LAST_EVENTS = 5
BAR_WIDTH = 20
MIN_BAR_WIDTH = 5
MIN_INTERVAL_S = 0.1
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
LEGEND = ["  USERS: users served in the last minute / since the previous report",
          "  AGE: since the worker started (as in status); LAST: since its last report"]
DESCRIPTION = ("A live view of tiers, workers, occupancy, the leader and the last ledger events. "
               "Each frame fits the terminal: its width (columns are narrowed, then RSS, CPU, LAST and "
               "TIER dropped) and its height (a fleet too large for it shows its busiest workers and "
               "how many more there are); into a pipe it is printed whole. Worker columns: USERS = "
               "users served in the last minute / since the previous report; AGE = time since the "
               "worker started (as in `fleet status`); LAST = time since its last occupancy report. "
               "q (in a terminal) or Ctrl-C quits.")

_s = functools.partial(as_str, errors="replace")  # a monitor shows bad bytes, never fails on them


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
    age_s: float = 0.0  # since the worker started (its registry entry), as ``fleet status`` shows


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
    rq: dict[str, dict[str, Any]] = field(default_factory=dict)  # rq tiers: fleet.status.rq_status


# --- reading --------------------------------------------------------------------------
def load_reports(r: redis.Redis, evaluator: Evaluator, count: int = REPORT_ROWS) -> int:
    """Feed the newest ``count`` reports to ``evaluator``, oldest first; returns the corrupt ones."""
    corrupt = 0
    for _id, fields in reversed(newest_reports(r, count)):
        loose: Mapping[Any, bytes | str] = fields  # keyed by str too, should a client decode replies
        blob = loose.get(b"m", loose.get("m"))
        try:
            if blob is None:
                raise CodecError("no field 'm'")
            evaluator.add(decode(OccupancyReport, blob if isinstance(blob, bytes) else _s(blob).encode()))
        except CodecError:
            corrupt += 1
    return corrupt


def _commanders(r: redis.Redis) -> list[CommanderInfo | str]:
    out: list[CommanderInfo | str] = []
    for cid, entry in sorted(commander_entries(r), key=lambda e: e[0]):
        out.append(f"{cid}: corrupt entry ({entry})" if isinstance(entry, CodecError) else entry)
    return out


def _worker_row(info: dict[str, Any], evaluator: Evaluator, limit: float | None, now: float) -> WorkerRow:
    latest = evaluator.latest(info["worker"])
    occupancy = evaluator.occupancy(info["worker"], limit)
    if latest is None:
        state = "starting" if info["alive"] else "dead"
        return WorkerRow(info["worker"], info["tier"], state, occupancy, age_s=info["age_s"])
    return WorkerRow(
        worker=info["worker"], tier=info["tier"], state=latest.state if info["alive"] else "dead",
        occupancy=occupancy, busy=latest.slots.busy, total=latest.slots.total, users=latest.users,
        active_users=latest.active_users, cpu=latest.cpu, rss=latest.rss,
        report_age_s=max(0.0, now - latest.ts), age_s=info["age_s"],
    )


def _tier_row(r: redis.Redis, tier: str, read: PolicyRead, rows: list[WorkerRow], now: float,
              rq: Mapping[str, Any] | None = None) -> TierRow:
    mine = [w for w in rows if w.tier == tier]
    count = {s: sum(1 for w in mine if w.state == s) for s in ("ready", "starting", "draining", "dead")}
    rq = rq if rq is not None and "rq_error" not in rq else None
    if rq is not None:  # an rq tier: RQ's workers, its queued jobs
        count["ready"] = rq["workers_alive"]
    window = read.policy.scale_rules().scaling.active_window_s
    return TierRow(
        tier=tier, min_workers=read.policy.min_workers, max_workers=read.policy.max_workers,
        policy_source=read.source, policy_error=read.error, running=count["ready"],
        starting=count["starting"], draining=count["draining"], dead_workers=count["dead"],
        backlog=rq["backlog"] if rq is not None else tier_backlog(r, tier)["backlog"],
        active_users=active_users(r, tier, now - window),
        dead_letters=dead_letter_count(r, tier),
    )


def _tiers(r: redis.Redis, only: str | None) -> list[str]:
    """The tiers, each followed by its groups' pools (``--tier chat``: chat and its groups')."""
    return with_group_pools(r, [only] if only else sorted(set(list_tiers(r)) | {"chat"}))


def collect(r: redis.Redis, tier: str | None = None, handlers: Iterable[str] | None = None,
            now: float | None = None) -> Frame:
    """Read one frame's worth of state."""
    now = time.time() if now is None else now
    handlers = list(handlers) if handlers is not None else None
    evaluator = Evaluator()
    corrupt = load_reports(r, evaluator)
    reads = {t: read_pool_policy(r, t, handlers) for t in _tiers(r, tier)}
    rows = []
    for info in sorted(registry_workers(r), key=lambda w: (w["tier"], w["worker"])):
        if tier is not None and info["tier"] not in reads:
            continue
        read = reads.get(info["tier"])
        limit = memory_limit_bytes(read.policy.scale_rules()) if read else None
        rows.append(_worker_row(info, evaluator, limit, now))
    rq = {t: rq_status(r, t, read.policy) for t, read in reads.items() if isinstance(read.policy, RqPolicy)}
    tiers = [_tier_row(r, t, read, rows, now, rq.get(t)) for t, read in reads.items()]
    leader = lease_holder(r)
    ttl = lease_ttl_ms(r) if leader is not None else None
    return Frame(ts=now, tiers=tiers, workers=rows, leader=leader,
                 leader_ttl_ms=ttl if ttl is not None and ttl >= 0 else None,
                 commanders=_commanders(r), events=read_events(r, tier, LAST_EVENTS),
                 corrupt_reports=corrupt, rq=rq)


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


def _worker_cells(w: WorkerRow, bar_width: int) -> dict[str, str]:
    cells = {"WORKER": w.worker, "TIER": w.tier, "STATE": w.state, "AGE": duration(w.age_s)}
    if w.report_age_s is None:  # no report in the window: nothing is known, not "idle"
        return {**cells, "OCCUPANCY": "(no report)"}
    return {**cells, "OCCUPANCY": f"{bar(w.occupancy.value, bar_width)} {w.occupancy.value:4.2f}",
            "SLOTS": f"{w.busy}/{w.total}", "USERS": f"{w.users}/{w.active_users}",
            "CPU": "-" if w.cpu is None else f"{w.cpu * 100:.0f}%",
            "RSS": f"{w.rss / (1024 * 1024):.0f}MB" if w.rss else "-",
            "LAST": duration(w.report_age_s)}


# the right-aligned columns and their widths (a separating space included)
_RIGHT = {"SLOTS": 6, "USERS": 8, "CPU": 5, "RSS": 7, "AGE": 5, "LAST": 5}
_DROP_ORDER = ("RSS", "CPU", "LAST", "TIER")  # when even the narrowest bar does not fit


def _worker_layout(frame: Frame, width: int | None) -> tuple[dict[str, int], int]:
    """Column widths (in order) and the bar width: all at full size, or fitted into ``width``.

    OCCUPANCY is ``[`` bar ``] 0.52`` and a space: the bar's width plus 8.
    """
    widths = {"WORKER": min(25, max([6, *(len(w.worker) for w in frame.workers)]) + 1),
              "TIER": min(11, max([4, *(len(w.tier) for w in frame.workers)]) + 1),
              "STATE": 10, "OCCUPANCY": 0, **_RIGHT}
    bar_width = BAR_WIDTH
    if width is not None:
        for name in _DROP_ORDER:
            if sum(widths.values()) + MIN_BAR_WIDTH + 8 <= width:
                break
            del widths[name]
        bar_width = min(BAR_WIDTH, max(MIN_BAR_WIDTH, width - sum(widths.values()) - 8))
    widths["OCCUPANCY"] = bar_width + 8
    return widths, bar_width


def busiest(workers: list[WorkerRow], n: int) -> list[WorkerRow]:
    """The ``n`` busiest workers, busiest first (those without a report last, then by tier and id)."""
    def key(w: WorkerRow) -> tuple[float, str, str]:
        return (-w.occupancy.value if w.report_age_s is not None else 1.0, w.tier, w.worker)
    return sorted(workers, key=key)[:max(0, n)]


def _worker_lines(frame: Frame, width: int | None = None, rows_left: int | None = None) -> list[str]:
    """The worker table; with ``rows_left`` (the lines it may take), cut to the busiest that fit
    and a line that says how many more there are."""
    widths, bar_width = _worker_layout(frame, width)

    def line(cells: dict[str, str]) -> str:
        out = ""
        for name, size in widths.items():
            text = clip(cells.get(name, ""), size - 1)
            out += f"{text:>{size}}" if name in _RIGHT else f"{text:<{size}}"
        return out.rstrip()

    header = line({name: name for name in widths})
    if not frame.workers:
        return [header, "  (no workers registered)"]
    shown, more = frame.workers, []
    if rows_left is not None and 1 + len(shown) + len(LEGEND) > rows_left:
        shown = busiest(frame.workers, rows_left - 2 - len(LEGEND))
        more = [f"  ... {len(frame.workers) - len(shown):,} more of {len(frame.workers):,} workers, "
                f"busiest shown first (--tier to narrow, `fleet status --page` to list them all)"]
    return [header, *(line(_worker_cells(w, bar_width)) for w in shown), *more, *LEGEND]


def _event_lines(frame: Frame, brief: bool) -> list[str]:
    lines = [f"LAST {LAST_EVENTS} EVENTS"]
    for entry_id, event in frame.events:
        lines.append("  " + format_event(entry_id, event, brief))
    if not frame.events:
        lines.append("  (the ledger is empty)")
    return lines


def render(frame: Frame, width: int | None = None, height: int | None = None) -> str:
    """The frame as text (no terminal codes); every line fits ``width`` if given (cut with ``…``),
    and with ``height`` the worker table shows only the busiest workers that fit in it."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(frame.ts))
    top = [f"fleet top  {stamp}   commanders: {len(frame.commanders)}", _leader_line(frame),
           *_commander_lines(frame), "", *_tier_lines(frame), ""]
    bottom = [f"  ({frame.corrupt_reports} corrupt report(s) skipped)"] if frame.corrupt_reports else []
    bottom += [*rq_lines(frame.rq), "", *_event_lines(frame, brief=width is not None)]
    # (a terminal of h lines shows h - 1 and the cursor: the table gets what the rest leaves)
    rows_left = None if height is None else max(height - 1 - len(top) - len(bottom), 3 + len(LEGEND))
    lines = [*top, *_worker_lines(frame, width, rows_left), *bottom]
    return "\n".join(lines if width is None else [clip(line, width) for line in lines])


def terminal_size() -> tuple[int | None, int | None]:
    """The terminal's width and height (``$COLUMNS``, ``$LINES`` first), or None for each when
    stdout is not a terminal."""
    size = shutil.get_terminal_size(fallback=(0, 0))
    return size.columns or None, size.lines or None


# --- the command ----------------------------------------------------------------------
@contextlib.contextmanager
def keypresses(stream: TextIO) -> Iterator[int | None]:
    """The file descriptor of ``stream`` in cbreak mode (keys unbuffered) if it is a terminal,
    else None; the terminal's mode is restored on the way out."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = -1
    if fd < 0 or not os.isatty(fd):
        yield None
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def quit_pressed(fd: int | None, seconds: float) -> bool:
    """Wait ``seconds``; True at once if ``q`` is pressed on the terminal ``fd``."""
    deadline = time.monotonic() + seconds
    while fd is not None and (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            return False
        key = os.read(fd, 1)
        if key in (b"q", b"Q"):
            return True
        if not key:  # the terminal went away: wait out the interval
            break
    time.sleep(max(0.0, deadline - time.monotonic()))
    return False


def run_top(r: redis.Redis, interval: float = 2.0, once: bool = False, tier: str | None = None,
            handlers: Iterable[str] | None = None, out: TextIO | None = None,
            keys_from: TextIO | None = None) -> int:
    """``fleet top``: one frame with ``once``, else a frame every ``interval`` until ``q`` (on a
    terminal) or Ctrl-C (exit 0). Each frame fits the terminal's width and height.

    With ``once`` a Redis error propagates (the CLI reports it); live, it is shown and retried.
    """
    out = out or sys.stdout
    handlers = list(handlers) if handlers is not None else None
    if once:
        print(render(collect(r, tier, handlers), *terminal_size()), file=out, flush=True)
        return 0
    try:
        with keypresses(keys_from or sys.stdin) as fd:
            while True:
                try:
                    text = render(collect(r, tier, handlers), *terminal_size())
                except (redis.RedisError, RedisClusterException) as exc:
                    text = f"fleet top: Redis error: {exc} (retrying every {interval:g}s; q quits)"
                out.write(CLEAR + text + "\n")
                out.flush()
                if quit_pressed(fd, max(interval, MIN_INTERVAL_S)):
                    return 0
    except KeyboardInterrupt:
        return 0
