"""compose/docker-compose.yml, as `docker compose config` (or Debian's docker-compose) parses
and normalizes it: the tool validates it against the compose schema, and the tests check what
the file promises: Redis with its append-only file on a named volume and Fleet's ACL roles, each
process connecting as its role, the secrets required, the commander with the process runtime
behind 127.0.0.1 only and its monitor behind the tokens, health checks on every long-running
service, the order of start. No container is started (no Docker engine runs here)."""

from __future__ import annotations

import re
import tomllib
from typing import Any

import pytest

from protocol.policy import TurnsPolicy
from tests.deploy.tools import COMPOSE_SECRETS, REDIS_IMAGE, ROOT, compose_args, compose_config, run_tool

LONG_RUNNING = ("redis", "commander", "worker", "relay")


def role_url(role: str) -> str:
    """A process's REDIS_URL: its ACL role's user and password (the samples of COMPOSE_SECRETS)."""
    return f"redis://fleet-{role}:{COMPOSE_SECRETS[f'FLEET_ACL_PASSWORD_{role.upper()}']}@redis:6379/0"


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return compose_config()


def published(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host ip, host port, container port) of each published port, from either form the tool
    prints: v1's "127.0.0.1:9464:9464/tcp" or v2's long form."""
    ports = []
    for p in service.get("ports", []):
        if isinstance(p, dict):
            ports.append((p.get("host_ip", ""), str(p.get("published", "")), str(p["target"])))
            continue
        m = re.fullmatch(r"(?:(\[?[\d.:a-f]*\]?):)?(\d+):(\d+)(?:/\w+)?", str(p))
        assert m, f"a port without a host address publishes on every interface: {p}"
        ports.append((m[1] or "", m[2], m[3]))
    return ports


def volumes(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each mount, from "name:/path[:rw]" or the long form."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out.append((v["source"], v["target"]))
        else:
            source, target = str(v).split(":")[:2]
            out.append((source, target))
    return out


def test_redis_keeps_an_append_only_file_on_a_named_volume(config: dict[str, Any]) -> None:
    redis = config["services"]["redis"]
    assert redis["image"] == REDIS_IMAGE
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--appendfsync always" in command
    assert volumes(redis) == [("redis-data", "/data"), ("redis-acl", "/acl")]
    assert "redis-data" in config["volumes"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]  # exits 0 on NOAUTH too
    assert "ports" not in redis, "Redis is reached by the services, not published"


def test_the_commander_runs_the_process_runtime_behind_loopback(config: dict[str, Any]) -> None:
    commander = config["services"]["commander"]
    assert commander["command"] == ["commander"]
    env = commander["environment"]
    assert env["REDIS_URL"] == role_url("commander")
    assert env["FLEET_COMMANDER_WORKER_REDIS_URL"] == role_url("worker")  # the workers it starts
    assert env["FLEET_COMMANDER_RUNTIME"] == "process"
    assert env["FLEET_COMMANDER_METRICS_HOST"] == "0.0.0.0"
    assert env["FLEET_COMMANDER_METRICS_PORT"] == "9464"
    assert published(commander) == [("127.0.0.1", "9464", "9464")]
    assert commander["depends_on"]["redis"]["condition"] == "service_healthy"
    assert commander["depends_on"]["policy"]["condition"] == "service_completed_successfully"
    assert commander["init"] is True, "a PID 1 that reaps the workers the commander forks"
    assert "/healthz" in " ".join(commander["healthcheck"]["test"])


def test_nothing_is_published_beyond_loopback(config: dict[str, Any]) -> None:
    for name, service in config["services"].items():
        for host, _, _ in published(service):
            assert host == "127.0.0.1", f"{name} publishes on {host or 'every interface'}"


def test_every_long_running_service_has_a_health_check(config: dict[str, Any]) -> None:
    for name in LONG_RUNNING:
        check = config["services"][name]["healthcheck"]
        assert check["test"][0] == "CMD" and check.get("disable") is not True, name


def test_fixed_workers_are_optional_and_drain_in_time(config: dict[str, Any]) -> None:
    """The worker service starts only with its profile; like the commander it gets the policy's
    default drain_timeout_s plus a margin before docker kills it."""
    worker = config["services"]["worker"]
    assert worker["profiles"] == ["workers"]
    assert worker["command"] == ["worker", "--tier", "chat"]
    assert worker["environment"]["REDIS_URL"] == role_url("worker")
    assert "/livez" in " ".join(worker["healthcheck"]["test"])
    assert worker["restart"] == "on-failure", "a worker the commander retired stays retired"
    for name in ("commander", "worker"):
        grace = config["services"][name]["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) >= TurnsPolicy().controls.drain_timeout_s + 10, name


def test_the_relay_is_optional_and_restarts(config: dict[str, Any]) -> None:
    """The relay of deferred jobs starts only with its profile, on the same Redis."""
    relay = config["services"]["relay"]
    assert relay["profiles"] == ["jobs"] and relay["command"] == ["relay"]
    assert relay["environment"]["REDIS_URL"] == role_url("relay")
    assert relay["restart"] == "unless-stopped" and relay["init"] is True
    assert not relay.get("ports"), "the relay serves nothing"
    # its health: this container's relay beat within the bound (fleet relay --check)
    assert relay["healthcheck"]["test"] == ["CMD", "fleet", "relay", "--check", "--max-age", "30"]


def test_the_install_one_shot_loads_the_library_as_admin_before_the_policy(config: dict[str, Any]) -> None:
    """Loading Fleet's functions is the one thing no role may do: a one-shot of its own, the only
    service with the admin's URL, before the policy one-shot (which runs as the operator)."""
    install = config["services"]["install"]
    assert install["command"] == ["install"] and install["restart"] == "no"
    assert install["environment"]["REDIS_URL"] == (
        f"redis://default:{COMPOSE_SECRETS['FLEET_ACL_PASSWORD_ADMIN']}@redis:6379/0")
    assert install["depends_on"]["redis"]["condition"] == "service_healthy"
    policy = config["services"]["policy"]
    assert policy["depends_on"]["install"]["condition"] == "service_completed_successfully"
    assert policy["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = policy["command"]
    assert script.startswith("fleet policy get chat >/dev/null 2>&1 || fleet policy set chat ")
    assert policy["restart"] == "no"


def test_every_fleet_service_builds_the_one_image(config: dict[str, Any]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    fleet = {name: s for name, s in config["services"].items() if name != "redis"}
    assert set(fleet) == {"acl", "install", "policy", "commander", "worker", "cli", "relay"}
    for name, service in fleet.items():
        assert service["image"] == f"fleet:{version}", name
        assert service["build"]["context"] == str(ROOT), name
        assert service["build"].get("dockerfile", "Dockerfile") == "Dockerfile", name


# --- least privilege ----------------------------------------------------------------------
def test_redis_starts_with_the_acl_file_of_the_roles(config: dict[str, Any]) -> None:
    """A one-shot writes the file (`fleet acl --out`) from the required passwords, before Redis."""
    acl, redis = config["services"]["acl"], config["services"]["redis"]
    (script,) = acl["command"]
    assert script.startswith("fleet acl --out /acl/users.acl && ")
    assert volumes(acl) == [("redis-acl", "/acl")] and acl["network_mode"] == "none"
    assert {k: str(v) for k, v in acl["environment"].items()} == {
        k: v for k, v in COMPOSE_SECRETS.items() if k.startswith("FLEET_ACL_PASSWORD_")}
    assert "--aclfile /acl/users.acl" in " ".join(redis["command"])
    assert any(str(v).startswith("redis-acl:/acl:ro") or (isinstance(v, dict) and v.get("read_only"))
               for v in redis["volumes"]), redis["volumes"]
    assert redis["depends_on"]["acl"]["condition"] == "service_completed_successfully"


def test_each_process_connects_as_its_role(config: dict[str, Any]) -> None:
    """No shared URL, and the admin's only where no role may go (the ACL file, the library's
    install): each service's REDIS_URL names its role's user; the cli has the client's and the
    operator's passwords (each command connects as the role it needs)."""
    roles = {"commander": "commander", "worker": "worker", "relay": "relay", "policy": "operator"}
    for name, role in roles.items():
        assert config["services"][name]["environment"]["REDIS_URL"] == role_url(role), name
    cli = config["services"]["cli"]["environment"]
    assert cli["REDIS_URL"] == "redis://redis:6379/0"
    assert {k for k in cli if k.startswith("FLEET_ACL_PASSWORD_")} == {"FLEET_ACL_PASSWORD_CLIENT",
                                                                        "FLEET_ACL_PASSWORD_OPERATOR"}
    admin = COMPOSE_SECRETS["FLEET_ACL_PASSWORD_ADMIN"]
    for name, service in config["services"].items():
        if name not in ("acl", "install"):
            assert admin not in str(service.get("environment", {})), name


def test_the_monitor_is_behind_the_operator_token(config: dict[str, Any]) -> None:
    """0.0.0.0 in the container: the operator token is required (the commander refuses to start
    without one); the read token is optional, and the health check sends one of them."""
    env = config["services"]["commander"]["environment"]
    assert env["FLEET_COMMANDER_OPERATOR_TOKEN"] == COMPOSE_SECRETS["FLEET_COMMANDER_OPERATOR_TOKEN"]
    assert env["FLEET_COMMANDER_METRICS_TOKEN"] == ""  # unset: no read-only token
    check = " ".join(config["services"]["commander"]["healthcheck"]["test"])
    assert "FLEET_COMMANDER_OPERATOR_TOKEN" in check and "Bearer" in check


@pytest.mark.parametrize("missing", sorted(COMPOSE_SECRETS))
def test_compose_refuses_to_run_without_a_secret(missing: str) -> None:
    env = {k: v for k, v in COMPOSE_SECRETS.items() if k != missing}
    done = run_tool([*compose_args(), "config"], env=env)
    assert done.returncode != 0 and "docs/guide/containers.md" in done.stderr, (missing, done.stderr)
