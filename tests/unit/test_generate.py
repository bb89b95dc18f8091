"""The generated hard traffic: seeded, the shapes it promises, and its CSV read back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sim.scaling.generate import DEFAULT_START, KINDS, generate, parse_generated
from sim.scaling.trace import TraceModel, assign_users, read_trace
from tests.conftest import ROOT


def per_second(kind: str, duration: float = 1800.0) -> list[int]:
    trace = generate(kind, seed=1, duration_s=duration)
    counts = [0] * int(duration)
    for r in trace.requests:
        counts[int(r.ts - DEFAULT_START)] += 1
    return counts


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_and_sorted(kind: str) -> None:
    a, b = generate(kind, seed=3, duration_s=600), generate(kind, seed=3, duration_s=600)
    assert a.requests == b.requests and a.requests != generate(kind, seed=4, duration_s=600).requests
    times = [r.ts for r in a.requests]
    assert times == sorted(times) and times[0] >= DEFAULT_START and times[-1] < DEFAULT_START + 600
    assert all(r.context_tokens >= 1 and r.generated_tokens >= 1 for r in a.requests)


def mean(xs: list[int]) -> float:
    return sum(xs) / len(xs)


def test_flash_crowd_is_ten_times_within_seconds() -> None:
    counts = per_second("flash")
    at = 600  # a third of the run
    before, during = mean(counts[at - 300:at]), mean(counts[at + 2:at + 120])
    assert 2.5 < before < 3.5 and 8 < during / before < 12


def test_mmpp_switches_between_two_rates() -> None:
    minutes = [sum(per_second("mmpp", 3600)[m * 60:(m + 1) * 60]) / 60 for m in range(60)]
    assert min(minutes) < 3 and max(minutes) > 8


def test_diurnal_and_leak_ramp() -> None:
    d = per_second("diurnal", 3600)
    assert mean(d[:300]) < 1.5 and mean(d[1650:1950]) > 8 and mean(d[-300:]) < 1.5
    leak = per_second("leak", 3600)
    assert mean(leak[:300]) < 2 and mean(leak[-300:]) > 8


def test_heavy_has_a_heavy_tail_of_service_times() -> None:
    turns = assign_users(generate("heavy", seed=1, duration_s=1800).requests, TraceModel())
    s = sorted(t.service_s for t in turns)
    assert s[int(0.999 * len(s))] > 20 * s[len(s) // 2]


@pytest.mark.parametrize(("spec", "parsed"), [("gen:flash", ("flash", 7, None)),
                                              ("gen:mmpp:3", ("mmpp", 3, None)),
                                              ("gen:leak:2:600", ("leak", 2, 600.0))])
def test_parse_generated(spec: str, parsed: tuple[str, int, float | None]) -> None:
    assert parse_generated(spec) == parsed


@pytest.mark.parametrize("bad", ["gen:nope", "gen", "flash", "gen:flash:x", "gen:flash:1:2:3"])
def test_parse_generated_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_generated(bad)


def test_the_script_writes_a_csv_that_reads_back(tmp_path: Path) -> None:
    out = tmp_path / "flash.csv"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_traffic.py"), "flash", "--seed", "5",
                          "--duration", "120", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    back = read_trace(out)
    want = generate("flash", seed=5, duration_s=120).requests
    assert [(r.context_tokens, r.generated_tokens) for r in back] == \
        [(r.context_tokens, r.generated_tokens) for r in want]
    assert max(abs(a.ts - b.ts) for a, b in zip(back, want, strict=True)) < 1e-5  # microseconds
