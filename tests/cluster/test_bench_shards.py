"""scripts/bench_shards: ready_shards 1 vs 3 on the cluster (the figures of docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import RedisClusterRig
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


@pytest.mark.smoke
def test_bench_shards_quick(redis_cluster: RedisClusterRig, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_shards.py"), "--quick",
                          "--url", redis_cluster.url, "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    one, three = result["ready_shards_1"], result["ready_shards_3"]
    assert one["turns"] == three["turns"] == 40 * 3
    assert len(one["master_cpu_us_per_turn"]) == len(three["master_cpu_us_per_turn"]) == 3
    assert set(result["ratio_3_to_1"]) == {"turns_per_s", "p50_ms", "p99_ms", "ceiling_turns_per_s"}


def test_bench_shards_rejects_bad_arguments() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_shards.py"), "--rounds", "3"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and "must be even" in run.stderr and run.stderr.count("\n") == 1
