"""A handler package whose entry point fails to import is one handler unavailable: the CLI's
readers, ``fleet handlers`` and a worker go on, each saying what failed.

The broken package is a bare ``*.dist-info`` (its ``entry_points.txt`` names a module that does
not exist) in a directory on ``PYTHONPATH``: installed as far as ``importlib.metadata`` can tell,
nothing pip-installed into the environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protocol import keys
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.conftest import ROOT
from tests.helpers import fleet_cli, ledger, live_workers, wait_until

pytestmark = pytest.mark.integration


def broken_package(where: Path, name: str = "broken") -> Path:
    """A distribution whose ``fleet.handlers`` entry point ``name`` names a missing module."""
    info = where / f"{name}_pkg-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}_pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fleet.handlers]\n{name} = {name}_missing.handlers:answer\n")
    return where


@pytest.fixture
def broken_env(fleet_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    site = broken_package(tmp_path / "site")
    return dict(fleet_env, PYTHONPATH=os.pathsep.join([str(site), fleet_env["PYTHONPATH"]]))


def test_status_top_and_policy_go_on_and_handlers_names_the_error(broken_env, tmp_path, r) -> None:
    for args in (["status"], ["top", "--once"], ["policy", "set", "chat", "concurrency=2"],
                 ["policy", "get", "chat"]):
        out = fleet_cli(broken_env, *args, cwd=tmp_path)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (args, out.stderr)
    status = fleet_cli(broken_env, "status", cwd=tmp_path).stdout
    assert "handler broken unavailable" in status and "No module named 'broken_missing'" in status

    listed = fleet_cli(broken_env, "handlers", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "echo" in listed.stdout and "No module named 'broken_missing'" in listed.stdout
    data = json.loads(fleet_cli(broken_env, "handlers", "--json", cwd=tmp_path).stdout)
    assert "echo" in data["here"]["available"]
    assert "No module named 'broken_missing'" in data["here"]["unavailable"]["broken"]

    refused = fleet_cli(broken_env, "policy", "set", "chat", "handler=broken", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "cannot be loaded" in refused.stderr and "broken_missing" in refused.stderr


def test_a_worker_serves_and_refuses_a_policy_naming_the_broken_handler(broken_env, tmp_path, r,
                                                                      processes) -> None:
    write_policy(r, "chat", TurnsPolicy(handler="echo"))
    worker = processes.start("worker", ["-m", "worker", "--tier", "chat",
                                        "--worker-id", "w1"], broken_env, cwd=tmp_path)
    wait_until(lambda: live_workers(r, "chat"), 20, "the worker to register")
    assert worker.alive()
    info = live_workers(r, "chat")[0]
    assert "echo" in info.handlers and "broken" not in info.handlers
    assert "No module named 'broken_missing'" in info.handler_errors["broken"]
    assert worker.tail().count("cannot be loaded") == 1  # logged once

    r.set(keys.policy("chat"), TurnsPolicy(handler="broken").to_json())
    wait_until(lambda: r.hget(keys.policy_status("chat"), "ok") == b"0", 20, "the worker's verdict")
    error = r.hget(keys.policy_status("chat"), "error").decode()
    assert "cannot be loaded" in error and "broken_missing" in error
    assert worker.alive()

    listed = fleet_cli(broken_env, "handlers", "--json", cwd=tmp_path)
    tier = json.loads(listed.stdout)["tiers"]["chat"]
    assert tier["workers"] == 1 and "echo" in tier["available"] and "broken" in tier["unavailable"]


def test_the_fleet_command_imports_nothing_of_the_broken_package(tmp_path) -> None:
    """Without Redis, ``fleet handlers`` still lists what loads here (and says Redis is away)."""
    site = broken_package(tmp_path / "site")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "REDIS_URL"}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), REDIS_URL="redis://127.0.0.1:1/0",
               FLEET_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-m", "fleet.cli", "handlers"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "broken" in out.stdout and "echo" in out.stdout


def test_a_worker_that_exits_at_start_is_backed_off_and_its_error_shown(fleet_env, tmp_path, r,
                                                                         processes) -> None:
    """Every worker of the tier exits at start (a setting it cannot parse): the commander starts
    them again after 1 s, 2 s, 4 s ..., not in a tight loop, and the ledger and ``fleet status``
    say why in the worker's own words."""
    env = dict(fleet_env, FLEET_WORKER_BATCH="many")
    write_policy(r, "chat", TurnsPolicy(min_workers=1))
    started = time.monotonic()
    processes.commander(env)
    wait_until(lambda: [e for e in ledger(r, "chat", "refused") if "crash-loop back-off" in e.reason
                        and "3 in a row" in e.reason], 30, "the third back-off in the ledger")
    elapsed = time.monotonic() - started
    wait_until(lambda: len(ledger(r, "chat", "worker-exited")) >= 3, 10, "three exits in the ledger")
    exits = ledger(r, "chat", "worker-exited")
    assert len(exits) <= 4 and elapsed >= 3.0, (len(exits), elapsed)  # after 1 s and 2 s waits
    assert all("batch: Input should be a valid integer" in e.reason for e in exits), exits[0].reason
    status = fleet_cli(fleet_env, "status", cwd=tmp_path).stdout
    assert "tier chat CRASH LOOP" in status and "batch: Input should be" in status, status
