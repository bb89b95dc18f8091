"""The first hour with the local fleet, through the real CLI: finding the fleet (or refusing),
TLS to a plain port, `fleet env`, the metrics URL, the AOF fsync, and `fleet down` with a
standby commander started apart. None of it may touch the machine's own 127.0.0.1:6379."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import redis

from stores.connection import redact_url
from stores.roles import with_credentials
from tests.conftest import ROOT
from tests.helpers import fleet_cli
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def bare_env(fleet_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """A newcomer's shell: no REDIS_URL, no FLEET_HOME, $HOME the test's own directory."""
    env = dict(fleet_env, HOME=str(tmp_path))
    del env["REDIS_URL"], env["FLEET_HOME"]
    return env


def test_rediss_to_a_plain_port_fails_in_seconds_in_one_line(fleet_env, tmp_path, redis_server):
    url = f"rediss://fleet:s3cret@127.0.0.1:{redis_server.port}/0"
    t0 = time.monotonic()
    out = fleet_cli(fleet_env, "--redis-url", url, "status", cwd=tmp_path, timeout=60)
    elapsed = time.monotonic() - t0
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert f"rediss://***@127.0.0.1:{redis_server.port}/0" in out.stderr and "s3cret" not in out.stderr
    assert "TLS" in out.stderr
    assert elapsed < 15, elapsed


# Before the fix a command that found no fleet used this constant: point it at the private
# server, so that the old behaviour (a phantom fleet, written to) shows there and not on 6379.
AS_IF_DEFAULT = ("import sys, stores.connection as c; c.DEFAULT_URL = sys.argv.pop(1); "
                 "from fleet.cli import main; raise SystemExit(main(sys.argv[1:]))")


@pytest.mark.parametrize("args", [["status"], ["policy", "get", "chat"], ["events"],
                                  ["dead-letters"], ["user", "ann"], ["submit", "--user", "alice", "hi"]])
def test_no_fleet_found_is_refused_and_nothing_is_written(bare_env, tmp_path, redis_server, r, args):
    work = tmp_path / "project" / "sub"
    work.mkdir(parents=True)
    out = subprocess.run([sys.executable, "-c", AS_IF_DEFAULT, redis_server.url, *args], env=bare_env,
                         cwd=work, text=True, capture_output=True, timeout=60)
    assert out.returncode != 0 and out.stderr.count("\n") == 1, out.stderr
    assert f"no .fleet/ in {work} or above it (up to {tmp_path})" in out.stderr
    assert "REDIS_URL" in out.stderr and "fleet up" in out.stderr
    assert out.stderr.startswith(f"fleet {args[0]}: no Redis to use:"), out.stderr  # not "Redis error"
    assert r.keys("*") == []


def test_reads_never_write(fleet_env, tmp_path, r):
    for args in (["status"], ["status", "--json"], ["policy", "get", "chat"], ["events"], ["dead-letters"],
                 ["user", "ann"], ["user", "ann", "--json"]):
        out = fleet_cli(fleet_env, *args, cwd=tmp_path)
        assert "Traceback" not in out.stderr, (args, out.stderr)
    assert r.keys("*") == []  # not even fleet:policy:{chat}:status


def _up(env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    up = fleet_cli(env, "up", cwd=cwd)
    state_file = cwd / ".fleet" / "state.json"
    return up, (json.loads(state_file.read_text()) if state_file.exists() else {})


def _start_standby(env: dict[str, str], url: str, cwd: Path) -> subprocess.Popen[bytes]:
    log = open(cwd / "standby.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "commander", "--no-metrics"],
                            env=dict(env, REDIS_URL=url), cwd=cwd, stdout=log, stderr=log)
    log.close()
    return proc


def _standby_registered(url: str, pid: int) -> bool:
    from protocol import keys
    from protocol.codec import decode
    from protocol.models import CommanderInfo

    client = redis.Redis.from_url(url)
    try:
        return any(decode(CommanderInfo, b).pid == pid for b in client.hvals(keys.COMMANDERS))
    finally:
        client.close()


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def test_up_prints_url_env_and_metrics_fsyncs_always_and_down_stops_a_standby(bare_env, tmp_path):
    up, state = _up(bare_env, tmp_path)
    standby = None
    try:
        assert up.returncode == 0, up.stderr
        url, metrics = state["url"], state["metrics_url"]
        assert f"redis       {redact_url(url)} (" in up.stdout and "appendfsync always" in up.stdout
        assert urlsplit(url).password not in up.stdout
        assert f"metrics     {metrics}" in up.stdout
        assert 'eval "$(fleet env)"' in up.stdout
        with urllib.request.urlopen(metrics, timeout=5) as resp:
            assert resp.status == 200 and b"fleet_" in resp.read()
        monitor = state["monitor_url"]  # the monitor page: the same address, path /
        assert monitor == metrics.removesuffix("metrics") and f"monitor     {monitor}" in up.stdout
        with urllib.request.urlopen(monitor, timeout=5) as resp:
            assert resp.status == 200 and b"Fleet monitor" in resp.read()
        admin_pw = json.loads((Path(state["home"]) / "acl-passwords").read_text())["default"]
        admin_url = with_credentials(url, "default", admin_pw)
        admin = redis.Redis.from_url(admin_url)
        assert admin.config_get("appendfsync") == {"appendfsync": "always"}

        sub = tmp_path / "src" / "pkg"
        sub.mkdir(parents=True)
        env_out = fleet_cli(bare_env, "env", cwd=sub)
        assert env_out.returncode == 0, env_out.stderr
        assert env_out.stdout == f"export REDIS_URL={shlex.quote(url)}\n"
        shell = subprocess.run(["bash", "-c", 'eval "$(fleet env)" && echo "$REDIS_URL"'], cwd=sub, text=True,
                               capture_output=True, timeout=60,
                               env=dict(bare_env, PATH=f"{Path(sys.executable).parent}:{bare_env['PATH']}"))
        assert shell.stdout.strip() == url, shell.stderr
        status = fleet_cli(bare_env, "status", cwd=sub)  # found above the cwd, and said so
        assert status.returncode == 0, status.stderr
        assert f"using the fleet of {tmp_path / '.fleet'}" in status.stderr

        standby = _start_standby(bare_env, url, tmp_path)
        wait_until(lambda: _standby_registered(admin_url, standby.pid), 30, "the standby to register")
    finally:
        down = fleet_cli(bare_env, "down", cwd=tmp_path)
    try:
        assert down.returncode == 0, down.stderr
        assert re.search(rf"also stopped standby commander \S+ pid {standby.pid} ", down.stdout), down.stdout
        assert standby.wait(timeout=5) is not None  # gone before our commander stopped: no new worker
        leftovers = [p for p in psutil.process_iter(["cmdline"])
                     if str(tmp_path) in " ".join(p.info["cmdline"] or []) and p.status() != "zombie"]
        assert not leftovers, [p.info["cmdline"] for p in leftovers]
    finally:
        _stop(standby)


def test_a_set_process_title_names_the_worker_in_ps(tmp_path):
    code = ("import sys; from worker.__main__ import set_process_title; set_process_title('chat', 'w-7'); "
            "print('ok', flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout.readline() == "ok\n"
            shown = subprocess.run(["ps", "-o", "args=", "-p", str(proc.pid)], capture_output=True, text=True)
            assert shown.stdout.strip() == "fleet-worker chat w-7"
        finally:
            proc.kill()


def test_the_license_is_an_spdx_string_with_its_file():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # a table makes setuptools warn on every install
    assert all((ROOT / name).is_file() for name in project["license-files"])
    assert "setproctitle" in " ".join(project["dependencies"])
    assert os.access(ROOT / "LICENSE", os.R_OK)
