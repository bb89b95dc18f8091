"""One fork template per interpreter, and the check that a group's interpreter can run its handler.

A group of a tier may run in its own virtualenv (``Group.python``): its workers are forked from
a template started by that interpreter, never from the commander's. Before a group's first
worker starts, :meth:`Interpreters.check` runs the interpreter once (``python -c``: import the
worker and load the handler by name). A missing interpreter, or one that cannot import Fleet or
the handler, is refused with the reason (:class:`GroupRejected`); the verdict is kept for
``recheck_s``, so a fixed virtualenv is found again without a restart.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from commander.runtime.process.fork_client import TemplateSpawner
from commander.runtime.process.launch import SpawnError

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 60.0
_CHECK = ("import sys\nfrom worker import handlers\n"
          "handlers.get(sys.argv[1])\nprint('ok')\n")


class GroupRejected(SpawnError):
    """A group's workers cannot start: its interpreter is missing or cannot load its handler."""


Runner = Callable[[list[str], Mapping[str, str]], tuple[int, str]]  # argv, env -> (code, output)


def run_check(argv: list[str], env: Mapping[str, str]) -> tuple[int, str]:
    """Run ``argv`` to its end (bounded); its exit code and last output line."""
    try:
        done = subprocess.run(argv, env=dict(env), stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=CHECK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"no answer in {CHECK_TIMEOUT_S:.0f}s"
    except OSError as exc:
        return 127, f"{type(exc).__name__}: {exc}"
    lines = (done.stderr or done.stdout).strip().splitlines()
    return done.returncode, lines[-1][:300] if lines else ""


class Interpreters:
    """The templates (one per interpreter path) and the checks of the groups' interpreters."""

    def __init__(self, default: TemplateSpawner | None, env: Mapping[str, str], log_dir: Path,
                 *, fork: bool = True, runner: Runner = run_check, recheck_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.default, self.env, self.log_dir, self.fork = default, dict(env), log_dir, fork
        self.runner, self.recheck_s, self.clock = runner, recheck_s, clock
        self._templates: dict[str, TemplateSpawner] = {}
        self._verdicts: dict[tuple[str, str], tuple[str | None, float]] = {}

    def check(self, python: str, handler: str) -> str | None:
        """Why ``python`` cannot run workers of ``handler`` (None: it can). Cached for ``recheck_s``."""
        key = (python, handler)
        cached = self._verdicts.get(key)
        if cached is not None and self.clock() - cached[1] < self.recheck_s:
            return cached[0]
        why = self._probe(python, handler)
        self._verdicts[key] = (why, self.clock())
        if why:
            log.warning("interpreter %s cannot run handler %r: %s", python, handler, why)
        return why

    def _probe(self, python: str, handler: str) -> str | None:
        if not os.path.isfile(python) or not os.access(python, os.X_OK):
            return f"interpreter {python} is missing or not executable"
        code, out = self.runner([python, "-c", _CHECK, handler], self.env)
        if code != 0 or out != "ok":
            return f"interpreter {python} cannot load handler {handler!r} (exit {code}): {out}"
        return None

    def template(self, python: str | None) -> TemplateSpawner | None:
        """The fork template of ``python`` (None: the commander's own), started on first use;
        None when workers are not forked."""
        if python is None or python == sys.executable:
            return self.default
        if not self.fork:
            return None
        spawner = self._templates.get(python)
        if spawner is None:
            spawner = self._templates[python] = TemplateSpawner(self.env, self.log_dir, python=python,
                                                                exec_python=python)
            spawner.start(wait=False)
        return spawner

    def close(self) -> None:
        """Stop every group's template (their workers run on)."""
        for spawner in self._templates.values():
            spawner.close()
        self._templates.clear()
