"""A real browser for the tests: Debian's chromium, headless, driven by playwright-core through
``tests/browser/driver.mjs`` (one JSON command per line on its stdin, one answer per line).

What it needs is installed when missing: playwright-core from npm under
``.cache/monitor-browser/`` (ignored by git), chromium with apt-get. When that cannot be
done the test fails with the reason if ``CI`` is set, and is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ROOT / ".cache" / "monitor-browser"
DRIVER = ROOT / "tests" / "browser" / "driver.mjs"


def _unavailable(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the browser test cannot run: {why}")
    pytest.skip(why)


def _run(cmd: list[str], what: str) -> None:
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _unavailable(f"{what} failed: {exc}")
        return
    if done.returncode != 0:
        _unavailable(f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout)[-500:]}")
    print(f"{what}: done in {time.monotonic() - started:.0f} s")


def ensure_browser() -> tuple[str, str]:
    """(node, chromium) with playwright-core installed; installs what is missing."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        _unavailable("node and npm are not installed (apt-get install nodejs npm)")
    if not shutil.which("chromium"):
        if not shutil.which("apt-get") or os.geteuid() != 0:
            _unavailable("chromium is not installed and apt-get cannot run here (apt-get install chromium)")
        _run(["apt-get", "install", "-y", "-q", "chromium"], "apt-get install chromium")
    chromium = shutil.which("chromium")
    if not chromium:
        _unavailable("chromium is still not on the PATH after apt-get install chromium")
    if not (MODULES / "node_modules" / "playwright-core" / "package.json").exists():
        MODULES.mkdir(parents=True, exist_ok=True)
        _run([str(npm), "install", "--prefix", str(MODULES), "--no-audit", "--no-fund", "playwright-core@1"],
             "npm install playwright-core")
    assert node and chromium
    return node, chromium


class Browser:
    """The node driver: one JSON command per line, one answer per line."""

    def __init__(self, node: str, chromium: str, log: Path) -> None:
        env = dict(os.environ, FLEET_BROWSER_MODULES=str(MODULES), CHROMIUM=chromium)
        self.log = log.open("w")
        self.proc = subprocess.Popen([node, str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        hello = self._read()
        assert hello.get("ready"), hello

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            pytest.fail(f"the browser driver exited: {Path(self.log.name).read_text()[-2000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def __call__(self, cmd: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        assert answer["ok"], f"{cmd} {args}: {answer.get('error')}"
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.log.close()
