"""Short modes of the long-running scripts: they run and report (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_bench_pipeline_quick(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--quick",
                          "--seconds", "1.5", "--json", str(out)],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["saturation"]["turns"] > 0 and result["half_load"]["turns"] > 0
    assert result["saturation"]["turns_per_s"] > 0


def test_bench_pipeline_rejects_bad_arguments():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--users", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and "must be positive" in run.stderr and run.stderr.count("\n") == 1
