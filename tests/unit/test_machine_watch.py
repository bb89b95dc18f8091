"""Benchmarks refuse a noisy machine (``scripts/benchlib.MachineWatch``): the CPU of processes
outside the benchmark's own tree is counted per phase, its own children's is not, and a phase
in which others used more than a tenth of a core makes the run invalid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT

if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402  (after the path)

BURN = "import time\nend = time.time() + 20\nwhile time.time() < end: pass"


def detached_burner() -> int:
    """A CPU burner outside this process's tree (its shell parent exits: it is re-parented)."""
    out = subprocess.run(["sh", "-c", f'{sys.executable} -c "{BURN}" >/dev/null 2>&1 & echo $!'],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_others_are_counted_and_the_benchmarks_own_children_are_not() -> None:
    other = detached_burner()
    child = subprocess.Popen([sys.executable, "-c", BURN])
    watch = benchlib.MachineWatch(interval_s=0.2)
    try:
        pids = {pid for pid, _ in watch._others()}
        assert other in pids and child.pid not in pids and os.getpid() not in pids
        with watch.phase("burning") as phase:
            time.sleep(1.5)
        assert phase.others_share > 0.5, phase  # the detached burner's core, at least half of it
        verdict = watch.verdict()
        assert verdict["valid"] is False
        assert any("'burning'" in why for why in verdict["invalid_because"]), verdict  # type: ignore[attr-defined]
    finally:
        watch.close()
        child.kill()
        child.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(other, signal.SIGKILL)


def test_a_high_load_at_the_start_makes_the_run_invalid() -> None:
    watch = benchlib.MachineWatch(interval_s=5)
    try:
        watch.load_at_start = (2.0, 1.0, 0.5)
        assert watch.invalid_because([]) == ["load average 2.00 at the start (over 1.5)"]
        watch.load_at_start = (0.2, 0.1, 0.1)
        assert watch.invalid_because([]) == []
    finally:
        watch.close()


def test_settle_load_waits_for_the_last_benchmarks_load_to_fall(monkeypatch) -> None:
    """scripts/bench runs its steps back to back: a step begun at once starts at the last one's
    load average, which lags by a minute, and is invalid though the machine is quiet."""
    loads = iter([2.2, 1.6, 1.1, 0.9, 0.5])
    slept: list[float] = []
    monkeypatch.setattr(benchlib.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr(benchlib.time, "sleep", slept.append)
    assert benchlib.settle_load(every_s=5) == 0.9 and slept == [5, 5, 5]
    monkeypatch.setattr(benchlib.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(benchlib.time, "monotonic", lambda: float(next(clock)))
    assert benchlib.settle_load(max_wait_s=30) == 3.0  # (bounded: the step then says it is invalid)
