"""``fleet up`` interrupted (SIGINT, as Ctrl-C sends it) at chosen moments: what the run started
is stopped, it says so in one line and exits 130, and no process of its FLEET_HOME is left. One
redis-server per data folder: a server left running that no state file names is found by the
next ``fleet up`` (which starts no second one) and stopped by ``fleet down``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import fleet_argv, fleet_cli, wait_until

pytestmark = pytest.mark.integration


def of_home(home: Path) -> list[psutil.Process]:
    """Live processes started for this FLEET_HOME: the commander, the template, the workers and
    the relay carry it in their environment; redis-server (which rewrites its environment for
    its process title) runs in its data folder."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            ours = proc.environ().get("FLEET_HOME") == str(home) or proc.cwd() == str(home / "redis")
            if ours and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def up_env(fleet_env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    """``fleet up``'s environment with its own redis-server under FLEET_HOME; every process of
    that home still alive after the test is killed by pid."""
    env = dict(fleet_env)
    del env["REDIS_URL"]
    home = Path(env["FLEET_HOME"])
    yield env
    for proc in of_home(home):
        proc.kill()


def state(home: Path) -> dict[str, Any]:
    try:
        return json.loads((home / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def interrupt_up(env: dict[str, str], cwd: Path, when: Callable[[], object],
                 what: str) -> subprocess.CompletedProcess[str]:
    """Start ``fleet up``, wait for ``when``, send SIGINT; its outcome."""
    proc = subprocess.Popen(fleet_argv("up"), env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: when() or proc.poll() is not None, 60, what)
        assert proc.poll() is None, f"fleet up ended before {what}: {proc.communicate()}"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_stopped_everything(done: subprocess.CompletedProcess[str], home: Path) -> None:
    assert done.returncode == 130, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "interrupted" in done.stderr
    assert of_home(home) == []
    assert not (home / "state.json").exists()


@pytest.mark.parametrize("moment", ["redis", "commander", "worker"])
def test_an_interrupted_up_stops_what_it_started(up_env, tmp_path, moment: str) -> None:
    home = Path(up_env["FLEET_HOME"])
    when = {"redis": lambda: (state(home).get("redis") or {}).get("pid"),
            "commander": lambda: (state(home).get("commander") or {}).get("pid"),
            "worker": lambda: list((home / "run").glob("*.json")) if (home / "run").is_dir() else []}[moment]
    done = interrupt_up(up_env, tmp_path, when, f"the {moment} to be recorded")
    assert_stopped_everything(done, home)
    assert "stopped" in done.stderr and ("redis-server" in done.stderr)
    again = fleet_cli(up_env, "up", cwd=tmp_path)  # a clean start after it
    try:
        assert again.returncode == 0, again.stderr
    finally:
        assert fleet_cli(up_env, "down", cwd=tmp_path).returncode == 0
    assert of_home(home) == []


def test_an_interrupt_before_anything_started_is_one_line(up_env, tmp_path) -> None:
    home = Path(up_env["FLEET_HOME"])
    done = interrupt_up(up_env, tmp_path, lambda: True, "the start")
    # (-SIGINT: the interpreter had not installed its handler yet)
    assert done.returncode in (130, -signal.SIGINT) and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") <= 1
    assert of_home(home) == []


def test_one_redis_per_data_folder_and_down_stops_one_no_state_names(up_env, tmp_path) -> None:
    """As if ``fleet up`` had been killed (SIGKILL: nothing can clean up) right after it started
    redis-server, before it recorded it: the server runs, and no state names it."""
    home = Path(up_env["FLEET_HOME"])
    up = fleet_cli(up_env, "up", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    recorded = state(home)
    server = recorded["redis"]["pid"]
    for part in ("commander", "relay"):  # (their workers stay: the run records name them)
        if recorded.get(part):
            os.kill(recorded[part]["pid"], signal.SIGKILL)
    (home / "state.json").unlink()
    second = fleet_cli(up_env, "up", cwd=tmp_path)
    assert second.returncode == 1 and second.stderr.count("\n") == 1, second.stderr
    assert f"pid {server}" in second.stderr and "fleet down" in second.stderr
    servers = [p for p in of_home(home) if p.name().startswith("redis-server")]
    assert [p.pid for p in servers] == [server]  # no second one on the same folder
    down = fleet_cli(up_env, "down", cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert f"redis-server pid {server}" in down.stdout
    wait_until(lambda: of_home(home) == [], 30, "every process of the home to stop")


def test_a_second_up_reports_what_an_earlier_one_left_and_an_interrupt_keeps_it(up_env, tmp_path) -> None:
    """The commander of an earlier ``fleet up`` is gone (SIGKILL), its Redis runs: the next
    ``fleet up`` says what it found and reuses it; interrupted, that run stops only its own
    commander and says the earlier Redis still runs; ``fleet down`` stops that."""
    home = Path(up_env["FLEET_HOME"])
    assert fleet_cli(up_env, "up", cwd=tmp_path).returncode == 0
    first = state(home)
    os.kill(first["commander"]["pid"], signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(first["commander"]["pid"])
               or psutil.Process(first["commander"]["pid"]).status() == psutil.STATUS_ZOMBIE, 10,
               "the commander to die")
    again = fleet_cli(up_env, "up", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"found       redis-server pid {first['redis']['pid']}" in again.stdout, again.stdout
    second = state(home)
    os.kill(second["commander"]["pid"], signal.SIGKILL)
    def third() -> bool:
        return state(home).get("commander", {}).get("pid") not in (None, second["commander"]["pid"])

    done = interrupt_up(up_env, tmp_path, third, "a third commander")
    assert done.returncode == 130 and done.stderr.count("\n") == 1, done.stderr
    assert "stopped what this run started: commander pid" in done.stderr
    assert "still running: the Redis of the earlier setup" in done.stderr
    assert psutil.pid_exists(first["redis"]["pid"])
    down = fleet_cli(up_env, "down", cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    wait_until(lambda: of_home(home) == [], 30, "every process of the home to stop")
