"""compose/docker-compose.yml, as `docker compose config` (or Debian's docker-compose) parses
and normalizes it: the tool validates it against the compose schema, and the tests check what
the file promises: Redis with its append-only file on a named volume, the commander with the
process runtime behind 127.0.0.1 only, health checks on every long-running service, the order
of start. No container is started (no Docker engine runs here)."""

from __future__ import annotations

import re
import tomllib
from typing import Any

import pytest

from protocol.policy import TurnsPolicy
from tests.deploy.tools import REDIS_IMAGE, ROOT, compose_config

LONG_RUNNING = ("redis", "commander", "worker", "relay")
REDIS_URL = "redis://redis:6379/0"


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
    assert volumes(redis) == [("redis-data", "/data")]
    assert "redis-data" in config["volumes"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert "ports" not in redis, "Redis is reached by the services, not published"


def test_the_commander_runs_the_process_runtime_behind_loopback(config: dict[str, Any]) -> None:
    commander = config["services"]["commander"]
    assert commander["command"] == ["commander"]
    env = commander["environment"]
    assert env["REDIS_URL"] == REDIS_URL
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
    assert worker["environment"]["REDIS_URL"] == REDIS_URL
    assert "/livez" in " ".join(worker["healthcheck"]["test"])
    assert worker["restart"] == "on-failure", "a worker the commander retired stays retired"
    for name in ("commander", "worker"):
        grace = config["services"][name]["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) >= TurnsPolicy().controls.drain_timeout_s + 10, name


def test_the_relay_is_optional_and_restarts(config: dict[str, Any]) -> None:
    """The relay of deferred jobs starts only with its profile, on the same Redis."""
    relay = config["services"]["relay"]
    assert relay["profiles"] == ["jobs"] and relay["command"] == ["relay"]
    assert relay["environment"]["REDIS_URL"] == REDIS_URL
    assert relay["restart"] == "unless-stopped" and relay["init"] is True
    assert not relay.get("ports"), "the relay serves nothing"
    # its health: this container's relay beat within the bound (fleet relay --check)
    assert relay["healthcheck"]["test"] == ["CMD", "fleet", "relay", "--check", "--max-age", "30"]


def test_the_one_shot_installs_the_library_and_keeps_an_existing_policy(config: dict[str, Any]) -> None:
    policy = config["services"]["policy"]
    assert policy["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = policy["command"]
    install, policy_set = script.split(" && ", 1)
    assert install == "fleet install"
    assert policy_set.startswith("(fleet policy get chat >/dev/null 2>&1 || fleet policy set chat ")
    assert policy["restart"] == "no"


def test_every_fleet_service_builds_the_one_image(config: dict[str, Any]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    fleet = {name: s for name, s in config["services"].items() if name != "redis"}
    assert set(fleet) == {"policy", "commander", "worker", "cli", "relay"}
    for name, service in fleet.items():
        assert service["image"] == f"fleet:{version}", name
        assert service["build"]["context"] == str(ROOT), name
        assert service["build"].get("dockerfile", "Dockerfile") == "Dockerfile", name
