"""Shrink a failing schedule to a small one that still fails the same way.

A failing schedule replays exactly (seed, workload, faults, non-FIFO choices). Shrinking
tries, in order and keeping every change after which the same kind of violation remains:
dropping each fault, dropping chunks of the non-FIFO choices (delta debugging, halves
first), and a smaller workload. Each try is one replay, so the budget bounds the time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from sim.explore import Outcome, Schedule, run
from sim.world import Workload


def shrink(failing: Outcome, budget: int = 150, progress: Callable[[str], None] | None = None) -> Outcome:
    """A smaller schedule with a violation of the same kind as ``failing``'s first one."""
    kind = failing.violations[0].kind
    best = failing
    tries = 0

    def attempt(candidate: Schedule) -> bool:
        nonlocal best, tries
        if tries >= budget:
            return False
        tries += 1
        got = run(candidate)
        if any(v.kind == kind for v in got.violations):
            best = got
            if progress:
                progress(f"shrunk: {_size(candidate)}")
            return True
        return False

    _drop_faults(best, attempt)
    _drop_choices(lambda: best, attempt)
    _smaller_workload(lambda: best, attempt)
    _drop_choices(lambda: best, attempt)
    return best


def _size(s: Schedule) -> str:
    w = s.workload
    return (f"{len(s.faults or [])} faults, {len(s.choices or {})} non-FIFO choices, "
            f"{w.workers} workers x {w.users} users x {w.turns} turns")


def _drop_faults(best: Outcome, attempt: Callable[[Schedule], bool]) -> None:
    current = best.schedule
    for fault in list(current.faults or []):
        candidate = replace(current, faults=[f for f in current.faults or [] if f != fault])
        if attempt(candidate):
            current = candidate


def _drop_choices(best: Callable[[], Outcome], attempt: Callable[[Schedule], bool]) -> None:
    """ddmin over the non-FIFO choices: remove chunks, from halves down to single ones."""
    chunks = 2
    while True:
        current = best().schedule
        steps = sorted((current.choices or {}).items())
        if not steps:
            return
        size = max(1, len(steps) // chunks)
        removed = False
        for start in range(0, len(steps), size):
            keep = dict(steps[:start] + steps[start + size:])
            if attempt(replace(current, choices=keep)):
                removed = True
                break
        if removed:
            chunks = max(2, chunks - 1)
        elif size == 1:
            return
        else:
            chunks = min(len(steps), chunks * 2)


def _smaller_workload(best: Callable[[], Outcome], attempt: Callable[[Schedule], bool]) -> None:
    for name in ("users", "turns", "workers", "concurrency"):
        while True:
            current = best().schedule
            value = getattr(current.workload, name)
            if value <= 1:
                break
            smaller: Workload = replace(current.workload, **{name: value - 1})
            if not attempt(replace(current, workload=smaller)):
                break
