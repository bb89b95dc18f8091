"""scripts/bench_shards: the same load on one node, a 1-master and a 3-master cluster (the
shard table of docs/BENCHMARKS.md and the figures of docs/operations/scaling.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import _require_cluster_tools
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

SCRIPT = str(ROOT / "scripts" / "bench_shards.py")


@pytest.mark.smoke
def test_bench_shards_quick_runs_the_three_setups(tmp_path: Path) -> None:
    """Every setup runs the same turns and reports each master's own counters; the model is
    fitted on the 1-master cluster, checked on the 3-master one and projected."""
    _require_cluster_tools()
    out, table = tmp_path / "bench.json", tmp_path / "table.md"
    run = subprocess.run([sys.executable, SCRIPT, "--quick", "--json", str(out), "--table", str(table)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    setups = result["setups"]
    assert list(setups) == ["node", "c1", "c3"]
    assert [s["masters"] for s in setups.values()] == [1, 1, 3]
    assert [s["ready_shards"] for s in setups.values()] == [1, 1, 3]
    for s in setups.values():
        assert s["turns"] == 40 * 3
        assert s["hottest_cpu_us_per_turn"] == max(m["cpu_us_per_turn"] for m in s["per_master"].values())
        assert s["ceiling_turns_per_s"] == round(1e6 / s["hottest_cpu_us_per_turn"])
        for m in s["per_master"].values():
            assert m["cpu_us_per_turn"] > 0 and m["commands_per_turn"] > 0 and m["read_events_per_turn"] > 0
        # every turn's reply was waited for by one BLPOP, on the master of its user
        assert result["command_calls_per_turn"]["blpop"][s["setup"]] == pytest.approx(1.0, abs=0.05)
    assert sum(m["replication_bytes_per_turn"] for m in setups["c3"]["per_master"].values()) > 0
    (node,) = setups["node"]["per_master"].values()
    assert node["replication_bytes_per_turn"] == 0
    assert result["scaling"]["compared"] == "c3 : node"
    diff = result["command_diff"]
    for name in ("node", "c1", "c3"):  # each column adds up to the CPU
        column = sum(row.get(name, 0.0) for cmd, row in diff.items() if cmd != "(CPU)")
        assert column == pytest.approx(diff["(CPU)"][name], abs=0.1 * len(diff))
    model = result["model"]
    assert model["fitted_on"] == "c1" and model["check"]["setup"] == "c3"
    assert len(model["check"]["from_1_master_alone"]["per_master"]) == 3
    assert [p["masters"] for p in model["projections"]] == [10, 30, 100]
    assert [p["ready_shards"] for p in model["projections"]] == [10, 30, 64]
    assert "fcall fleet:u:{*}:lane" in model["calls_per_turn_by_command_and_key"]
    assert "machine" in result and "valid" in result["machine"]
    text = table.read_text()
    assert "| c3 (3 masters + 3 replicas, ready_shards 3)" in text and "Check on c3" in text


@pytest.mark.parametrize(("args", "error"), [
    (["--setups", "node,c0"], "1-16 masters"),
    (["--setups", "node,x3"], "is no setup"),
    (["--setups", "c1,c1"], "twice"),
    (["--rounds", "0"], "must be positive"),
])
def test_bench_shards_rejects_bad_arguments(args: list[str], error: str) -> None:
    run = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert run.returncode == 2 and error in run.stderr and run.stderr.count("\n") == 1, run.stderr
