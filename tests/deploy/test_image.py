"""The container image, checked without a Docker engine:

- the Dockerfile's structure (dockerfile-parse): a pinned slim Python base, a numeric non-root
  USER, `fleet` behind tini as the exec-form ENTRYPOINT, no ADD, no secret baked in; and hadolint's rules;
- the build context .dockerignore leaves: everything the package is built from (the Lua scripts
  and the monitor's static files included), and none of .venv, .git, .fleet, tests, caches;
- that context builds: `pip wheel` of exactly those files, as the Dockerfile's build stage runs
  it, gives a wheel whose `fleet` entry point runs from a fresh install with its package data.

What is not checked here: that the base image tag exists and its wheels resolve (that needs the
registries at build time), and the image's run (it needs an engine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from docker.utils.build import exclude_paths
from dockerfile_parse import DockerfileParser

from tests.deploy.tools import ROOT, hadolint

DOCKERFILE = ROOT / "Dockerfile"
PACKAGES = ("protocol", "stores", "worker", "commander", "fleet", "sim")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|CREDENTIAL|REDIS_URL|PRIVATE", re.I)


def instructions(kind: str) -> list[dict[str, Any]]:
    return [i for i in DockerfileParser(str(DOCKERFILE)).structure if i["instruction"] == kind]


def final_stage() -> list[dict[str, Any]]:
    structure = DockerfileParser(str(DOCKERFILE)).structure
    last_from = max(n for n, i in enumerate(structure) if i["instruction"] == "FROM")
    return structure[last_from:]


def context_files(root: Path) -> set[str]:
    """The files `docker build root` sends, by .dockerignore's rules (docker-py's matcher, the
    one docker-compose v1 builds with)."""
    patterns = [line.strip() for line in (root / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    return {p for p in exclude_paths(str(root), patterns) if (root / p).is_file()}


def tracked(*paths: str) -> set[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True,
                         check=True).stdout.decode()
    return {p for p in out.split("\0") if p and (ROOT / p).is_file()}


# --- the Dockerfile -----------------------------------------------------------------------

def test_the_base_is_a_pinned_slim_python_that_fleet_supports() -> None:
    parser = DockerfileParser(str(DOCKERFILE))
    bases = parser.parent_images
    assert len(bases) == 2 and len(set(bases)) == 1, bases
    m = re.fullmatch(r"python:(3)\.(\d+)\.(\d+)-slim-(bookworm|trixie)", bases[0])
    assert m, f"{bases[0]}: the official slim image, pinned to a patch release"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11" and int(m[2]) >= 11


def test_the_image_runs_fleet_as_a_numeric_unprivileged_user() -> None:
    stage = final_stage()
    users = [i["value"] for i in stage if i["instruction"] == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or int(gid) > 0), users[-1]
    after_user = stage[max(n for n, i in enumerate(stage) if i["instruction"] == "USER"):]
    assert not [i for i in after_user if i["instruction"] == "RUN"], "nothing runs after USER"
    (entrypoint,) = [i["value"] for i in stage if i["instruction"] == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["tini", "--", "fleet"]  # tini as PID 1 (the Dockerfile says why)
    (cmd,) = [i["value"] for i in stage if i["instruction"] == "CMD"]
    assert json.loads(cmd) == ["commander"]
    (expose,) = [i["value"] for i in stage if i["instruction"] == "EXPOSE"]
    assert set(expose.split()) == {"9464", "8081"}


def test_the_image_keeps_the_commanders_loopback_default() -> None:
    """The monitor binds every interface only where a deployment also gives it its tokens (the
    compose file, the manifests): the image sets no address, so a bare `docker run` serves
    loopback (and the commander refuses 0.0.0.0 without a token)."""
    for i in instructions("ENV"):
        assert "FLEET_COMMANDER_METRICS_HOST" not in i["value"], i["value"]


def test_the_image_installs_the_project_and_bakes_in_no_secret() -> None:
    assert not instructions("ADD"), "COPY only: ADD fetches URLs and unpacks archives"
    runs = " ".join(i["value"] for i in instructions("RUN"))
    # the rq extra: the relay and the RQ workers of rq tiers run from this image too
    assert 'pip wheel --wheel-dir /wheels ".[k8s,rq]"' in runs
    assert 'pip install --no-index --find-links=/wheels "fleet[k8s,rq]"' in runs
    assert not re.search(r"\b(curl|wget)\b", runs), "nothing is downloaded but through pip"
    for kind in ("ENV", "ARG", "LABEL"):
        for i in instructions(kind):
            names = re.findall(r"(?:^|\s)([A-Za-z_.][\w.]*)=", i["value"])
            assert not [n for n in names if SECRET_NAME.search(n)], i["value"]


def test_hadolint_finds_nothing() -> None:
    done = subprocess.run([hadolint(), "--format", "json", str(DOCKERFILE)], capture_output=True,
                          text=True, timeout=60)
    findings = json.loads(done.stdout or "[]")
    assert not findings, "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)
    assert done.returncode == 0, done.stderr


# --- the build context --------------------------------------------------------------------

def test_the_context_holds_what_the_package_is_built_from() -> None:
    sent = context_files(ROOT)
    needed = tracked("pyproject.toml", "README.md", "LICENSE", *PACKAGES)
    assert needed - sent == set(), "left out of the image's build"
    for data in ("stores/lua", "commander/monitor/static"):
        assert {p for p in sent if p.startswith(data + "/")} == tracked(data)
    assert sent - needed <= {"Dockerfile", ".dockerignore"}, sorted(sent - needed)[:20]


def test_the_context_leaves_out_environments_state_and_caches(tmp_path: Path) -> None:
    """Decoys of what a working copy holds, beside a package file, against the same rules."""
    shutil.copy(ROOT / ".dockerignore", tmp_path)
    keep = ["pyproject.toml", "README.md", "LICENSE", "stores/lua/x.lua", "commander/monitor/static/app.js",
            "sim/scaling/trace.py"]
    decoys = [".venv/bin/python", ".git/config", ".fleet/state.json", ".fleet/logs/w.log",
              ".cache/monitor-browser/x", "tests/unit/test_x.py", "docs/BENCHMARKS.md", "scripts/demo",
              ".ci/run", "build/lib/fleet/cli.py", "dist/fleet.whl", "fleet.egg-info/PKG-INFO",
              "commander/__pycache__/x.cpython-311.pyc", "stores/x.pyc", ".env", "redis.conf",
              ".explore/fail-1.json", ".hypothesis/x", "commander/.mypy_cache/x", "dump.rdb"]
    for path in keep + decoys:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    sent = context_files(tmp_path)
    assert sent - {".dockerignore"} == set(keep)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip wheel` builds from exactly the build context (the Dockerfile's build
    stage, without the dependencies: those come from the registry at build time)."""
    context = tmp_path_factory.mktemp("context")
    for path in context_files(ROOT):
        (context / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, context / path)
    dist = tmp_path_factory.mktemp("dist")
    # the build backend pyproject.toml names comes from the test extra, not from the network
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(dist), str(context)], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr
    (built,) = dist.glob("fleet-*.whl")
    return built


def test_the_wheel_carries_the_entry_point_and_the_package_data(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = z.read(info).decode()
        metadata = z.read(info.replace("entry_points.txt", "METADATA")).decode()
    assert re.search(r"^\[console_scripts\]\s*\nfleet = fleet\.cli:main$", entry_points, re.M)
    for path in tracked("stores/lua", "commander/monitor/static"):
        assert path in names, f"{path} is not in the wheel"
    assert {n.split("/")[0] for n in names if n.endswith(".py")} == set(PACKAGES)
    extras = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.M))
    assert {"k8s", "rq"} <= extras
    assert re.search(r"^Requires-Dist: kubernetes\b.*extra == \"k8s\"", metadata, re.M)
    assert re.search(r"^Requires-Dist: rq\b.*extra == \"rq\"", metadata, re.M)


def test_the_installed_wheel_runs_fleet(wheel: Path, tmp_path: Path) -> None:
    """Installed apart (not the checkout's editable install), the console script starts and the
    package finds its data files."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                    "--target", str(site), str(wheel)], check=True, capture_output=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([str(site / "bin" / "fleet"), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "commander" in done.stdout and "worker" in done.stdout
    probe = ("import stores, commander.monitor.server as s, pathlib; print(stores.__file__); "
             "print(len(list(pathlib.Path(stores.__file__).parent.glob('lua/**/*.lua')))); "
             "print(s.STATIC.joinpath('index.html').is_file())")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout.split()
    assert out[0].startswith(str(site)), "imported from the checkout, not from the wheel"
    assert int(out[1]) == len(tracked("stores/lua")) and out[2] == "True"
