"""Fleet's ACL roles on a real server (the test server loads them: tests/conftest.py).

Each role is refused what it must not do (``NOPERM``); the Python client submits as
``fleet-client`` alone; a commander hands its workers the worker URL it is given; a CLI command
refused by the ACL says so in one line (the role, the right, the fix) and exits 2.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from protocol import keys
from protocol.acl import ROLE_NAMES, role
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from stores.roles import password_env, with_credentials
from tests.conftest import RedisServer, acl_denial, role_env
from tests.helpers import fleet_cli, wait_until

RUNTIME_ROLES = ("fleet-client", "fleet-worker", "fleet-commander", "fleet-relay")

# What no role may do, each a command Redis refuses with NOPERM
FORBIDDEN_TO_ALL: dict[str, tuple[str, ...]] = {
    "flushall": ("FLUSHALL",),
    "config-set": ("CONFIG", "SET", "maxmemory", "1"),
    "config-get": ("CONFIG", "GET", "requirepass"),
    "keys": ("KEYS", "*"),
    "acl-setuser": ("ACL", "SETUSER", "intruder", "on", ">pw", "~*", "+@all"),
    "acl-list": ("ACL", "LIST"),
    "shutdown": ("SHUTDOWN", "NOSAVE"),
    "debug": ("DEBUG", "SLEEP", "0"),
    "function-load": ("FUNCTION", "LOAD", "#!lua name=evil\nredis.register_function('f', function() end)"),
    "function-delete": ("FUNCTION", "DELETE", "fleet"),
    "function-flush": ("FUNCTION", "FLUSH"),
    "eval": ("EVAL", "return 1", "0"),
    "module": ("MODULE", "LIST"),
    "monitor-like": ("CLIENT", "KILL", "TYPE", "normal"),
    "rq-keys": ("GET", "rq:job:x"),
}

DRY_RUN = ("shutdown", "debug")


def _as(redis_server: RedisServer, role: str) -> redis.Redis:
    return redis.Redis.from_url(redis_server.role_url(role))


@pytest.fixture(autouse=True)
def roles_alone(r: redis.Redis) -> Iterator[None]:
    """Each role as `fleet acl` writes it without RQ, as user ``<role>-alone``."""
    for name in ROLE_NAMES:
        rules = role(name).rules().split()
        r.execute_command("ACL", "SETUSER", f"{name}-alone", "reset", "on", "nopass", *rules)
    yield
    r.execute_command("ACL", "DELUSER", *(f"{name}-alone" for name in ROLE_NAMES))


@pytest.fixture
def clients(redis_server: RedisServer, r: redis.Redis) -> Iterator[dict[str, redis.Redis]]:
    made = {role: _as(redis_server, role) for role in ROLE_NAMES}
    yield made
    for client in made.values():
        client.close()


# (the roles that use RQ on a node shared with it may read RQ's keys: only the client is refused them)
@pytest.mark.acl_denials
@pytest.mark.parametrize(("role", "what"), [(role, what) for role in ROLE_NAMES
                                            for what in sorted(FORBIDDEN_TO_ALL)
                                            if what != "rq-keys" or role == "fleet-client"])
def test_no_role_may_administer_redis_or_load_code(clients: dict[str, redis.Redis], r: redis.Redis,
                                                   role: str, what: str) -> None:
    command = FORBIDDEN_TO_ALL[what]
    if what in DRY_RUN:  # the server would refuse DEBUG itself, and a SHUTDOWN allowed would end the test
        verdict = r.execute_command("ACL", "DRYRUN", role, *command).decode()
        assert verdict.startswith("This user has no permissions"), verdict
        return
    with pytest.raises(redis.exceptions.NoPermissionError):
        clients[role].execute_command(*command)


@pytest.mark.acl_denials
@pytest.mark.parametrize("role", RUNTIME_ROLES)
def test_no_runtime_role_may_load_a_script(r: redis.Redis, role: str) -> None:
    """The role as `fleet acl` writes it for a Redis without RQ (RQ loads its own Lua: on a node
    shared with RQ, the roles that use RQ keep that right on its keys)."""
    verdict = r.execute_command("ACL", "DRYRUN", f"{role}-alone", "SCRIPT", "LOAD", "while true do end")
    assert verdict.decode().startswith("This user has no permissions"), verdict


@pytest.mark.acl_denials
@pytest.mark.parametrize("role", ("fleet-client",))
def test_scan_is_refused_to_the_roles_that_list_no_keys(clients: dict[str, redis.Redis], role: str) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        clients[role].scan(0, match="fleet:*")


@pytest.mark.acl_denials
def test_a_client_writes_no_policy_and_reads_no_registry(clients: dict[str, redis.Redis]) -> None:
    """(It may read inboxes: the cancel function, which runs on its rights, reads them to find
    the turn; and write a worker's cancels stream, not its control stream.)"""
    client = clients["fleet-client"]
    refused = [lambda: client.set(keys.policy("chat"), "{}"), lambda: client.hgetall(keys.WORKERS),
               lambda: client.hset(keys.pins("alice"), "chat", "canary"), lambda: client.get(keys.LEADER),
               lambda: client.xrange(keys.EVENTS), lambda: client.lrange(keys.session("alice"), 0, -1),
               lambda: client.delete(keys.dead("chat")), lambda: client.xread({keys.cancels("w-1"): "0-0"}),
               lambda: client.xadd(keys.control("w-1"), {"op": "drain"}),
               lambda: client.set(keys.heartbeat("w-1"), 1)]
    for call in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()


@pytest.mark.acl_denials
def test_a_relay_touches_only_the_outboxes(clients: dict[str, redis.Redis]) -> None:
    relay = clients["fleet-relay"]
    for call in (lambda: relay.hgetall(keys.WORKERS), lambda: relay.set(keys.policy("chat"), "{}"),
                 lambda: relay.xadd(keys.inbox("alice"), {"text": "x"}), lambda: relay.delete(keys.EVENTS)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()


@pytest.mark.acl_denials
def test_a_worker_writes_no_policy_and_takes_no_lease(clients: dict[str, redis.Redis]) -> None:
    worker = clients["fleet-worker"]
    worker.get(keys.policy("chat"))  # it reads a policy (NOPERM would raise)
    worker.set(keys.policy_good("nosuch"), "{}")  # and records the last good copy
    worker.delete(keys.policy_good("nosuch"))
    for call in (lambda: worker.set(keys.policy("chat"), "{}"), lambda: worker.sadd(keys.TIERS, "evil"),
                 lambda: worker.set(keys.LEADER, "w|1"), lambda: worker.incr(keys.EPOCH),
                 lambda: worker.xadd(keys.EVENTS, {"m": "forged"}),
                 lambda: worker.hset(keys.COMMANDERS, "c", "x")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()


@pytest.mark.acl_denials
def test_the_python_client_submits_as_the_client_role(
        redis_server: RedisServer, r: redis.Redis, start_worker) -> None:  # type: ignore[no-untyped-def]
    from fleet.client import Fleet, UnknownTier

    with Fleet(redis_server.role_url("fleet-client")) as fleet, pytest.raises(UnknownTier):
        fleet.submit("alice", "no policy names chat yet")  # the registry is not the client's to read
    write_policy(r, "chat", TurnsPolicy())
    start_worker()
    r.acl_log_reset()
    with Fleet(redis_server.role_url("fleet-client")) as fleet:
        assert fleet.submit("alice", "hello").result(20).ok
    assert [e for e in r.acl_log() if e.get("username") == "fleet-client"] == []


def test_a_commander_gives_its_workers_the_worker_url(
        redis_server: RedisServer, r: redis.Redis, fleet_env: dict[str, str], processes) -> None:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in fleet_env.items() if k not in role_env()}  # credentials in the URLs only
    env.update(REDIS_URL=redis_server.role_url("fleet-commander"),
               FLEET_COMMANDER_WORKER_REDIS_URL=redis_server.role_url("fleet-worker"))
    started = processes.commander(env, "c-acl")

    def users() -> set[str]:
        return {c["user"] for c in r.client_list()}

    wait_until(lambda: r.hlen(keys.WORKERS) > 0 or not started.alive(), 30, "a worker to register")
    assert started.alive(), started.tail()
    assert {"fleet-commander", "fleet-worker"} <= users()
    assert "redis://" not in started.tail(100_000).replace(redis_server.plain_url, "")


@pytest.mark.acl_denials
def test_a_refused_cli_command_says_which_role_and_right_in_one_line(
        r: redis.Redis, fleet_env: dict[str, str]) -> None:
    r.execute_command("ACL", "SETUSER", "fleet-operator", "-set")
    try:
        out = fleet_cli(fleet_env, "policy", "set", "chat", "min_workers=1")
    finally:
        r.execute_command("ACL", "SETUSER", "fleet-operator", "+set")
    assert out.returncode == 2, out
    [line] = out.stderr.splitlines()
    assert "fleet-operator" in line and "SET fleet:policy:{chat}" in line and "fleet acl" in line
    assert "Traceback" not in out.stderr

    wrong = fleet_cli({**fleet_env, password_env("fleet-operator"): "not-it"}, "status")
    assert wrong.returncode == 2, wrong
    [line] = wrong.stderr.splitlines()
    assert "fleet-operator" in line and password_env("fleet-operator") in line
    assert "not-it" not in wrong.stderr and os.environ.get("REDIS_URL", "\0") not in wrong.stderr


def test_fleet_up_runs_its_own_redis_with_the_roles_and_each_process_as_its_role(
        fleet_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in fleet_env.items() if k not in role_env() and k != "REDIS_URL"}
    home = Path(env["FLEET_HOME"])
    up = fleet_cli(env, "up", "--json", cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stderr
        passwords = json.loads((home / "acl-passwords").read_text())
        for secret in (home / "acl-passwords", home / "redis" / "users.acl"):
            assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert not any(pw in (home / "redis" / "users.acl").read_text() for pw in passwords.values())
        state = json.loads((home / "state.json").read_text())
        assert urlsplit(state["url"]).username == "fleet-client"
        admin = redis.Redis.from_url(with_credentials(state["url"], "default", passwords["default"]))
        try:
            reply = fleet_cli(env, "submit", "--user", "alice", "hi", cwd=tmp_path)
            assert reply.returncode == 0, reply.stderr
            assert fleet_cli(env, "policy", "set", "chat", "max_workers=3", cwd=tmp_path).returncode == 0
            users = {c["user"] for c in admin.client_list()}
            assert {"fleet-commander", "fleet-worker"} <= users, users
            assert [acl_denial(e) for e in admin.acl_log()] == []
            plain = with_credentials(state["url"], "nobody", "x").replace("nobody:x@", "")
            with pytest.raises(redis.AuthenticationError):
                redis.Redis.from_url(plain).get("k")  # the default user needs the admin's password
        finally:
            admin.close()
    finally:
        down = fleet_cli(env, "down", cwd=tmp_path)
        assert down.returncode == 0, down.stderr
