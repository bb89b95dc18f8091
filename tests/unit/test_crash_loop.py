"""A pool whose workers keep exiting at start is started again with exponential back-off, as a
kubelet's CrashLoopBackOff; a worker that runs healthy resets it."""

from __future__ import annotations

import pytest

from commander.runtime.process.crashloop import CrashLoops, backoff_s


@pytest.mark.parametrize(("failures", "delay"), [
    (0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 256.0), (10, 300.0), (50, 300.0),
])
def test_the_delay_doubles_from_one_second_up_to_five_minutes(failures: int, delay: float) -> None:
    assert backoff_s(failures) == delay


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_each_failure_doubles_the_wait_and_a_healthy_run_resets_it() -> None:
    clock = Clock()
    loops = CrashLoops(clock=clock)
    assert loops.refusal("chat") is None
    waits = []
    for n in range(1, 6):
        loops.failed("chat", started=float(n), why=f"worker chat-{n} exited with code 1: boom")
        why = loops.refusal("chat")
        assert why is not None and f"{n} in a row" in why and f"chat-{n} exited with code 1: boom" in why
        assert loops.refusal("chat") == why  # the same line while it waits: ledgered once
        waits.append(loops.waiting_s("chat"))
        clock.now += waits[-1] - 0.01
        assert loops.refusal("chat") is not None
        clock.now += 0.01
        assert loops.refusal("chat") is None  # its time has come: one more start
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert "5 in a row" in loops.loops()["chat"]  # still shown until a worker runs healthy
    loops.healthy("chat", started=3.0)  # started before the last failure: proves nothing
    assert "chat" in loops.loops()
    loops.healthy("chat", started=6.0)
    assert loops.loops() == {} and loops.refusal("chat") is None
    loops.failed("chat", started=7.0, why="again")
    assert loops.waiting_s("chat") == 1.0  # from the start again


def test_pools_back_off_on_their_own() -> None:
    loops = CrashLoops(clock=Clock())
    loops.failed("chat", started=1.0, why="boom")
    assert loops.refusal("chat") is not None and loops.refusal("chat.green") is None
