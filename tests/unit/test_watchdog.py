"""The event loop's watchdog (``worker.watchdog``): a loop that has not turned for
``stuck_after_s`` ends the process with ``EXIT_STUCK``, saying how long and where it is stuck."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from protocol.models import EXIT_STUCK, exit_meaning
from worker.watchdog import Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def advance(clock: Clock, seconds: float, step: float = 1.0) -> None:
    """Move the clock on in small steps, as time goes: the watchdog's thread (polling every
    10 ms) would take a gap of over half of ``stuck_after_s`` between two looks for a pause."""
    while seconds > 0:
        clock.now += min(step, seconds)
        seconds -= step
        time.sleep(0.02)


class Exits:
    """Stands in for ``os._exit``: records the code, and lets a test wait for it."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def test_a_loop_that_turns_is_never_stuck() -> None:
    clock, exits = Clock(), Exits()
    dog = Watchdog(30.0, clock=clock, exit=exits)
    for _ in range(10):
        clock.now += 20.0
        dog.beat()
        assert not dog.check()
    assert exits.codes == []


@pytest.mark.parametrize(("since_beat", "stuck"), [(0.0, False), (29.9, False), (30.0, True), (95.0, True)])
def test_stuck_past_stuck_after_s_exits_with_its_code(since_beat: float, stuck: bool) -> None:
    clock, exits = Clock(), Exits()
    dog = Watchdog(30.0, clock=clock, exit=exits)
    dog.beat()
    clock.now += since_beat
    assert dog.check() is stuck
    assert exits.codes == ([EXIT_STUCK] if stuck else [])


def test_the_thread_exits_once_with_one_line_naming_the_time_and_the_place(
        caplog: pytest.LogCaptureFixture) -> None:
    """The thread itself, on the injected clock: the loop's thread (here: this one) stops
    beating at 100 s; at 130 s the thread logs the stuck time and this test's frame, and exits."""
    clock, exits = Clock(), Exits()
    dog = Watchdog(30.0, clock=clock, exit=exits, poll_s=0.01)
    thread = threading.Thread(target=dog.run, daemon=True)
    with caplog.at_level(logging.CRITICAL, logger="fleet.worker"):
        thread.start()
        advance(clock, 29.0)
        assert not exits.called.is_set()
        advance(clock, 2.0)
        assert exits.called.wait(5.0), "the watchdog did not fire"
        thread.join(5.0)
    assert not thread.is_alive()  # it ends after firing: one exit, one line
    assert exits.codes == [EXIT_STUCK]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "event loop stuck for 30.0s (stuck_after_s 30)" in line  # (the first look at 30 s)
    assert f"exiting with code {EXIT_STUCK}" in line
    assert "test_watchdog.py" in line and "in test_the_thread_exits_once" in line


def test_a_paused_process_is_not_a_stuck_loop() -> None:
    """The thread did not run either for over half of ``stuck_after_s`` (the process was
    SIGSTOPped): the loop gets a fresh ``stuck_after_s`` from the resume, then is judged."""
    clock, exits = Clock(), Exits()
    dog = Watchdog(30.0, clock=clock, exit=exits, poll_s=0.01)
    thread = threading.Thread(target=dog.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.03)
        clock.now += 100.0  # a pause of the whole process
        deadline = time.monotonic() + 5.0
        while dog.last < clock.now and time.monotonic() < deadline:  # the thread's next look
            time.sleep(0.01)
        assert dog.last == clock.now and not exits.called.is_set()
        advance(clock, 29.0)
        assert not exits.called.is_set()
        advance(clock, 2.0)
        assert exits.called.wait(5.0), "the watchdog did not fire after the resume"
    finally:
        dog.stop()
    assert exits.codes == [EXIT_STUCK]


def test_stopped_it_never_fires() -> None:
    clock, exits = Clock(), Exits()
    dog = Watchdog(30.0, clock=clock, exit=exits)
    dog.stop()
    clock.now += 1000.0
    assert not dog.check() and exits.codes == []


def test_the_loop_beats_it_and_a_blocked_loop_does_not() -> None:
    """On a real loop: the bumps keep it fresh while the loop turns; a blocking call stops them."""
    exits = Exits()

    async def main() -> tuple[float, float]:
        dog = Watchdog(60.0, exit=exits)
        dog.start(asyncio.get_running_loop())
        try:
            before = dog.last
            await asyncio.sleep(0.7)  # the loop turns: at least one bump (every 0.5 s)
            turned = dog.last - before
            mark = dog.last
            time.sleep(0.7)  # a blocking call on the loop: no bump meanwhile
            return turned, dog.last - mark
        finally:
            dog.stop()

    turned, blocked = asyncio.run(main())
    assert turned > 0 and blocked == 0
    assert exits.codes == []


def test_exit_meaning() -> None:
    assert exit_meaning(EXIT_STUCK) == f"code {EXIT_STUCK} (its event loop was stuck)"
    assert exit_meaning(1) == "code 1" and exit_meaning(None) == "an unknown code"


def test_stuck_after_s_must_exceed_two_renew_intervals() -> None:
    from worker.settings import WorkerSettings

    assert WorkerSettings(stuck_after_s=3.1, renew_interval_s=1.5).stuck_after_s == 3.1
    with pytest.raises(ValueError, match="stuck_after_s must exceed two renew intervals"):
        WorkerSettings(stuck_after_s=3.0, renew_interval_s=1.5)
