"""scripts/gc_probe: a process with it on its path writes each collection's CPU time, by
generation, at exit; bench_peers sums the workers' files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

from bench_peers import gc_summary  # noqa: E402  (after the path)


def test_a_probed_process_writes_its_collections_and_they_are_summed(tmp_path: Path) -> None:
    env = {**os.environ, "FLEET_GC_PROBE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT / "scripts" / "gc_probe")}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", "import gc; gc.collect(); gc.collect(0)"], env=env, check=True,
                       timeout=60)
    files = sorted(tmp_path.glob("gc-*.json"))
    assert len(files) == 2
    took = json.loads(files[0].read_text())
    assert len(took["2"]) >= 1 and len(took["0"]) >= 1 and all(ms >= 0 for ms in took["2"])
    summary = gc_summary(tmp_path)
    assert summary["gen2"]["per_worker"] >= 1 and summary["gen2"]["max_ms"] >= summary["gen2"]["median_ms"]


def test_without_the_directory_the_probe_does_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FLEET_GC_PROBE_DIR"}
    env["PYTHONPATH"] = str(ROOT / "scripts" / "gc_probe")
    subprocess.run([sys.executable, "-c", "import gc; gc.collect()"], env=env, check=True, timeout=60,
                   cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []
