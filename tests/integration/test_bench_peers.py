"""Smoke test of ``scripts/bench_peers --quick``: every system answers turns (no timing assertions)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration
PEERS = ("rq", "celery", "dramatiq", "saq", "arq")


def _require_peers() -> None:
    """Skip without rq/celery (and redis-server) on a dev box; fail under CI, where they must be."""
    missing = [m for m in PEERS if importlib.util.find_spec(m) is None]
    if not shutil.which("redis-server"):
        missing.append("redis-server")
    if not missing:
        return
    msg = f"{', '.join(missing)} not installed: pip install -e '.[bench]' (redis-server: ./scripts/setup)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.mark.smoke
@pytest.mark.timeout(600)
def test_bench_peers_quick_every_system_answers_turns(tmp_path):
    _require_peers()
    out = tmp_path / "peers.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--quick",
                          "--seconds", "2", "--bursts", "2", "--json", str(out),
                          "--gc-probe", str(tmp_path / "gc")],
                         capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    systems = result["systems"]
    assert set(systems) == {"fleet", "rq-simple", "rq-fork", "celery", "dramatiq-1", "dramatiq-8", "saq",
                            "arq"}
    for name, s in systems.items():
        sat = s["saturation"]
        assert sat["turns"] > 0 and sat["turns_per_s"] > 0, (name, sat)
        cost = s["cost_per_turn"]
        assert min(cost["redis_commands"], cost["round_trips"], cost["total_cpu_us"]) > 0, (name, cost)
        assert "errors" not in sat, (name, sat)
        half = s["half_load"]
        assert half.get("overloaded") or half["turns"] > 0, (name, half)
        if name != "fleet":
            assert set(s["ratios"]) == {"turns_per_s", "saturation_p50", "saturation_p99",
                                        "half_load_p50", "half_load_p99"}
    # the machine's verdict (its values are the machine's, not asserted): each system of the run
    # a phase, and the runs left out of the figures named with why
    machine = result["machine"]
    assert {p["name"] for p in machine["phases"]} >= {f"run 0: {name}" for name in systems}, machine
    assert isinstance(machine["valid"], bool) and isinstance(result["invalid_runs"], dict)
    assert machine["valid"] == (not machine["invalid_because"])
    auto = result["celery_autoscale"]
    assert len(auto["reactions_ms"]) + auto["missed"] == 2
    assert "fleet" in run.stdout and "celery --autoscale" in run.stdout  # the table
    # Fleet's workers' collections, from the probe's files: one a worker
    assert len(list((tmp_path / "gc").glob("gc-*.json"))) == 2
    assert result["fleet_gc"]["gen0"]["per_worker"] > 0


def test_bench_peers_rejects_bad_arguments():
    for bad, why in ((["--users", "0"], "must be positive"), (["--systems", "rq-simple"], "fleet included"),
                     (["--autoscale", "2,2"], "MAX must be above MIN")):
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), *bad],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert run.returncode == 2 and why in run.stderr and run.stderr.count("\n") == 1, (bad, run.stderr)
