"""Workers of ours whose process runs but whose heartbeat stays missing (``commander.hung_workers``):
judged on the commander's clock, never across an outage of its view, only while running."""

from __future__ import annotations

import pytest

from commander.hung_workers import HungWorkers
from commander.runtime import Lifecycle, WorkerHandle
from protocol.models import WorkerInfo

AFTER_S = 90.0


class View:
    """The clock and the end of the last outage (``commander.outages.Outages.trusted_since``)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.trusted_since = 0.0

    def __call__(self) -> float:
        return self.now


def handle(wid: str = "w1", state: Lifecycle = Lifecycle.RUNNING) -> WorkerHandle:
    return WorkerHandle(worker_id=wid, tier="chat", pid=4242, state=state, started=0.0)


def registry(alive: bool, wid: str = "w1") -> dict[str, tuple[WorkerInfo, bool]]:
    return {wid: (WorkerInfo(worker=wid, tier="chat", pid=1, host="h", started=0.0), alive)}


def judge_at(view: View, hung: HungWorkers, at: float, reg: dict[str, tuple[WorkerInfo, bool]],
             handles: list[WorkerHandle]) -> list[tuple[str, float]]:
    view.now = at
    return [(h.worker_id, round(s, 1)) for h, s in hung.judge(reg, handles)]


@pytest.fixture
def view() -> View:
    return View()


def make(view: View) -> HungWorkers:
    return HungWorkers(AFTER_S, clock=view, trusted_since=lambda: view.trusted_since)


def test_missing_past_the_bound_is_hung(view: View) -> None:
    hung = make(view)
    assert judge_at(view, hung, 1000.0, registry(False), [handle()]) == []  # first seen missing
    assert judge_at(view, hung, 1089.9, registry(False), [handle()]) == []
    assert judge_at(view, hung, 1090.0, registry(False), [handle()]) == [("w1", 90.0)]


def test_a_beat_in_between_starts_the_count_again(view: View) -> None:
    hung = make(view)
    judge_at(view, hung, 1000.0, registry(False), [handle()])
    assert judge_at(view, hung, 1050.0, registry(True), [handle()]) == []
    assert judge_at(view, hung, 1060.0, registry(False), [handle()]) == []
    assert judge_at(view, hung, 1149.0, registry(False), [handle()]) == []
    assert judge_at(view, hung, 1150.0, registry(False), [handle()]) == [("w1", 90.0)]


def test_an_outage_of_the_view_starts_the_count_again(view: View) -> None:
    """Redis away or the commander paused: every heartbeat may have expired, the live ones'
    too; only the time since the view came back counts."""
    hung = make(view)
    judge_at(view, hung, 1000.0, registry(False), [handle()])
    view.trusted_since = 1080.0
    assert judge_at(view, hung, 1100.0, registry(False), [handle()]) == []
    assert judge_at(view, hung, 1170.0, registry(False), [handle()]) == [("w1", 90.0)]


@pytest.mark.parametrize("state", [Lifecycle.STARTING, Lifecycle.DRAINING, Lifecycle.EXITED])
def test_only_a_running_worker_is_judged(view: View, state: Lifecycle) -> None:
    """A start has its own deadline (never registered), a drain its kill time, an exit its reap."""
    hung = make(view)
    judge_at(view, hung, 1000.0, registry(False), [handle(state=state)])
    assert judge_at(view, hung, 2000.0, registry(False), [handle(state=state)]) == []


def test_not_ours_or_not_registered_is_not_judged(view: View) -> None:
    """A registered worker we do not run is the takeover's (its heartbeat expired: dead); one of
    ours with no registry entry (an RQ worker, or an entry gone) says nothing about its beat."""
    hung = make(view)
    judge_at(view, hung, 1000.0, registry(False, "other"), [handle()])
    assert judge_at(view, hung, 2000.0, registry(False, "other"), [handle()]) == []


def test_a_worker_gone_is_forgotten(view: View) -> None:
    hung = make(view)
    judge_at(view, hung, 1000.0, registry(False), [handle()])
    judge_at(view, hung, 1010.0, {}, [])  # reaped
    assert judge_at(view, hung, 1095.0, registry(False), [handle()]) == []  # a new count
