"""Fast spawn: real workers forked from the pre-imported template, on a real redis-server.

The process runtime's contract (spawn, registration, drain, kill at the deadline, reap,
adopt, stop_all leaving nothing) must hold for forked workers as for exec'd ones, and the
template must reap its children, survive nothing it should not, and give way to a fresh
interpreter when it cannot start.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from commander.runtime import Lifecycle
from commander.runtime.process import ProcessRuntime
from commander.runtime.process.fork_client import TemplateSpawner
from fleet.client import Fleet
from protocol import keys
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.conftest import ROOT
from tests.helpers import running
from tests.integration.conftest import reap_until_exited, share_proof, wait_running, wait_until

pytestmark = pytest.mark.integration
TIMEOUT = 20.0


def _handle(rt: ProcessRuntime, worker_id: str):  # type: ignore[no-untyped-def]
    return next(h for h in rt.list() if h.worker_id == worker_id)


def _ready_template(rt: ProcessRuntime) -> int:
    assert rt.spawner.template is not None and rt.spawner.template.start(wait=True)
    pid = rt.spawner.template.pid
    assert pid is not None
    return pid


# --- fork ---------------------------------------------------------------------------------
def test_a_forked_worker_registers_and_serves_a_turn(make_runtime, redis_server, r, tmp_path,
                                                     monkeypatch) -> None:
    rt = make_runtime()
    template_pid = _ready_template(rt)
    # set after the template started: it reaches the worker as an environment override
    monkeypatch.setenv("FLEET_WORKER_HEARTBEAT_TTL_MS", "2500")
    write_policy(r, "chat", TurnsPolicy())  # a tier no worker serves yet (without a policy: UnknownTier)
    with Fleet(redis_server.role_url("fleet-client")) as fleet:
        parked = fleet.submit("alice", "hello")  # onto an empty tier: it waits for a worker
        began = time.monotonic()
        (wid,) = rt.spawn("chat", 1)
        reply = parked.result(TIMEOUT)
    assert reply.ok and reply.text.startswith("echo: hello") and reply.worker == wid
    assert time.monotonic() - began < 10
    handle = _handle(rt, wid)
    proc = psutil.Process(handle.pid)
    assert proc.ppid() == template_pid  # forked, not exec'd by us
    shown = subprocess.run(["ps", "-o", "args=", "-p", str(handle.pid)], capture_output=True, text=True)
    assert shown.stdout.strip() == f"fleet-worker chat {wid}"  # not the template's command line
    assert os.getsid(handle.pid) == handle.pid  # its own session
    assert 0 < r.pttl(keys.heartbeat(wid)) <= 2500
    assert "serving tier chat" in (tmp_path / "logs" / f"{wid}.log").read_text()
    record = json.loads((tmp_path / "run" / f"{wid}.json").read_text())
    assert record["pid"] == handle.pid and abs(record["create_time"] - proc.create_time()) < 1


def test_retire_drains_a_forked_worker(make_runtime, redis_server, r) -> None:
    rt = make_runtime()
    keep, victim = rt.spawn("chat", 2)
    wait_running(rt, [keep, victim])
    rt.retire(victim, "test", drain_timeout_s=15)
    assert _handle(rt, victim).state is Lifecycle.DRAINING
    gone = reap_until_exited(rt, victim)
    # the exit code comes from the template, which reaped it
    assert gone.exit_code == 0 and not gone.killed and gone.retire_reason == "test"
    assert [h.worker_id for h in rt.live()] == [keep]
    assert not r.hexists(keys.WORKERS, victim) and not r.exists(keys.heartbeat(victim))
    write_policy(r, "chat", TurnsPolicy())  # the client role knows a tier by its policy
    with Fleet(redis_server.role_url("fleet-client")) as fleet:
        assert fleet.submit("bob", "still there?").result(TIMEOUT).worker == keep


def test_a_forked_worker_that_does_not_drain_is_killed(make_runtime) -> None:
    rt = make_runtime()
    (wid,) = rt.spawn("chat", 1)
    wait_running(rt, [wid])
    pid = _handle(rt, wid).pid
    os.kill(pid, signal.SIGSTOP)  # it cannot read its control stream any more
    rt.retire(wid, "test", drain_timeout_s=0.5)
    gone = reap_until_exited(rt, wid)
    assert gone.killed and gone.exit_code == -signal.SIGKILL and not psutil.pid_exists(pid)


def test_the_template_reaps_its_children(make_runtime) -> None:
    rt = make_runtime()
    template_pid = _ready_template(rt)
    ids = rt.spawn("chat", 3)
    wait_running(rt, ids)
    victims = [_handle(rt, w) for w in ids[:2]]
    for h in victims:
        os.kill(h.pid, signal.SIGKILL)  # crashes: nobody drains them
    gone: list = []
    wait_until(lambda: gone.extend(rt.reap()) or len(gone) == 2, TIMEOUT, "the crashes to be seen")
    assert {h.worker_id for h in gone} == set(ids[:2])
    assert [h.exit_code for h in gone] == [-signal.SIGKILL] * 2  # reported by the template
    children = psutil.Process(template_pid).children()
    assert [c.pid for c in children] == [_handle(rt, ids[2]).pid]
    assert all(c.status() != psutil.STATUS_ZOMBIE for c in children)
    assert not [h.pid for h in victims if psutil.pid_exists(h.pid)]


def test_a_worker_survives_the_template_and_a_new_template_is_started(make_runtime,
                                                                      redis_server, r) -> None:
    write_policy(r, "chat", TurnsPolicy())  # the client role knows a tier by its policy
    rt = make_runtime()
    first_template = _ready_template(rt)
    (old,) = rt.spawn("chat", 1)
    wait_running(rt, [old])
    os.kill(first_template, signal.SIGKILL)
    wait_until(lambda: not running(first_template), TIMEOUT, "the template to die")
    with Fleet(redis_server.role_url("fleet-client")) as fleet:
        assert fleet.submit("carol", "anyone?").result(TIMEOUT).worker == old
        (new,) = rt.spawn("chat", 1)  # starts another template
        wait_running(rt, [new])
        assert rt.spawner.template is not None and rt.spawner.template.pid not in (None, first_template)
        assert psutil.Process(_handle(rt, new).pid).ppid() == rt.spawner.template.pid
    rt.retire(old, "test", drain_timeout_s=15)
    gone = reap_until_exited(rt, old)  # an orphan now: seen through psutil, code unknown
    assert not gone.killed and gone.exit_code in (0, None)


def test_stop_all_leaves_no_process(make_runtime, r) -> None:
    rt = make_runtime()
    template_pid = _ready_template(rt)
    ids = rt.spawn("chat", 3)
    wait_running(rt, ids)
    pids = [h.pid for h in rt.list()]
    stopped = rt.stop_all(timeout=10)
    assert {h.worker_id for h in stopped} == set(ids)
    assert all(h.state is Lifecycle.EXITED and h.exit_code == 0 for h in stopped)
    assert not [p for p in [*pids, template_pid] if psutil.pid_exists(p)]  # not even zombies
    assert rt.spawner.template is not None and rt.spawner.template.pid is None
    assert rt.list() == [] and r.hlen(keys.WORKERS) == 0


def test_adopt_finds_forked_workers_from_the_registry(make_runtime, tmp_path) -> None:
    first = make_runtime()
    ids = first.spawn("chat", 2)
    wait_running(first, ids)
    # shares no run records with the first (only the spawn proof): the forked workers' command
    # line is the template's, so the registry entry is matched by the template marker and the
    # start time
    share_proof(tmp_path / "run", tmp_path / "other-run")
    second = make_runtime(run_dir=tmp_path / "other-run", spawn_mode="exec")
    adopted = {h.worker_id: h for h in second.adopt()}
    assert set(adopted) == set(ids) and all(h.adopted for h in adopted.values())
    stopped = second.stop_all(timeout=10)
    assert {h.worker_id for h in stopped} == set(ids)
    wait_until(lambda: {h.worker_id for h in first.reap()} == set(ids) or not first.list(),
               TIMEOUT, "the first runtime to see them gone")


def test_the_template_exits_with_its_parent(tmp_path) -> None:
    code = ("import sys; from commander.runtime.process.fork_client import TemplateSpawner; "
            f"t = TemplateSpawner(log_dir={str(tmp_path)!r}); assert t.start(); print(t.pid, flush=True)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    template_pid = int(out.stdout.split()[0])  # its parent has exited: the socket is closed
    wait_until(lambda: not running(template_pid), TIMEOUT, "the orphaned template to exit")


# --- exec ---------------------------------------------------------------------------------
@pytest.mark.parametrize("python", ["missing", "exits"])
def test_fallback_to_a_fresh_interpreter_when_the_template_cannot_start(
        make_runtime, redis_server, r, tmp_path, caplog, python) -> None:
    if python == "missing":
        exe = str(tmp_path / "no-such-python")
    else:
        exe = str(tmp_path / "fake-python")
        Path(exe).write_text("#!/bin/sh\necho 'no template here' >&2\nexit 3\n")
        Path(exe).chmod(0o755)
    caplog.set_level(logging.WARNING, logger="commander.runtime.process.fork_client")
    broken = TemplateSpawner({**os.environ, "REDIS_URL": redis_server.url}, tmp_path / "logs",
                             python=exe, start_timeout_s=10)
    rt = make_runtime(template=broken)
    write_policy(r, "chat", TurnsPolicy())
    with Fleet(redis_server.role_url("fleet-client")) as fleet:
        parked = fleet.submit("dave", "slowly")
        (wid,) = rt.spawn("chat", 1)
        reply = parked.result(60)
    assert reply.ok and reply.worker == wid
    assert psutil.Process(_handle(rt, wid).pid).ppid() == os.getpid()  # exec'd by us
    assert "fork template unavailable" in caplog.text and rt.spawner.template is not None
    assert rt.spawner.template.pid is None
    stopped = rt.stop_all(timeout=10)
    assert [h.exit_code for h in stopped] == [0]


def test_exec_mode_starts_no_template(make_runtime) -> None:
    rt = make_runtime(spawn_mode="exec")
    assert rt.spawner.template is None
    (wid,) = rt.spawn("chat", 1)
    assert psutil.Process(_handle(rt, wid).pid).ppid() == os.getpid()
    with pytest.raises(ValueError, match="spawn_mode"):
        make_runtime(spawn_mode="vfork")


# --- the benchmark ------------------------------------------------------------------------
@pytest.mark.smoke
def test_bench_spawn_quick(tmp_path) -> None:
    out = tmp_path / "spawn.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_spawn.py"), "--quick",
                          "--json", str(out)], capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [m["mode"] for m in result["results"]] == ["fork", "exec"]
    for mode in result["results"]:
        assert mode["trials"] == 3
        assert 0 < mode["registered_ms"]["median"] <= mode["first_turn_ms"]["median"]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == result


def test_bench_spawn_rejects_bad_arguments() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_spawn.py"), "--trials", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and "must be positive" in run.stderr and run.stderr.count("\n") == 1
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_spawn.py"), "--modes", "clone"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and "--modes" in run.stderr and run.stderr.count("\n") == 1
