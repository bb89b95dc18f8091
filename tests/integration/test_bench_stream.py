"""Smoke test of ``scripts/bench_stream`` at a tiny size: every phase runs and reports (its
figures are the benchmark's to report, never asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.smoke, pytest.mark.timeout(300)]


def test_bench_stream_runs_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "stream.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_stream.py"), "--seconds", "1.5",
                          "--workers", "1", "--concurrency", "4", "--words", "5", "--chunks", "20",
                          "--cost-turns", "10", "--cancels", "3", "--hold", "20", "--json", str(out)],
                         capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["emit_to_client_ms"]["n"] > 0
    assert got["plain_turn"]["redis_commands_per_turn"] > 0
    assert got["streamed_turn_20_chunks"]["redis_commands_per_turn"] > 0
    assert got["stop"]["to_cancelled_reply_ms"]["n"] == 3
    assert got["hold"]["answered"] == 20 and got["hold"]["peak_in_flight"] >= 1
    phases = {p["name"] for p in got["machine"]["phases"]}  # the machine's verdict, per phase
    assert {"saturation", "half load", "Redis cost, plain", "Redis cost, streamed"} <= phases
