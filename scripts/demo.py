"""The demo's load: many users in parallel, a worker SIGKILLed mid-way, every turn checked."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import Counter

from fleet.client import Fleet
from fleet.status import workers
from protocol import keys
from protocol.codec import decode
from protocol.models import SessionEntry

USERS, TURNS = 100, 5


def wait_for_workers(fleet: Fleet, n: int, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [w for w in workers(fleet.r) if w["alive"] and w["tier"] == "chat"]
        if len(alive) >= n:
            return alive
        if time.monotonic() > deadline:
            sys.exit(f"demo: only {len(alive)} of {n} workers came up")
        time.sleep(0.1)


def main() -> int:
    fleet = Fleet()
    alive = wait_for_workers(fleet, 2)
    print(f"== {USERS} users x {TURNS} turns, submitted at once, 50 ms handler; "
          f"SIGKILL worker {alive[0]['worker']} in the middle")
    time.sleep(2.5)  # workers re-read their policy every 2 s: let them take the sleep handler
    names = [f"user{i:03d}" for i in range(USERS)]
    t0 = time.monotonic()
    handles = fleet.submit_many([(u, f"{u} turn {t}") for t in range(TURNS) for u in names])
    killer = threading.Timer(0.5, os.kill, (alive[0]["pid"], signal.SIGKILL))
    killer.start()
    replies = fleet.results(handles, timeout=120)
    elapsed = time.monotonic() - t0
    by_worker = Counter(r.worker for r in replies)
    in_order = all(
        [decode(SessionEntry, raw).text for raw in fleet.r.lrange(keys.session(u), 0, -1)]
        == [f"{u} turn {t}" for t in range(TURNS)] for u in names)
    leftover = sum(1 for _ in fleet.r.scan_iter(match="fleet:u:*:reply:*", count=1000))
    print(f"   {len(replies)} turns answered in {elapsed:.1f} s; ok: {sum(r.ok for r in replies)}; "
          f"retried after the kill: {sum(r.attempts > 1 for r in replies)}")
    print(f"   every session holds its turns once, in order: {in_order}; duplicate replies: {leftover}")
    print("   turns per worker: " + ", ".join(f"{w} {n}" for w, n in sorted(by_worker.items())))
    wait_for_workers(fleet, 2)
    print("   the commander scaled the tier for the burst and replaced the killed worker; live now: "
          + ", ".join(w["worker"] for w in workers(fleet.r) if w["alive"]))
    return 0 if in_order and leftover == 0 and all(r.ok for r in replies) else 1


if __name__ == "__main__":
    sys.exit(main())
