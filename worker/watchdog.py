"""The watchdog of a worker's event loop: a loop that has not turned for ``stuck_after_s`` (a
blocking call in an async handler, a long computation with no await) ends the
process, so the commander replaces it and takes its users over.

The loop bumps a timestamp from a callback every ``BEAT_S``; a daemon thread looks at it. When
it is stale past ``stuck_after_s``, the thread logs one line with how long the loop has been
stuck and where (the loop thread's innermost frames), and exits the process with ``EXIT_STUCK``
at once (``os._exit``: nothing of the stuck loop can run a cleaner exit). Its heartbeat had
stopped with the loop, its lanes expire, and the commander reads the exit code as "stuck".
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from protocol.models import EXIT_STUCK

log = logging.getLogger("fleet.worker")
BEAT_S = 0.5  # the loop's bump of its timestamp
FRAMES = 4  # the innermost frames of the stuck loop's stack that the exit line names


class Watchdog:
    """Watches one event loop from a thread; ``check`` is one look (the thread's, or a test's)."""

    def __init__(self, stuck_after_s: float, *, clock: Callable[[], float] = time.monotonic,
                 exit: Callable[[int], object] = os._exit, poll_s: float | None = None) -> None:
        self.stuck_after_s = stuck_after_s
        self.poll_s = poll_s if poll_s is not None else min(BEAT_S, stuck_after_s / 4)
        self._clock, self._exit = clock, exit
        self.last = clock()  # when the loop last turned
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._handle: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch ``loop`` (call it from the loop's thread): the bumps and the thread begin."""
        self._loop_thread = threading.get_ident()
        self.beat()
        self._schedule(loop)
        self._thread = threading.Thread(target=self.run, name="watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching: the thread ends, the bumps stop (the loop is closing)."""
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()

    def beat(self) -> None:
        self.last = self._clock()

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        def bump() -> None:
            self.beat()
            if not self._stop.is_set():
                self._schedule(loop)
        self._handle = loop.call_later(BEAT_S, bump)

    def run(self) -> None:
        """The thread: look every ``poll_s`` until stopped, or until the loop is found stuck. A
        look that comes over ``stuck_after_s / 2`` after the previous one means this thread did
        not run either: the whole process was paused (SIGSTOP), or its loop held the GIL; the
        loop gets a fresh ``stuck_after_s`` (what holds the GIL for ever, the commander's
        ``hung_after_s`` ends)."""
        looked = self._clock()
        while not self._stop.wait(self.poll_s):
            now = self._clock()
            if now - looked > self.stuck_after_s / 2:
                self.last = now
            looked = now
            if self.check():
                return

    def check(self) -> bool:
        """Whether the loop is stuck; if so, log where and exit with ``EXIT_STUCK``."""
        stuck_s = self._clock() - self.last
        if stuck_s < self.stuck_after_s or self._stop.is_set():
            return False
        log.critical("event loop stuck for %.1fs (stuck_after_s %g): exiting with code %d, no "
                     "heartbeat since; the loop is at: %s", stuck_s, self.stuck_after_s,
                     EXIT_STUCK, self.where())
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(EXIT_STUCK)
        return True

    def where(self) -> str:
        """The loop thread's innermost frames, innermost first ("file:line in fn <- ...")."""
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "(its thread is gone)"
        frames = traceback.extract_stack(frame)[-FRAMES:]
        return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
                           for f in reversed(frames))
