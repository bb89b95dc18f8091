"""`fleet replay` against a real redis-server and worker; `scripts/bench_trace.py --quick` end to end."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from protocol.policy import TurnsPolicy, turns_policy
from stores.policies import write_policy
from tests.conftest import ROOT
from tests.helpers import fleet_cli

pytestmark = pytest.mark.integration

ROWS = ["2023-11-16 18:15:46.0000000,400,20", "2023-11-16 18:15:46.5000000,800,40",
        "2023-11-16 18:15:47.0000000,100,10", "2023-11-16 18:15:47.2000000,300,30",
        "2023-11-16 18:15:48.0000000,900,12", "2023-11-16 18:15:49.0000000,50,8"]


def tiny_trace(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(ROWS) + "\n")
    return path


def test_replay_submits_every_turn_and_records_waits_and_workers(r, fleet_env, start_worker, tmp_path):
    write_policy(r, "chat", turns_policy(handler="sleep", concurrency=4, report_interval_s=0.5))
    start_worker()
    out = tmp_path / "out"
    run = fleet_cli(fleet_env, "replay", str(tiny_trace(tmp_path)), "--speed", "10", "--out", str(out),
                    cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    body = json.loads((out / "replay.json").read_text())
    assert body["summary"]["turns"] == len(ROWS) and body["summary"]["unserved"] == 0
    assert all(t["ok"] and t["wait_s"] > -0.05 for t in body["turns"])
    assert all(t["reply"] >= t["submit"] + t["service_s"] * 0.9 for t in body["turns"])
    assert max(n for _, n in body["workers"]) == 1
    with open(out / "turns.csv") as f:
        assert len(list(csv.DictReader(f))) == len(ROWS)
    assert "submitted" in run.stderr  # progress lines


def test_replay_needs_the_sleep_handler(r, fleet_env, tmp_path):
    write_policy(r, "chat", TurnsPolicy(handler="echo"))
    run = fleet_cli(fleet_env, "replay", str(tiny_trace(tmp_path)), "--limit", "1", cwd=ROOT, timeout=120)
    assert run.returncode == 1 and "handler=sleep" in run.stderr


@pytest.mark.smoke
def test_bench_trace_quick(tmp_path):
    out = tmp_path / "bench"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_trace.py"), "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=170, cwd=ROOT)
    if run.returncode == 2 and "no trace" in run.stderr:
        pytest.skip("the Azure trace is not on this machine")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "trace.json").read_text())
    assert [row["policy"].split()[0] for row in result["comparison"]] == [
        "fleet", "static", "hpa", "keda", "oracle"]
    assert result["validation"]["real"]["turns"] > 0
    assert result["validation"]["real"]["unserved"] == 0
    assert (out / "trace.md").read_text().count("| fleet") >= 2
    assert (out / "trace-comparison.png").stat().st_size > 0
    assert (out / "trace-validation.png").stat().st_size > 0


def test_the_default_trace_is_found_beside_the_repository_or_above_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_trace

    repo = tmp_path / "ci" / "clone" / "repo"
    repo.mkdir(parents=True)
    assert bench_trace.default_trace(repo) == repo.parent / "shared" / "traces" / "azure_llm_conv_2023.csv"
    trace = tmp_path / "shared" / "traces" / "azure_llm_conv_2023.csv"  # two levels up
    trace.parent.mkdir(parents=True)
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert bench_trace.default_trace(repo) == trace
    beside = repo.parent / "shared" / "traces" / "azure_llm_conv_2023.csv"  # the nearest wins
    beside.parent.mkdir(parents=True)
    beside.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert bench_trace.default_trace(repo) == beside
