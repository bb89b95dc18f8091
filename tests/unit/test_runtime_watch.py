"""The commander's judgement of workers waiting for a place to run (commander/runtime_watch.py):
who is past the policy's pending_timeout_s, and the ledger's one line about them."""

from __future__ import annotations

import pytest

from commander.runtime.interface import Lifecycle, WorkerHandle
from commander.runtime_watch import no_capacity_reason, overdue


def wh(name: str, since: float | None, state: Lifecycle = Lifecycle.STARTING, tier: str = "chat",
       why: str = "") -> WorkerHandle:
    return WorkerHandle(name, tier, 0, state, 0.0, pending_since=since, pending_why=why)


@pytest.mark.parametrize(("handles", "late"), [
    ([wh("a", 100.0), wh("b", 30.0)], ["b"]),  # waited 0 s and 70 s; the limit is 60
    ([wh("a", None), wh("b", 39.0)], ["b"]),
    ([wh("a", 10.0, tier="vip")], []),
    ([wh("a", 10.0, state=Lifecycle.EXITED)], []),
    ([wh("a", 40.0)], []),  # exactly the limit: not over it
])
def test_workers_waiting_past_the_pending_timeout(handles: list[WorkerHandle], late: list[str]) -> None:
    assert [h.worker_id for h in overdue(handles, "chat", 60.0, now=100.0)] == late


def test_the_no_capacity_reason_names_who_waits_how_long_and_why() -> None:
    late = [wh(f"p{i}", 10.0, why="Unschedulable: 0/2 nodes are available") for i in range(7)]
    reason = no_capacity_reason(late, 60.0, now=100.0)
    assert reason.startswith("7 workers waiting for a place to run past pending_timeout_s=60: "
                             "p0 for 90s (Unschedulable: 0/2 nodes are available); p1 for 90s")
    assert "and 2 more" in reason and "nothing is retried" in reason
