"""One fork template per interpreter, and the check that a group's interpreter can run its handler.

A group of a tier may run in its own virtualenv (an interpreter the commander's
``group_runtimes`` allows, named by the group's ``runtime``): its workers are forked from a
template started by that interpreter, never from the commander's. Before a group's first worker
starts, the interpreter is run once (``python -c``: import the worker and load the handler by
name). A missing interpreter, or one that cannot import Fleet or the handler, is refused with
the reason (:class:`GroupRejected`); the verdict is kept for ``recheck_s``, so a fixed
virtualenv is found again without a restart.

The check runs on a thread of its own, never in the commander's pass: :meth:`Interpreters.check`
answers at once from the last verdict (:data:`PENDING` before the first). It reads at most
:data:`OUTPUT_LIMIT` bytes of the interpreter's output and kills it (its whole process group) past
the limit or the timeout, which the commander keeps shorter than its leader lease: a binary that
writes forever or never answers costs a thread for that long, not the commander's memory or pass.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Final

from commander.runtime.interface import CHECK_PENDING
from commander.runtime.process.fork_client import TemplateSpawner
from commander.runtime.process.launch import SpawnError

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 2.4  # the default: shorter than the default leader lease (3 s)
OUTPUT_LIMIT = 4096  # bytes of a check's output read, at most
PENDING: Final = CHECK_PENDING
_CHECK = ("import sys\nfrom worker import handlers\n"
          "handlers.get(sys.argv[1])\nprint('ok')\n")


class GroupRejected(SpawnError):
    """A group's workers cannot start: its interpreter is missing or cannot load its handler."""


Runner = Callable[[list[str], Mapping[str, str], float], tuple[int, str]]  # argv, env, timeout -> code, out


def run_check(argv: list[str], env: Mapping[str, str], timeout_s: float) -> tuple[int, str]:
    """Run ``argv`` in a session of its own for at most ``timeout_s``, reading at most
    :data:`OUTPUT_LIMIT` bytes of its output; its exit code and last output line. Past either
    bound its process group is killed (code 124: the time, 125: the output)."""
    try:
        proc = subprocess.Popen(argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        return 127, f"{type(exc).__name__}: {exc}"
    assert proc.stdout is not None  # (stdout=PIPE)
    try:
        code, out = _read_bounded(proc, proc.stdout.fileno(), time.monotonic() + timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # (a session of its own: its pgid is its pid)
        proc.stdout.close()
        proc.wait()
    if code == 124:
        return code, f"no answer in {timeout_s:g}s"
    if code == 125:
        return code, f"more than {OUTPUT_LIMIT} bytes of output"
    lines = out.decode(errors="replace").strip().splitlines()
    return code, lines[-1][:300] if lines else ""


def _read_bounded(proc: subprocess.Popen[bytes], fd: int, deadline: float) -> tuple[int, bytes]:
    """(exit code, output) of ``proc``; (124, b"") past ``deadline``, (125, b"") past the limit."""
    out = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return 124, b""
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, OUTPUT_LIMIT + 1 - len(out))
        if not chunk:
            break
        out += chunk
        if len(out) > OUTPUT_LIMIT:
            return 125, b""
    try:
        return proc.wait(max(0.0, deadline - time.monotonic())), bytes(out)
    except subprocess.TimeoutExpired:  # its output closed, but it runs on
        return 124, b""


class Interpreters:
    """The templates (one per interpreter path) and the checks of the groups' interpreters."""

    def __init__(self, default: TemplateSpawner | None, env: Mapping[str, str], log_dir: Path,
                 *, fork: bool = True, check_env: Mapping[str, str] | None = None,
                 runner: Runner = run_check, recheck_s: float = 30.0, timeout_s: float = CHECK_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``env``: the templates' environment; ``check_env``: the checks' (default: ``env``);
        ``timeout_s``: how long a check may run."""
        self.default, self.env, self.log_dir, self.fork = default, dict(env), log_dir, fork
        self.check_env = dict(env if check_env is None else check_env)
        self.runner, self.recheck_s, self.timeout_s, self.clock = runner, recheck_s, timeout_s, clock
        self._templates: dict[str, TemplateSpawner] = {}
        self._verdicts: dict[tuple[str, str], tuple[str | None, float]] = {}
        self._running: dict[tuple[str, str], Future[str | None]] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="interpreter-check")

    def check(self, python: str, handler: str) -> str | None:
        """Why ``python`` cannot run workers of ``handler`` (None: it can; :data:`PENDING`: not
        known yet). Never waits: a check older than ``recheck_s`` is started again in the
        background, and the last verdict holds until it ends."""
        key = (python, handler)
        self._collect(key)
        cached = self._verdicts.get(key)
        if key not in self._running and (cached is None or self.clock() - cached[1] >= self.recheck_s):
            self._running[key] = self._pool.submit(self._probe, python, handler)
        return PENDING if cached is None else cached[0]

    def _collect(self, key: tuple[str, str]) -> None:
        """Take the verdict of ``key``'s finished check, if one is."""
        future = self._running.get(key)
        if future is None or not future.done():
            return
        del self._running[key]
        try:
            why = future.result()
        except Exception as exc:  # noqa: BLE001 - the check's own failure is its verdict
            why = f"interpreter {key[0]} could not be checked: {type(exc).__name__}: {exc}"
        if why and why != (self._verdicts.get(key) or (None, 0.0))[0]:
            log.warning("interpreter %s cannot run handler %r: %s", key[0], key[1], why)
        self._verdicts[key] = (why, self.clock())

    def _probe(self, python: str, handler: str) -> str | None:
        if not os.path.isfile(python) or not os.access(python, os.X_OK):
            return f"interpreter {python} is missing or not executable"
        code, out = self.runner([python, "-c", _CHECK, handler], self.check_env, self.timeout_s)
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
        """Stop every group's template (their workers run on) and the checks not started yet."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for spawner in self._templates.values():
            spawner.close()
        self._templates.clear()
