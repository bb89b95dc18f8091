"""The commander forgets what it keeps per worker for workers it never reaped: neither its
registry nor its runtime lists them, and they have not reported for ``FORGET_ABSENT_S``."""

from __future__ import annotations

import fakeredis

from commander.evaluator import FORGET_ABSENT_S
from tests.unit.commander_helpers import RecordingRuntime, VirtualClock, leading
from tests.unit.test_evaluator import report


def test_a_pass_drops_the_windows_of_workers_gone_without_a_reap() -> None:
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    clock = VirtualClock()
    runtime = RecordingRuntime(clock=clock.time)
    commander = leading(r, runtime, clock=clock.time, monotonic=clock.monotonic, always_tiers=("chat",))
    evaluator = commander.observer.evaluator
    evaluator.add(report(clock.time(), worker="elsewhere-1"))  # another host's, a pod: never reaped here

    commander.pass_once(clock.time())
    assert "elsewhere-1" in evaluator.workers()  # just reported: kept
    clock.advance(FORGET_ABSENT_S + 1)
    commander.pass_once(clock.time())
    assert "elsewhere-1" not in evaluator.workers()
