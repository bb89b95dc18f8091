"""The demo's load: many users at once, a worker SIGKILLed mid-way, and a report of what happened.

Every line it prints comes from what it observed (the replies, the sessions in Redis, the worker
registry, the commander's ledger), and it exits 1, saying what is missing, when something it
shows did not happen: a turn unanswered or answered twice, a session out of order, the kill not
landing, the killed worker not taken over, the tier not back at its floor.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psutil

from fleet.client import Fleet
from fleet.status import workers
from protocol import keys
from protocol.codec import decode
from protocol.models import Reply, SessionEntry

USERS, TURNS = 100, 5
MIN_WORKERS = 2  # what scripts/demo sets on the tier before this runs
KILL_AFTER_S = 0.5
FLEET = [sys.executable, "-m", "fleet.cli"]
SCALE_ACTIONS = ("scale-up", "scale-down", "reclaim-idle", "consolidate")
T = TypeVar("T")


@dataclass
class Observed:
    """What the run saw; ``report`` turns it into lines and failures."""

    submitted: int
    replies: list[Reply]
    elapsed_s: float
    sessions_in_order: int  # users whose session holds their turns once each, in order
    users: int
    unread_replies: int  # reply lists left in Redis: a turn answered twice leaves one
    victim: str
    killed_at_s: float | None  # when the SIGKILL was sent (None: the process was gone already)
    victim_alive_after: bool
    takeover: dict[str, Any] | None  # the ledger's worker-exited event for the victim
    before: set[str]  # live workers of the tier before the load
    peak: int  # the most live workers seen during the load
    after: set[str]  # live workers of the tier at the end
    scale_events: list[str] = field(default_factory=list)  # the ledger's, during the run


def report(o: Observed) -> tuple[list[str], list[str]]:
    """The lines to print, and what did not happen that should have (empty: all did)."""
    ok = sum(r.ok for r in o.replies)
    retried = sum(r.attempts > 1 for r in o.replies)
    by_worker = Counter(r.worker for r in o.replies)
    started_after = sorted(o.after - o.before)
    lines = [
        f"   {len(o.replies)} of {o.submitted} turns answered in {o.elapsed_s:.1f} s; ok: {ok}; "
        f"answered on a second attempt or later: {retried}",
        f"   sessions holding their turns once each, in order: {o.sessions_in_order} of {o.users} users; "
        f"replies left unread (a turn answered twice would leave one): {o.unread_replies}",
        "   turns per worker: " + ", ".join(f"{w} {n}" for w, n in sorted(by_worker.items())),
        (f"   SIGKILL to {o.victim} at {o.killed_at_s:.1f} s; its process is "
         f"{'still alive' if o.victim_alive_after else 'gone'}" if o.killed_at_s is not None
         else f"   {o.victim} had exited before its SIGKILL was due"),
    ]
    if o.takeover is not None:
        users = o.takeover.get("why", {}).get("takeover", {}).get("users", "?")
        lines.append(f"   the commander's ledger: worker-exited {o.victim}, {users} user(s) handed on")
    lines.append("   the commander's scale events during the run: " + ("; ".join(o.scale_events) or "none"))
    lines.append(f"   live workers: {len(o.before)} before, at most {o.peak} during the load, "
                 f"{len(o.after)} now ({len(started_after)} started since the load began: "
                 f"{', '.join(started_after) or 'none'})")
    failures = []
    if len(o.replies) != o.submitted or ok != o.submitted:
        failures.append(f"{o.submitted - ok} of {o.submitted} turns not answered ok")
    if o.sessions_in_order != o.users or o.unread_replies:
        failures.append("a session out of order or a turn answered twice")
    if o.killed_at_s is None or o.victim_alive_after:
        failures.append(f"the SIGKILL of {o.victim} did not land")
    if o.takeover is None:
        failures.append(f"no worker-exited event for {o.victim}: the commander did not take it over")
    if o.victim in o.after or len(o.after) < MIN_WORKERS:
        failures.append(f"the tier is not back at {MIN_WORKERS} live workers without {o.victim}")
    return lines, failures


def live_chat_workers(fleet: Fleet) -> dict[str, dict[str, Any]]:
    return {w["worker"]: w for w in workers(fleet.r) if w["alive"] and w["tier"] == "chat"}


def wait_for(what: str, check: Callable[[], T | None], timeout: float) -> T:
    """``check()`` once it is truthy; the demo fails, saying ``what``, if it is not in time."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            sys.exit(f"demo: FAILED: {what} did not happen within {timeout:.0f} s")
        time.sleep(0.1)
    return got


def ledger(tier: str) -> list[dict[str, Any]]:
    """The tier's ledger, through the CLI's JSON."""
    out = subprocess.run([*FLEET, "events", "--tier", tier, "--count", "500", "--json"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    events: list[dict[str, Any]] = json.loads(out)
    return events


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, killed and not reaped yet, is not)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


class Load:
    """The burst: every user's turns submitted at once, the victim SIGKILLed on a timer, the
    tier's live workers sampled meanwhile."""

    def __init__(self, fleet: Fleet, victim_pid: int, floor: int) -> None:
        self.fleet, self.victim_pid = fleet, victim_pid
        self.peak = floor
        self.killed_at: float | None = None
        self._stop = threading.Event()
        self._t0 = 0.0

    def run(self, names: list[str]) -> tuple[list[Reply], float, int]:
        """(the replies, the seconds they took, how many turns were submitted)."""
        sampler = threading.Thread(target=self._sample, daemon=True)
        self._t0 = time.monotonic()
        sampler.start()
        handles = self.fleet.submit_many([(u, f"{u} turn {t}") for t in range(TURNS) for u in names])
        killer = threading.Timer(KILL_AFTER_S, self._kill)
        killer.start()
        replies = self.fleet.results(handles, timeout=120)
        elapsed = time.monotonic() - self._t0
        killer.join()
        return replies, elapsed, len(handles)

    def stop(self) -> None:
        self._stop.set()

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, len(live_chat_workers(self.fleet)))

    def _kill(self) -> None:
        try:
            os.kill(self.victim_pid, signal.SIGKILL)
            self.killed_at = time.monotonic() - self._t0
        except ProcessLookupError:
            pass


def sessions_in_order(fleet: Fleet, names: list[str]) -> int:
    """Users whose session holds their turns once each, in submission order."""
    def texts(user: str) -> list[str]:
        rows = fleet.r.lrange(keys.session(user), 0, -1)
        return [decode(SessionEntry, raw if isinstance(raw, bytes) else raw.encode()).text for raw in rows]

    return sum(texts(u) == [f"{u} turn {t}" for t in range(TURNS)] for u in names)


def takeover_of(victim: str) -> dict[str, Any] | None:
    return next((e for e in ledger("chat") if e.get("action") == "worker-exited"
                 and victim in e.get("victims", [])), None)


def at_least(fleet: Fleet, n: int) -> dict[str, dict[str, Any]] | None:
    live = live_chat_workers(fleet)
    return live if len(live) >= n else None


def back_at_floor(fleet: Fleet, victim: str) -> dict[str, dict[str, Any]] | None:
    live = live_chat_workers(fleet)
    return live if victim not in live and len(live) >= MIN_WORKERS else None


def scale_events_since(wall: float) -> list[str]:
    return [f"{e['action']} {e['from_count']}->{e['to_count']}" for e in ledger("chat")
            if e.get("ts", 0) >= wall and e.get("action") in SCALE_ACTIONS]


def main() -> int:
    fleet = Fleet()
    before = wait_for(f"{MIN_WORKERS} live chat workers", lambda: at_least(fleet, MIN_WORKERS), 30)
    # the workers take the policy's new handler at their next refresh: wait until one answers with it
    wait_for("the sleep handler in force",
             lambda: fleet.submit("probe", "ready?").result(10).text.startswith("slept:"), 30)
    victim = sorted(before)[0]
    print(f"== {USERS} users x {TURNS} turns, submitted at once, 50 ms handler; "
          f"SIGKILL worker {victim} {KILL_AFTER_S} s in")
    names = [f"user{i:03d}" for i in range(USERS)]
    wall = time.time()
    load = Load(fleet, int(before[victim]["pid"]), len(before))
    replies, elapsed, submitted = load.run(names)
    takeover = (wait_for(f"a worker-exited event for {victim}", lambda: takeover_of(victim), 30)
                if load.killed_at is not None else takeover_of(victim))
    after = wait_for(f"{MIN_WORKERS} live chat workers without {victim}",
                     lambda: back_at_floor(fleet, victim), 60)
    load.stop()
    unread = sum(1 for _ in fleet.r.scan_iter(match="fleet:u:*:reply:*", count=1000))
    lines, failures = report(Observed(
        submitted=submitted, replies=replies, elapsed_s=elapsed,
        sessions_in_order=sessions_in_order(fleet, names), users=len(names), unread_replies=unread,
        victim=victim, killed_at_s=load.killed_at, victim_alive_after=alive(int(before[victim]["pid"])),
        takeover=takeover, before=set(before), peak=load.peak, after=set(after),
        scale_events=scale_events_since(wall)))
    print("\n".join(lines))
    for failure in failures:
        print(f"demo: FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
