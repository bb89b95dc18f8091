"""Short modes of the long-running scripts: they run and report (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from commander.commander import GC_THRESHOLDS
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


@pytest.mark.smoke
def test_bench_pipeline_quick(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--quick",
                          "--seconds", "1.5", "--json", str(out)],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["saturation"]["turns"] > 0 and result["half_load"]["turns"] > 0
    assert result["saturation"]["turns_per_s"] > 0


def test_bench_commander_times_a_whole_pass(tmp_path):
    """A leading commander's passes over a simulated fleet: CPU, Redis commands, memory."""
    out = tmp_path / "commander.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_commander.py"), "--quick",
                          "--workers", "200", "--tiers", "4", "--json", str(out)],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    whole = json.loads(out.read_text())["pass"]
    assert whole["tiers_judged"] == 4 and whole["passes"] == 3, whole
    assert (whole["reports_per_pass"], whole["report_every_passes"]) == (20, 10), whole  # a tenth a pass
    assert whole["cpu_ms_per_pass"]["median"] > 0 and whole["redis_commands_per_pass"] > 0
    assert whole["commander_rss_mb"] > 0 and "a whole pass:" in run.stdout
    assert whole["gc"]["thresholds"] == list(GC_THRESHOLDS), whole  # as `fleet commander` sets them
    assert set(whole["gc"]["collections_per_pass"]) == {"0", "1", "2"}, whole
    assert whole["gc"]["cpu_ms_per_pass"] >= 0


def test_bench_commander_can_leave_pythons_collector_as_it_is(tmp_path):
    """``--gc python``: the pass with Python's own thresholds, to see what the commander's buy."""
    out = tmp_path / "commander.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_commander.py"), "--quick",
                          "--workers", "200", "--tiers", "4", "--gc", "python", "--json", str(out)],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    collector = json.loads(out.read_text())["pass"]["gc"]
    assert collector["thresholds"] == [700, 10, 10], collector  # (CPython's defaults)
    assert sum(collector["collections_per_pass"].values()) > 0, collector  # the young ones, at least
    assert "Python's garbage collector thresholds" in run.stdout


def test_bench_pipeline_rejects_bad_arguments():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--users", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and "must be positive" in run.stderr and run.stderr.count("\n") == 1


@pytest.mark.smoke
def test_bench_report_quick_assembles_the_report(tmp_path):
    # peers and trace have their own smoke tests; here the orchestrator runs the rest and renders
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_report.py"), "--quick",
                          "--only", "pipeline,scaleup,commander", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## Goals" in report and "pressure -> new worker serving" in report
    assert "Quick mode" in report
    assert (tmp_path / "bench-scaleup.png").stat().st_size > 0
    for name in ("pipeline", "scaleup", "commander"):
        assert json.loads((tmp_path / "bench-raw" / f"{name}.json").read_text())


@pytest.mark.smoke
def test_bench_monitor_quick(tmp_path):
    out = tmp_path / "bench.json"
    script = ROOT / "scripts" / "bench_monitor.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this tree's packages, whatever the venv installed
    run = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out)], capture_output=True,
                         text=True, timeout=180, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["workers"] == 20 and result["requests_per_refresh"] == 4
    assert result["cpu_ms_per_refresh"] > 0
    assert result["bytes"]["/api/workers"] > 1000  # every worker is in it, with its history


@pytest.mark.smoke
def test_rq_sigterm_quick():
    """Random SIGTERMs on fleet rq-worker: every warm shutdown exits 0, leaving nothing, and none
    hangs (the bound is loose here, a busy CI machine being no place for timing: the long mode
    in the README holds it to 3 s)."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "rq_sigterm.py"), "--rounds", "8",
                          "--seed", "5", "--bound", "10", "--timeout", "30"],
                         capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "rounds 8 (seed 5)" in run.stdout and "bad 0" in run.stdout


def test_bench_functions_takes_a_turn_apart(tmp_path):
    """Each operation of a turn alone, through Fleet's own code, with the commands it ran."""
    out = tmp_path / "functions.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_functions.py"), "--quick",
                          "--json", str(out)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    ops = json.loads(out.read_text())["operations"]
    ran = {name: got["commands_per_call"] for name, got in ops.items()}
    assert ran["submit"]["fcall"] == ran["lane acquire"]["fcall"] == ran["turn commit"]["fcall"] == 1.0
    assert ran["lane acquire"]["lrange"] == 1.0  # the context pack, read by the acquire
    assert ran["reply read"] == {"lpop": 1.0} and ran["request (PING, one at a time)"]["ping"] == 1.0
    assert all(got["cpu_us_median"] > 0 for got in ops.values()), ops
    assert "a turn's operations together" in run.stdout


def test_bench_lua_ab_sets_two_library_versions_side_by_side(tmp_path):
    """Another version (a copy of the Lua files with one changed) loaded beside this one; each
    batch of users takes a turn through both. The same files are no other version."""
    import shutil

    lua = tmp_path / "lua"
    shutil.copytree(ROOT / "stores" / "lua", lua)
    same = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_lua_ab.py"), "--against", str(lua)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert same.returncode == 1 and "this very version" in same.stderr
    with (lua / "turn_commit.lua").open("a") as f:
        f.write("-- another version\n")
    out = tmp_path / "ab.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_lua_ab.py"), "--against", str(lua),
                          "--users", "100", "--passes", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["versions"]["this"] != got["versions"]["other"]
    for op in ("lane acquire", "turn commit"):
        assert got[op]["batches"] == 2 and got[op]["this_us"] > 0 and got[op]["other_us"] > 0


def test_bench_client_times_fleets_own_calls(tmp_path):
    """Each call of both clients timed against a bare round trip; every submit reached an inbox
    and every reply was taken by its wait."""
    out = tmp_path / "client.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_client.py"), "--quick",
                          "--json", str(out)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["turns_submitted"] == 2 * 3 * 100 + 2 and got["replies_left"] == 0  # (+ each client's warm-up)
    for calls in got["clients"].values():
        assert set(calls) == {"round trip", "submit", "reply wait"}
        assert all(one["cpu_us_median"] > 0 for one in calls.values()), calls
        assert "over_a_round_trip_us" in calls["submit"] and "over_a_round_trip_us" in calls["reply wait"]
    assert "over a round trip" in run.stdout


def test_bench_peers_warm_up_leaves_a_connection_per_user_in_every_pool(redis_server):
    """Every user has a call in flight at once in a phase: each asyncio client a turn goes through
    (the harness's reply wait, Fleet's submit) must hold that many connections before it, or the
    phase counts the new ones' handshakes (five commands each) as its turns' work."""
    import asyncio

    import redis

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_peers import FleetDriver, fill_pools

    def connections() -> int:
        admin = redis.Redis.from_url(redis_server.url)
        try:
            return len(admin.client_list())
        finally:
            admin.close()

    async def filled() -> int:
        drv = FleetDriver(redis_server.url)
        try:
            await fill_pools(drv, 40)
            return connections()
        finally:
            await drv.close()

    before = connections()
    assert asyncio.run(filled()) - before == 2 * 40  # the reply waits' pool and Fleet's client's
