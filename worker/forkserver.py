"""The fork server (the "fork template"): a pre-imported worker interpreter that forks workers,
so the process runtime starts one fast.

A fresh ``python -m worker`` spends ~350-500 ms importing before it can register. The
fork server pays that once: it imports everything a worker touches, then waits on a Unix socket
with no asyncio loop, no thread and no Redis connection open, so ``fork()`` is safe. Each
forked child starts its own session, writes to its log file, takes the requested
environment and runs ``worker.__main__.main``; the server answers with the child's pid at
once, so a new worker can serve its first turn within ~100 ms of the decision.

The server reaps its children (SIGCHLD) and reports each exit code. It exits when its
parent closes the socket or dies; the workers, in their own sessions, run on.

The process runtime starts it (``commander/runtime/template.py``: ``TemplateSpawner``, the
client side) as ``python -m worker.forkserver --fd N``. Wire format (``protocol/template.py``):
one JSON object per ``SOCK_SEQPACKET`` message.
  server -> client: ``{"ready": pid}`` once; ``{"exit": pid, "code": n}`` per reaped child;
                      ``{"id": n, "pid": pid}`` or ``{"id": n, "error": "..."}`` per request.
  client -> server: ``{"id", "tier", "worker_id", "log", "cwd", "set": {}, "unset": []}``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import random
import select
import signal
import socket
import sys
import threading
import traceback
from collections import deque
from collections.abc import Mapping
from typing import NoReturn

from protocol.fork_wire import MAX_EXITS, MAX_MSG, Message


# --- the fork server process ---------------------------------------------------------------
def preload() -> None:
    """Import (and warm) everything a worker touches before it serves its first turn."""
    import email.feedparser  # noqa: F401  (imported lazily during a first turn)
    import email.parser  # noqa: F401
    import importlib.resources.readers  # noqa: F401

    import worker.__main__  # noqa: F401  (worker.app, redis.asyncio, pydantic models, stores)
    from stores import functions
    from worker import handlers

    handlers.registered_names()  # scan the entry points once, not once per worker
    functions.library()  # reads and assembles the Lua files


class ForkServer:
    """The serving loop: fork on request, reap on SIGCHLD, exit when the parent is gone."""

    def __init__(self, sock: socket.socket, parent: int) -> None:
        self.sock = sock
        self.parent = parent  # read before the imports: the parent may die during them
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        self.outbox: deque[bytes] = deque()
        self.closed = False

    def run(self) -> int:
        """Serve until the socket closes or the parent dies."""
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, _wake)  # a Python handler, so the wakeup fd is written
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
        self.post({"ready": os.getpid()})
        while not self.closed and os.getppid() == self.parent:
            watched: list[socket.socket | int] = [self.sock, self.wake_r]
            readable, _, _ = select.select(watched, [], [], 1.0)
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_r, 4096)
            self.reap()
            if self.sock in readable:
                self.serve_one()
            self.flush()
        return 0

    def serve_one(self) -> None:
        try:
            data = self.sock.recv(MAX_MSG)
        except OSError:
            data = b""
        if not data:  # the parent closed its end, or died
            self.closed = True
            return
        self.post(self.handle(data))

    def handle(self, data: bytes) -> Message:
        """Answer one spawn request with the child's pid, or the reason it failed."""
        try:
            req = json.loads(data)
            rid = req["id"]
            tier, worker_id, log_path = str(req["tier"]), str(req["worker_id"]), str(req["log"])
            env_set = {str(k): str(v) for k, v in dict(req.get("set") or {}).items()}
            env_unset = [str(k) for k in req.get("unset") or []]
        except (ValueError, KeyError, TypeError) as exc:
            return {"id": None, "error": f"bad request: {exc}"}
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would write the server's buffered output again
        try:
            pid = os.fork()
        except OSError as exc:
            return {"id": rid, "error": f"fork failed: {exc}"}
        if pid == 0:
            self._child(tier, worker_id, log_path, env_set, env_unset, req.get("cwd"))
        return {"id": rid, "pid": pid}

    def _child(self, tier: str, worker_id: str, log_path: str, env_set: dict[str, str],
               env_unset: list[str], cwd: str | None) -> NoReturn:
        code = 1
        try:
            os.setsid()  # first: a signal to the server's group must not reach the worker
            signal.set_wakeup_fd(-1)
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.sock.close()
            code = run_worker(tier, worker_id, log_path, env_set, env_unset, cwd)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)  # never back into the server's loop, never its atexit hooks

    def reap(self) -> None:
        """Collect every exited child and report its exit code."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.post({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def post(self, msg: Message) -> None:
        self.outbox.append(json.dumps(msg).encode())
        while len(self.outbox) > MAX_EXITS:
            self.outbox.popleft()
        self.flush()

    def flush(self) -> None:
        """Send what is queued without blocking (a slow reader must not stall the forks)."""
        while self.outbox and not self.closed:
            try:
                self.sock.send(self.outbox[0], socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                self.closed = True
                return
            self.outbox.popleft()


def _wake(signum: int, frame: object) -> None:
    """SIGCHLD: nothing to do here; the wakeup fd wakes the loop, which reaps."""


def run_worker(tier: str, worker_id: str, log_path: str, env_set: Mapping[str, str],
               env_unset: list[str], cwd: str | None) -> int:
    """In the forked child: become a worker as ``python -m worker`` would have, and run it."""
    _redirect(log_path)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for key in env_unset:
        os.environ.pop(key, None)
    os.environ.update(env_set)
    if cwd:
        with contextlib.suppress(OSError):
            os.chdir(cwd)
    random.seed()  # never the server's (or a sibling's) sequence

    from worker.__main__ import main

    argv = ["--tier", tier, "--worker-id", worker_id]
    sys.argv = ["worker", *argv]
    return main(argv)


def _redirect(log_path: str) -> None:
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.forkserver --fd N``: serve spawn requests on socket ``N``."""
    p = argparse.ArgumentParser(prog="python -m worker.forkserver", description=__doc__)
    p.add_argument("--fd", type=int, required=True, help="the inherited SOCK_SEQPACKET socket")
    args = p.parse_args(argv)
    sock, parent = socket.socket(fileno=args.fd), os.getppid()
    preload()
    if threading.active_count() != 1:
        print(f"fork server: {threading.active_count()} threads after imports: fork is unsafe",
              file=sys.stderr)
        return 3
    gc.collect()
    gc.freeze()  # shared pages stay shared: the children's collector leaves them alone
    return ForkServer(sock, parent).run()


if __name__ == "__main__":
    sys.exit(main())
