"""`scripts/bench_scaling.py --quick` end to end on generated traffic (no shared trace needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.smoke


def test_bench_scaling_quick(tmp_path):
    out = tmp_path / "scaling"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_scaling.py"), "--quick",
                          "--traces", "gen:flash,gen:mmpp", "--out", str(out)],
                         capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "scaling.json").read_text())
    assert [t["trace"] for t in result["traces"]] == ["gen-flash-s7", "gen-mmpp-s7"]
    for t in result["traces"]:
        assert [row["policy"].split()[0] for row in t["comparison"]] == [
            "fleet", "static", "hpa", "keda", "oracle"]
        assert {p["family"] for p in t["frontier"]} == {"fleet", "hpa", "keda", "static"}
        assert set(t["goals"]) == {"p99_le_1s", "slo_le_0.1pct", "cost_le_1.25x", "fewer_events"}
    assert "| gen-flash-s7 |" in (out / "scaling.md").read_text()
    assert (out / "scaling-frontier.png").stat().st_size > 0


def test_bench_trace_reads_generated_traffic_and_a_policy_file(tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text('{"scale_down_stabilization_s": 60, "disruption_budget": {"workers": 1}}')
    out = tmp_path / "trace"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_trace.py"),
                          "--trace", "gen:leak:1:300",
                          "--no-validation", "--policy", str(policy), "--slo-s", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "trace.json").read_text())
    assert result["trace"] == "gen-leak-s1" and result["slo_s"] == 2.0
    assert result["policy"]["scaling"]["scale_down_stabilization_s"] == 60
    row = result["comparison"][0]
    assert row["policy"] == "fleet" and {"worker_seconds", "slo_violation_pct", "p99_wait_s"} <= set(row)
    assert "gen-leak-s1" in (out / "trace.md").read_text().splitlines()[0]
