"""The process runtime and ``fleet up``/``down`` on a real Redis.

Workers here are a stand-in script that keeps the worker contract (register in
``fleet:workers``, heartbeat, drain on SIGTERM or a control-stream ``drain``), so the runtime
is tested without the real worker. The last tests run the real ``python -m worker``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import redis

from commander.runtime import Lifecycle
from commander.runtime.process import ProcessRuntime, new_worker_id
from fleet.client import Fleet
from protocol import keys
from protocol.codec import encode
from protocol.models import WorkerInfo
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from stores.registry import read_entries
from stores.roles import with_credentials
from tests.conftest import ROLE_PASSWORDS
from tests.helpers import fleet_cli, running
from tests.integration.conftest import reap_until_exited, share_proof, wait_running

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

STANDIN = r'''
import argparse, os, signal, socket, sys, time
import redis
from protocol import keys
from protocol.codec import decode, encode
from protocol.models import Control, WorkerInfo

p = argparse.ArgumentParser()
p.add_argument("--tier")
p.add_argument("--worker-id")
p.add_argument("--ignore-drain", action="store_true")
p.add_argument("--register-after", type=float, default=0.0)
a = p.parse_args()
stop = False

def on_term(*_):
    global stop
    stop = stop or not a.ignore_drain

signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, signal.SIG_IGN)
r = redis.Redis.from_url(os.environ["REDIS_URL"])
time.sleep(a.register_after)
info = WorkerInfo(worker=a.worker_id, tier=a.tier, pid=os.getpid(), host=socket.gethostname(),
                  started=time.time())
r.hset(keys.WORKERS, a.worker_id, encode(info))
r.incr(keys.WORKERS_VERSION)
last = "0-0"
while not stop:
    r.set(keys.heartbeat(a.worker_id), "1", px=2000)
    for _stream, entries in r.xread({keys.control(a.worker_id): last}, block=100) or []:
        for eid, fields in entries:
            last = eid
            if decode(Control, fields[b"m"]).kind == "drain" and not a.ignore_drain:
                stop = True
time.sleep(0.2)  # "finishing in-flight users"
r.hdel(keys.WORKERS, a.worker_id)
r.incr(keys.WORKERS_VERSION)
r.delete(keys.heartbeat(a.worker_id))
print("drained", flush=True)
'''


@pytest.fixture
def standin(tmp_path: Path) -> Callable[[str, str], list[str]]:
    """Command builder: tier ``stubborn`` ignores drains, tier ``late`` registers after 30 s."""
    script = tmp_path / "standin_worker.py"
    script.write_text(STANDIN)

    def command(tier: str, worker_id: str) -> list[str]:
        argv = [sys.executable, str(script), "--tier", tier, "--worker-id", worker_id]
        if tier == "stubborn":
            argv.append("--ignore-drain")
        if tier == "late":
            argv += ["--register-after", "30"]
        return argv

    return command


@pytest.fixture
def make_runtime(make_runtime: Callable[..., ProcessRuntime],
                 standin: Callable[[str, str], list[str]]) -> Callable[..., ProcessRuntime]:
    """Process runtimes whose workers are the stand-in script."""
    return functools.partial(make_runtime, command=standin)


def _registry(r: redis.Redis) -> dict[str, WorkerInfo]:
    return {info.worker: info for info in read_entries(r)[0]}


# --- runtime --------------------------------------------------------------------------------
def test_worker_ids_name_their_tier() -> None:
    assert re.fullmatch(r"chat-[0-9a-f]{8}", new_worker_id("chat"))
    assert new_worker_id("chat") != new_worker_id("chat")


def test_spawn_two_and_list(make_runtime, r, tmp_path: Path) -> None:
    rt = make_runtime()
    ids = rt.spawn("chat", 2)
    assert len(ids) == 2 and all(re.fullmatch(r"chat-[0-9a-f]{8}", i) for i in ids)
    assert {h.state for h in rt.list()} == {Lifecycle.STARTING}
    wait_running(rt, ids)
    handles = {h.worker_id: h for h in rt.list()}
    assert set(handles) == set(ids)
    registry = _registry(r)
    for wid in ids:
        assert handles[wid].tier == "chat" and handles[wid].exit_code is None
        assert registry[wid].pid == handles[wid].pid and running(handles[wid].pid)
        assert os.getpgid(handles[wid].pid) == handles[wid].pid  # its own session
        assert (tmp_path / "logs" / f"{wid}.log").exists()
        assert (tmp_path / "run" / f"{wid}.json").exists()
    assert [h.worker_id for h in rt.live("chat")] == [h.worker_id for h in rt.list()]


def test_retire_drains_through_the_control_stream(make_runtime, r) -> None:
    rt = make_runtime()
    keep, victim = rt.spawn("chat", 2)
    wait_running(rt, [keep, victim])
    rt.retire(victim, "test", drain_timeout_s=10)
    assert {h.worker_id: h.state for h in rt.list()}[victim] is Lifecycle.DRAINING
    rt.retire(victim, "again")  # idempotent
    gone = reap_until_exited(rt, victim)
    assert gone.exit_code == 0 and not gone.killed and gone.retire_reason == "test"
    assert [h.worker_id for h in rt.live()] == [keep]
    assert victim not in _registry(r) and not r.exists(keys.heartbeat(victim))


def test_worker_that_ignores_drain_is_killed_after_the_timeout(make_runtime, r) -> None:
    rt = make_runtime()
    (wid,) = rt.spawn("stubborn", 1)
    wait_running(rt, [wid])
    pid = rt.list()[0].pid
    began = time.monotonic()
    rt.retire(wid, "test", drain_timeout_s=0.5)
    assert rt.reap() == [] and running(pid)  # non-blocking: nothing is killed before the deadline
    gone = reap_until_exited(rt, wid)
    assert time.monotonic() - began >= 0.5
    assert gone.killed and gone.exit_code == -9 and not running(pid)
    # it could not clean up after itself: the runtime did
    assert wid not in _registry(r) and not r.exists(keys.heartbeat(wid), keys.control(wid))


def test_stop_all_leaves_no_process(make_runtime, r) -> None:
    rt = make_runtime()
    ids = rt.spawn("chat", 2) + rt.spawn("stubborn", 1)
    wait_running(rt, ids)
    pids = [h.pid for h in rt.list()]
    stopped = rt.stop_all(timeout=1.0)
    assert {h.worker_id for h in stopped} == set(ids)
    assert all(h.state is Lifecycle.EXITED for h in stopped)
    assert {h.worker_id for h in stopped if h.killed} == {ids[2]}
    assert not [p for p in pids if psutil.pid_exists(p)]  # reaped, not even zombies
    assert rt.list() == [] and r.hlen(keys.WORKERS) == 0


def test_a_worker_that_never_registers_is_killed(make_runtime) -> None:
    rt = make_runtime(start_timeout_s=0.5)
    (wid,) = rt.spawn("late", 1)
    gone = reap_until_exited(rt, wid)
    assert gone.killed and gone.retire_reason == "start timeout"


def test_adopt_finds_workers_from_the_registry(make_runtime, r, tmp_path: Path) -> None:
    first = make_runtime()
    ids = first.spawn("chat", 2)
    wait_running(first, ids)
    # another instance that shares no run records with the first (only the spawn proof of this
    # host's commanders): the registry is the source
    share_proof(tmp_path / "run", tmp_path / "other-run")
    second = make_runtime(run_dir=tmp_path / "other-run")
    adopted = {h.worker_id: h for h in second.adopt()}
    assert set(adopted) == set(ids)
    assert all(h.adopted and h.state is Lifecycle.RUNNING for h in adopted.values())
    assert {h.pid for h in adopted.values()} == {h.pid for h in first.list()}
    assert second.adopt() == []  # already tracked
    second.retire(ids[0], "test", drain_timeout_s=10)
    gone = reap_until_exited(second, ids[0])  # not its child: seen through psutil
    # (the exit code is only known when the adopter may wait for it: same process here)
    assert not gone.killed and gone.exit_code in (0, None)
    stopped = second.stop_all(timeout=5)
    assert [h.worker_id for h in stopped] == [ids[1]]
    assert {h.worker_id for h in first.reap()} == set(ids)  # the parent collects the zombies


def test_adopt_finds_unregistered_workers_from_run_records(make_runtime, r) -> None:
    first = make_runtime()
    (wid,) = first.spawn("late", 1)
    second = make_runtime()  # same run dir: a restarted commander
    (handle,) = second.adopt()
    assert handle.worker_id == wid and handle.state is Lifecycle.STARTING and handle.adopted
    second.stop_all(timeout=0.5)
    assert not running(handle.pid)


def test_adopt_ignores_dead_and_foreign_entries(make_runtime, r, tmp_path: Path) -> None:
    rt = make_runtime()
    here = rt.adoption.host
    entries = [
        WorkerInfo(worker="chat-deadbeef", tier="chat", pid=2**22 - 1, host=here, started=1.0),
        # alive, but not that worker: a reused pid
        WorkerInfo(worker="chat-0000cafe", tier="chat", pid=os.getpid(), host=here, started=1.0),
        # another host, or the same name in another pid namespace (its heartbeat lives)
        WorkerInfo(worker="chat-0ddba11a", tier="chat", pid=os.getpid(), host="elsewhere",
                   started=1.0),
        WorkerInfo(worker="chat-0000beef", tier="chat", pid=2**22 - 1, host=here, started=1.0),
    ]
    for info in entries:
        r.hset(keys.WORKERS, info.worker, encode(info))
    r.set(keys.heartbeat("chat-0000beef"), "1", px=10_000)
    assert rt.adopt() == []
    # local entries that are dead and silent are cleaned up; the others are not ours to touch
    assert set(_registry(r)) == {"chat-0ddba11a", "chat-0000beef"}


# --- fleet up / down (the real worker) -------------------------------------------------------
@pytest.mark.parametrize("external", [True, False], ids=["REDIS_URL", "local-redis-server"])
def test_fleet_up_then_down_leaves_nothing(fleet_env: dict[str, str], tmp_path: Path, r,
                                          external: bool) -> None:
    env = dict(fleet_env)
    if not external:
        del env["REDIS_URL"]  # fleet up starts its own redis-server on a free port
    up = fleet_cli(env, "up", "--json", "--timeout", "60", cwd=tmp_path)
    state_file = Path(env["FLEET_HOME"]) / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    try:
        assert up.returncode == 0, up.stderr
        result = json.loads(up.stdout)
        assert result["status"] == "up" and len(result["workers"]) == 1
        # the roles' passwords are the test's (fleet_env), on the test's server and on up's own
        client = redis.Redis.from_url(with_credentials(state["url"], "fleet-operator",
                                                       ROLE_PASSWORDS["fleet-operator"]))
        assert client.sismember(keys.TIERS, "chat") and client.exists(keys.policy("chat"))
        worker_pids = [i.pid for i in _registry(client).values()]
        # the relay runs beside the commander (the rq extra is installed here): a handler that
        # starts deferring after `up` has its jobs moved into RQ
        relay_pid = state["relay"]["pid"]
        assert result["relay"]["pid"] == relay_pid and running(relay_pid)
        write_policy(client, "chat", TurnsPolicy(handler="echo_defer"))
        deadline = time.monotonic() + 30
        while not client.llen("rq:queue:writeback"):
            assert time.monotonic() < deadline, "the deferred job never reached RQ"
            client_url = with_credentials(state["url"], "fleet-client", ROLE_PASSWORDS["fleet-client"])
            assert Fleet(client_url).submit("zoe", "hi").result(30).ok
        client.close()
        assert (redis_pid := (state.get("redis") or {}).get("pid")) or external

        again = fleet_cli(env, "up", "--json", cwd=tmp_path)
        assert again.returncode == 0 and json.loads(again.stdout)["status"] == "already-up"
    finally:
        down = fleet_cli(env, "down", "--json", cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert json.loads(down.stdout)["status"] == "down"
    pids = [state["commander"]["pid"], relay_pid, *worker_pids] + ([] if external else [redis_pid])
    assert not [p for p in pids if running(p)]
    assert not state_file.exists()
    if external:
        assert not r.exists("fleet:supervisor") and r.hlen(keys.WORKERS) == 0  # the removed supervisor's key
    again = fleet_cli(env, "down", cwd=tmp_path)
    assert again.returncode == 0 and "not up" in again.stdout


def test_bad_arguments_are_one_line_errors(fleet_env: dict[str, str], tmp_path: Path) -> None:
    env = dict(fleet_env, REDIS_URL="redis://127.0.0.1:1/0")  # nothing listens on port 1
    bad = fleet_cli(env, "up", cwd=tmp_path)
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("fleet up: cannot use Redis")
    assert not (Path(env["FLEET_HOME"]) / "state.json").exists()
    parse = fleet_cli(env, "down", "--timeout", "-1", cwd=tmp_path)
    assert parse.returncode == 2 and "--timeout" in parse.stderr


def test_up_down_arguments_do_not_clobber_global_options() -> None:
    from fleet.updown import add_up_down_arguments

    p = argparse.ArgumentParser()
    p.add_argument("--redis-url")
    p.add_argument("--json", action="store_true")
    add_up_down_arguments(p.add_subparsers())
    args = p.parse_args(["--redis-url", "redis://x", "--json", "up"])
    assert args.redis_url == "redis://x" and args.json and args.timeout == 30.0
    args = p.parse_args(["down", "--json"])
    assert args.json and args.redis_url is None


# --- crash-loop back-off ----------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_workers_that_exit_at_start_are_started_again_with_growing_delays(make_runtime, tmp_path) -> None:
    """A worker that exits before it ever registers: the pool's next start waits 1 s, 2 s, 4 s
    (the runtime's back-off clock is the test's), and each wait says the exit code and the last
    line of the worker's log; the commander's ledger gets the same line from ``refusal``."""
    from commander.runtime import Refused
    from commander.runtime.process.crashloop import CrashLoops

    script = tmp_path / "crash.py"
    script.write_text("import sys\nprint('starting', flush=True)\n"
                      "sys.exit('RuntimeError: cannot import the handler')\n")
    clock = _Clock()
    rt = make_runtime(command=lambda tier, wid: [sys.executable, str(script)],
                      crash_loops=CrashLoops(clock=clock))
    waits = []
    for n in range(1, 4):
        assert rt.refusal("chat") is None
        [wid] = rt.spawn("chat")
        gone = reap_until_exited(rt, wid)
        assert gone.exit_code == 1 and gone.error == "RuntimeError: cannot import the handler"
        why = rt.refusal("chat")
        assert why is not None and f"{n} in a row" in why
        assert "code 1, its log ends: RuntimeError: cannot import" in why
        with pytest.raises(Refused):
            rt.spawn("chat")
        waits.append(rt.crash_loops.waiting_s("chat"))
        clock.now += waits[-1]
    assert waits == [1.0, 2.0, 4.0]
    assert "3 in a row" in rt.crash_loops.loops()["chat"]
