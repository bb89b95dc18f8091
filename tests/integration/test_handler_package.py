"""The docs' handler package works as written: built from the docs' own blocks into a fresh
virtualenv with Fleet installed from this checkout, its test passes there and a real worker of
that virtualenv serves turns through it. ``fleet handler new`` writes exactly those files, and a
package it makes for another name serves as well.

The virtualenv is made offline (``tests.helpers.offline_venv``: it sees this environment's
dependencies, redis, pydantic, setuptools, pytest, ...), then this environment's pip installs into
it (``venv_install``) a copy of the checkout's tracked package files and the handler packages.
Nothing is imported from the checkout there: ``PYTHONPATH`` is unset and the working directory
is elsewhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from fleet.cli import main as fleet_main
from fleet.client import Fleet
from protocol import keys
from stores.registry import read_registry
from tests.conftest import ROOT, TEST_WORKER_ENV, RedisServer
from tests.docs_blocks import example_files
from tests.helpers import offline_venv, venv_install, wait_until

pytestmark = pytest.mark.integration
PACKAGES = ("protocol", "stores", "worker", "commander", "fleet", "sim")


@dataclass
class Venv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def env(self, **extra: str) -> dict[str, str]:
        """A child's environment: nothing of the checkout's, the virtualenv first on PATH."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "REDIS_URL", "COLUMNS", "LINES")
               and not k.startswith("FLEET_")}
        env.update(PATH=os.pathsep.join([str(self.bin), env.get("PATH", "/usr/bin:/bin")]),
                   VIRTUAL_ENV=str(self.root), PYTHONUNBUFFERED="1", **extra)
        return env


def checkout_copy(dest: Path) -> Path:
    """The checkout's package files (what a wheel is built from: tracked, or new and not
    ignored), copied to ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                             "pyproject.toml", "README.md", "LICENSE",
                             *PACKAGES], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("venv")
    venv_install(offline_venv(root), checkout_copy(tmp_path_factory.mktemp("checkout")))
    return Venv(root)


@pytest.fixture(scope="module")
def packages(venv: Venv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The docs' example (``mybot``) and a package ``fleet handler new`` made (``otherbot``),
    both installed into the virtualenv; handler name -> package directory."""
    docs = tmp_path_factory.mktemp("docs-example")
    files = example_files("handler")
    assert files, "the docs have no `snippet: file example=handler` blocks"
    for rel, text in files.items():
        (docs / rel).parent.mkdir(parents=True, exist_ok=True)
        (docs / rel).write_text(text)
    made = tmp_path_factory.mktemp("made")
    assert fleet_main(["handler", "new", "otherbot", "--dir", str(made / "otherbot")]) == 0
    out = {"mybot": docs / "mybot", "otherbot": made / "otherbot"}
    venv_install(venv.python, *out.values())
    return out


def test_fleet_handler_new_writes_exactly_the_docs_example(tmp_path: Path) -> None:
    assert fleet_main(["handler", "new", "mybot", "--dir", str(tmp_path / "mybot")]) == 0
    written = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    assert written == example_files("handler")


def test_the_virtualenv_runs_the_installed_fleet_not_the_checkout(venv: Venv, tmp_path: Path) -> None:
    probe = "import fleet, worker; print(fleet.__file__, worker.__file__)"
    done = subprocess.run([str(venv.python), "-c", probe], cwd=tmp_path, env=venv.env(),
                          capture_output=True, text=True, check=True)
    assert all(path.startswith(str(venv.root)) for path in done.stdout.split()), done.stdout


@pytest.mark.parametrize("name", ["mybot", "otherbot"])
def test_the_packages_own_test_passes_where_it_is_installed(venv: Venv, packages: dict[str, Path],
                                                           name: str) -> None:
    done = subprocess.run([str(venv.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=packages[name], env=venv.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


@pytest.fixture
def workers(venv: Venv, redis_server: RedisServer, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Worker processes of the virtualenv (``fleet worker``), each stopped by its pid."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # a drain
    for proc in started:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.mark.parametrize("name", ["mybot", "otherbot"])
def test_a_real_worker_serves_turns_through_the_package(
        venv: Venv, packages: dict[str, Path], redis_server: RedisServer, r: redis.Redis,
        workers: list[subprocess.Popen[bytes]], tmp_path: Path, name: str) -> None:
    env = venv.env(REDIS_URL=redis_server.url, FLEET_HOME=str(tmp_path / "home"), **TEST_WORKER_ENV)
    # the CLI of the virtualenv knows the handler by its name (it validates the policy with it)
    done = subprocess.run([str(venv.bin / "fleet"), "policy", "set", "bots", f"handler={name}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    wid = f"bots-{name}"
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        argv = [str(venv.bin / "fleet"), "worker", "--tier", "bots", "--worker-id", wid]
        workers.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT))
    wait_until(lambda: r.exists(keys.heartbeat(wid)) or workers[-1].poll() is not None, 30, "the worker")
    assert workers[-1].poll() is None, log.read_text()[-3000:]
    info, alive = read_registry(r).workers[wid]
    assert alive and name in info.handlers, info

    with Fleet(redis_server.role_url("fleet-client")) as client:
        first = client.submit("alice", "hello", tier="bots").result(timeout=30)
        second = client.submit("alice", "again", tier="bots").result(timeout=30)
    assert first.ok and first.worker == wid, first
    assert first.text == "you said: hello (0 earlier turns, 0 memories)", first
    assert second.ok and second.text == "you said: again (1 earlier turns, 1 memories)", second
    assert r.hget(keys.profile("alice"), "last_topic") == b"again"
