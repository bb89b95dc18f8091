"""The fork template's client: how the process runtime asks a fork template for workers.

A fork template (``launch.FORK_TEMPLATE_MODULE``) is a pre-imported worker interpreter that
forks workers, so a new one serves within ~100 ms, not the ~350-500 ms a fresh interpreter
spends importing. ``TemplateSpawner`` starts it on one end of a ``SOCK_SEQPACKET`` pair and
sends it spawn requests (the wire format is ``protocol/fork_wire.py``); if the template cannot
start or dies, workers start as fresh interpreters instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from commander.runtime.process.launch import SpawnError, fork_template_command, start_fresh, worker_command
from protocol.fork_wire import MAX_EXITS, MAX_MSG, Message

log = logging.getLogger(__name__)


class TemplateError(RuntimeError):
    """The template did not answer a request, or is gone."""


class TemplateDied(TemplateError):
    """The template exited while a request was under way."""


@dataclass(frozen=True)
class Spawned:
    """A started worker: forked by the template, or a fresh interpreter (``popen`` set)."""

    pid: int
    popen: subprocess.Popen[bytes] | None = None

    @property
    def forked(self) -> bool:
        return self.popen is None


class TemplateSpawner:
    """Starts and talks to one template; forks workers through it, or execs them if it must.

    A template that died is started again by the next ``spawn``. One that cannot start (or
    stops answering) is given up for ``retry_after_s``, with a warning; meanwhile workers
    start as fresh interpreters. Thread-safe: one lock around the socket.
    """

    def __init__(self, env: Mapping[str, str] | None = None, log_dir: Path | str = Path(".fleet/logs"),
                 *, python: str = sys.executable, start_timeout_s: float = 30.0,
                 request_timeout_s: float = 5.0, retry_after_s: float = 30.0,
                 exec_python: str | None = None) -> None:
        """``exec_python``: the interpreter of the fresh workers started when the template cannot
        fork (a group's virtualenv); this one's by default."""
        self.env = dict(os.environ if env is None else env)
        self.log_dir = Path(log_dir).resolve()
        self.python, self.exec_python = python, exec_python
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self.retry_after_s = retry_after_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._eof = False  # the template closed its socket: it is exiting
        self._retry_at = 0.0
        self._next_id = 0
        self._exits: dict[int, int] = {}
        self._owner: dict[int, int] = {}  # forked pid -> pid of the template that forked it
        self._lock = threading.RLock()

    @property
    def pid(self) -> int | None:
        """The running template's pid (None if there is none)."""
        with self._lock:
            if not self._running():
                return None
            assert self._proc is not None  # _running() is False without one
            return self._proc.pid

    # --- lifecycle ---------------------------------------------------------------------
    def start(self, wait: bool = True) -> bool:
        """Start the template unless it runs; with ``wait``, until it is ready. False: unusable."""
        with self._lock:
            if not self._running():
                if time.monotonic() < self._retry_at:
                    return False
                try:
                    self._launch()
                except (OSError, SpawnError) as exc:
                    self._give_up(str(exc))
                    return False
            return self._await_ready() if wait else True

    def close(self) -> None:
        """Stop the template (the next ``spawn`` starts another); forked workers run on."""
        with self._lock:
            self._shutdown()
            self._retry_at = 0.0

    def _launch(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = fork_template_command(self.python, theirs.fileno())
            with open(self.log_dir / "template.log", "ab") as out:
                self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, env=self.env,
                                              pass_fds=[theirs.fileno()], start_new_session=True)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock, self._ready, self._eof = ours, False, False
        log.info("fork template starting (pid %d)", self._proc.pid)

    def _await_ready(self) -> bool:
        if self._ready:
            return True
        began = time.monotonic()
        try:
            self._receive(lambda m: "ready" in m, self.start_timeout_s)
        except TemplateError as exc:
            self._give_up(f"not ready: {exc}")
            return False
        self._ready = True
        log.info("fork template ready (pid %d) in %.0f ms", self.pid, (time.monotonic() - began) * 1e3)
        return True

    def _running(self) -> bool:
        """Whether a template process runs; one that died is noted and cleaned up."""
        if self._proc is None:
            return False
        code = self._proc.poll()
        if code is None and self._sock is not None and not self._eof:
            return True
        if self._ready:
            log.warning("fork template (pid %d) exited with code %s: starting another",
                        self._proc.pid, code)
        self._shutdown()
        return False

    def _give_up(self, reason: str) -> None:
        log.warning("fork template unavailable (%s): workers start as fresh interpreters "
                    "(slower); trying again in %.0fs", reason, self.retry_after_s)
        self._shutdown()
        self._retry_at = time.monotonic() + self.retry_after_s

    def _shutdown(self) -> None:
        proc, sock = self._proc, self._sock
        self._proc, self._sock, self._ready = None, None, False
        if sock is not None:
            with contextlib.suppress(OSError, TemplateError, ValueError):
                self._pump(sock)  # keep the exit codes already sent
            sock.close()  # EOF: the template exits on its own
        if proc is None:
            return
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    # --- spawning ----------------------------------------------------------------------
    def spawn(self, tier: str, worker_id: str, env: Mapping[str, str] | None = None,
              log_path: Path | str | None = None) -> Spawned:
        """Start one worker, forked if the template is usable, else as a fresh interpreter.

        ``env`` is the worker's whole environment (default: the template's); only what
        differs is sent. Raises ``SpawnError`` only if the fresh interpreter cannot start.
        """
        path = Path(log_path) if log_path else self.log_dir / f"{worker_id}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        full_env = dict(self.env if env is None else env)
        with self._lock:
            for _ in range(2):  # a template found dead by the request is started once more
                if not self.start(wait=True):
                    break
                try:
                    return Spawned(self._fork(tier, worker_id, full_env, path))
                except TemplateDied:
                    continue
                except TemplateError as exc:
                    log.warning("fork of %s failed (%s): starting a fresh interpreter", worker_id, exc)
                    break
        popen = start_fresh(worker_command(tier, worker_id, self.exec_python), full_env, path)
        return Spawned(popen.pid, popen)

    def _fork(self, tier: str, worker_id: str, env: dict[str, str], log_path: Path) -> int:
        assert self._sock is not None and self._proc is not None
        self._next_id += 1
        rid = self._next_id
        request = {"id": rid, "tier": tier, "worker_id": worker_id, "log": str(log_path),
                   "cwd": os.getcwd(), "set": {k: v for k, v in env.items() if self.env.get(k) != v},
                   "unset": [k for k in self.env if k not in env]}
        try:
            self._sock.send(json.dumps(request).encode())
            reply = self._receive(lambda m: m.get("id") == rid, self.request_timeout_s)
        except (OSError, TemplateError) as exc:
            if not self._running():  # it died under the request (noted): another one may do
                raise TemplateDied(str(exc)) from exc
            self._give_up(f"no answer to a spawn request: {exc}")
            raise TemplateError(str(exc)) from exc
        if "error" in reply:
            raise TemplateError(str(reply["error"]))
        pid = int(reply["pid"])
        self._owner[pid] = self._proc.pid
        return pid

    # --- exit codes --------------------------------------------------------------------
    def exit_code(self, pid: int, wait_s: float = 0.0) -> int | None:
        """The exit code of a forked worker once the template reaped it, else None.

        ``wait_s``: how long to wait for it if the worker's template still runs (a worker
        seen gone may not be reported yet). Each code is returned once.
        """
        with self._lock:
            self._pump_quietly()
            if pid not in self._exits and wait_s > 0 and self._owns(pid):
                with contextlib.suppress(TemplateError):
                    self._receive(lambda m: m.get("exit") == pid, wait_s)
            code = self._exits.pop(pid, None)
            if code is not None:
                self._owner.pop(pid, None)
            return code

    def _owns(self, pid: int) -> bool:
        return self._running() and self._proc is not None and self._owner.get(pid) == self._proc.pid

    def _pump_quietly(self) -> None:
        if self._sock is not None:
            try:
                self._pump(self._sock)
            except (OSError, TemplateError):
                self._running()  # notes a dead template

    def _receive(self, match: Callable[[Message], bool], timeout: float) -> Message:
        """The first message that ``match``es, keeping exit codes seen on the way."""
        deadline = time.monotonic() + timeout
        while True:
            if self._sock is None:
                raise TemplateError("the template is gone")
            for msg in self._pump(self._sock):
                if match(msg):
                    return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise TemplateError(f"no answer within {timeout:g}s")
            select.select([self._sock], [], [], left)

    def _pump(self, sock: socket.socket) -> list[Message]:
        """Every message already received (exit codes recorded); TemplateError on EOF."""
        got: list[Message] = []
        while True:
            try:
                data = sock.recv(MAX_MSG, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return got
            if not data:
                self._eof = True
                code = self._proc.poll() if self._proc is not None else None
                raise TemplateError(f"the template closed its socket (exit code {code})")
            msg = json.loads(data)
            if "ready" in msg:
                self._ready = True  # whoever reads it: ``_await_ready`` then need not
            if "exit" in msg:
                self._exits[int(msg["exit"])] = int(msg["code"])
                while len(self._exits) > MAX_EXITS:
                    self._exits.pop(next(iter(self._exits)))
            got.append(msg)

