"""Fleet's Lua as a Redis Functions library, installed by an admin: the runtime processes only
call it (``FCALL``), and one that finds it missing or of another version says so in one line
and waits, then serves.

The runtime user here may run every command but Redis' scripting ones, ``FCALL`` and
``FCALL_RO`` excepted: no ``EVAL``, ``EVALSHA``, ``SCRIPT`` or ``FUNCTION``.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.policy import TurnsPolicy
from stores import outbox
from stores.policies import write_policy
from tests.conftest import ADMIN_PASSWORD, RedisServer, start_on_free_port
from tests.helpers import Processes, fleet_cli, leads
from tests.integration.conftest import FAST_WORKER_ENV, wait_until

pytestmark = pytest.mark.integration

# a library of the name Fleet's has, from another version of Fleet
OTHER_VERSION = ("#!lua name=fleet\nredis.register_function{function_name='fleet_version', "
                 "callback=function() return 'v0' end, flags={'no-writes'}}")


@pytest.fixture
def runtime_url(r: redis.Redis, redis_server: object) -> Iterator[str]:
    """A user allowed every command but scripting, FCALL and FCALL_RO excepted."""
    pw = secrets.token_hex(12)
    r.execute_command("ACL", "SETUSER", "runtime", "reset", "on", f">{pw}", "~*", "&*",
                      "+@all", "-@scripting", "+fcall", "+fcall_ro")
    yield f"redis://runtime:{pw}@127.0.0.1:{redis_server.port}/0"  # type: ignore[attr-defined]
    r.execute_command("ACL", "DELUSER", "runtime")


@pytest.fixture
def reinstalled(r: redis.Redis, fleet_env: dict[str, str]) -> Iterator[None]:
    """The module's server holds the library again after the test (it deletes it)."""
    yield
    assert fleet_cli(as_admin(fleet_env), "install").returncode == 0


def as_admin(env: dict[str, str]) -> dict[str, str]:
    """``env`` knowing the admin's password: `fleet install` connects as the admin."""
    return {**env, "FLEET_ACL_PASSWORD_ADMIN": ADMIN_PASSWORD}


def version_of(install: subprocess.CompletedProcess[str]) -> str:
    """The version ``fleet install`` printed (its one line)."""
    assert install.returncode == 0, install.stderr
    lines = install.stdout.splitlines()
    assert len(lines) == 1, lines
    found = re.search(r"version (\w+)", lines[0])
    assert found, lines[0]
    return found.group(1)


def test_the_runtime_user_can_load_no_code(runtime_url: str) -> None:
    runtime = redis.Redis.from_url(runtime_url)
    for denied in (("EVAL", "return 1", 0), ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 0),
                   ("SCRIPT", "LOAD", "return 1"), ("FUNCTION", "LOAD", OTHER_VERSION),
                   ("FUNCTION", "DELETE", "fleet"), ("FUNCTION", "FLUSH")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            runtime.execute_command(*denied)
    runtime.close()


def test_a_fleet_serves_turns_as_a_user_that_may_only_call_functions(
        runtime_url: str, start_commander: object, start_worker: object) -> None:
    env = {"REDIS_URL": runtime_url}
    start_commander(env=env)  # type: ignore[operator]
    start_worker(env=env)  # type: ignore[operator]
    fleet = Fleet(runtime_url)
    for text in ("hello", "again"):
        reply = fleet.submit("alice", text).result(15)
        assert reply.ok and reply.text.startswith(f"echo: {text}"), reply


def test_install_needs_an_admin_and_check_says_the_state(r: redis.Redis, fleet_env: dict[str, str],
                                                         runtime_url: str, reinstalled: None) -> None:
    version = version_of(fleet_cli(as_admin(fleet_env), "install"))
    check = fleet_cli(as_admin(fleet_env), "install", "--check")
    assert check.returncode == 0 and f"ok (this Fleet needs version {version}" in check.stdout
    refused = fleet_cli(fleet_env, "install", "--url", runtime_url)  # the admin's password unknown
    assert refused.returncode != 0 and "admin" in refused.stderr and "function|load" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    r.function_load(OTHER_VERSION, replace=True)
    check = fleet_cli(as_admin(fleet_env), "install", "--check")
    assert check.returncode == 1 and "other version" in check.stdout and "Redis has v0" in check.stdout
    r.function_flush()
    check = fleet_cli(as_admin(fleet_env), "install", "--check")
    assert check.returncode == 1 and "missing" in check.stdout and "Redis has none" in check.stdout


def waiting_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "`fleet install`" in line]


@pytest.mark.parametrize("found", ["missing", "other version"])
def test_a_worker_started_before_the_install_says_so_once_and_serves_after_it(
        found: str, r: redis.Redis, redis_server: object, fleet_env: dict[str, str], tmp_path: Path,
        reinstalled: None) -> None:
    r.function_flush()
    if found == "other version":
        r.function_load(OTHER_VERSION)
    log = tmp_path / "worker.log"
    env = {**fleet_env, **FAST_WORKER_ENV, "FLEET_LIBRARY_CHECK_S": "0.1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--tier", "chat", "--worker-id", "w-wait"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: waiting_lines(log) or proc.poll() is not None, 20, "the worker's line")
        [line] = waiting_lines(log)
        assert ("version v0 of" if found == "other version" else "no Fleet functions library") in line
        assert not r.exists(keys.heartbeat("w-wait"))  # it waits before it joins
        version = version_of(fleet_cli(as_admin(fleet_env), "install"))
        assert f"needs version {version}" in line
        write_policy(r, "chat", TurnsPolicy())  # the tier by its policy, not by the worker still joining
        reply = Fleet(redis_server.url).submit("alice", "hi").result(20)  # type: ignore[attr-defined]
        assert reply.ok, reply
        assert len(waiting_lines(log)) == 1  # one line, however often it looked again
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_a_library_gone_at_run_time_is_waited_for_and_the_turn_answered(
        r: redis.Redis, redis_server: RedisServer, fleet_env: dict[str, str], start_worker: object,
        tmp_path: Path, reinstalled: None) -> None:
    worker = start_worker(env={"FLEET_LIBRARY_CHECK_S": "0.1"})  # type: ignore[operator]
    write_policy(r, "chat", TurnsPolicy())  # the client role knows a tier by its policy
    fleet = Fleet(redis_server.role_url("fleet-client"))
    assert fleet.submit("bob", "before").result(15).ok
    r.function_flush()  # as a Redis restarted without persistence
    with pytest.raises(redis.ResponseError, match="fleet install"):  # a client's submit says why
        fleet.submit("bob", "refused")
    # the raw protocol needs no function: the turn reaches the worker, which waits for the library
    entry = r.xadd(keys.inbox("bob"), {"text": "during"}).decode()
    r.xadd(keys.ready("chat"), {"user": "bob"})
    wait_until(lambda: waiting_lines(worker.log), 20, "the worker's line")
    assert fleet_cli(as_admin(fleet_env), "install").returncode == 0
    got = r.blpop([keys.reply("bob", entry)], timeout=20)
    assert got is not None and b"echo: during" in got[1]
    assert worker.proc.poll() is None
    assert len(waiting_lines(worker.log)) == 1


def test_a_commander_started_before_the_install_says_so_once_and_goes_on_and_the_relay_needs_none(
        r: redis.Redis, fleet_env: dict[str, str], start_commander: Any, processes: Processes,
        reinstalled: None) -> None:
    r.function_flush()
    quick = {"FLEET_LIBRARY_CHECK_S": "0.1"}
    commander = start_commander(env=quick, lead=False)
    relay = processes.start("relay", ["-m", "fleet.cli", "relay", "--id", "rl-wait"], {**fleet_env, **quick})
    wait_until(lambda: waiting_lines(commander.log) or not commander.alive(), 20, "the line")
    assert commander.alive(), commander.tail()
    assert not leads(r, "c1")
    # the relay calls no function: it moves deferrals without the library
    wait_until(lambda: "rl-wait" in outbox.relay_beats(r), 20, "the relay to beat")
    assert fleet_cli(as_admin(fleet_env), "install").returncode == 0
    wait_until(lambda: leads(r, "c1"), 20, "the commander to lead")
    assert len(waiting_lines(commander.log)) == 1 and commander.alive()
    assert not waiting_lines(relay.log) and relay.alive()


def test_a_commander_started_while_redis_is_away_waits_for_it_then_leads(
        tmp_path: Path, fleet_env: dict[str, str], processes: Processes) -> None:
    server = start_on_free_port(tmp_path)
    server.stop()  # away when the commander starts
    try:
        commander = processes.commander({**fleet_env, **FAST_WORKER_ENV, "REDIS_URL": server.url}, "c-away")
        wait_until(lambda: "Redis unavailable at start" in commander.tail() or not commander.alive(), 30,
                   "the commander to wait for Redis")
        assert commander.alive(), commander.tail()
        server.start()  # with the library, as an operator's Redis
        admin = server.client()
        wait_until(lambda: leads(admin, "c-away") or not commander.alive(), 30, "the commander to lead")
        assert commander.alive(), commander.tail()
        admin.close()
    finally:
        processes.stop_all()
        server.stop()
