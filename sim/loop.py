"""A deterministic asyncio event loop: virtual time, and a chooser picks every step.

Real asyncio code runs on it unchanged. Where the stock loop runs its ready callbacks in
FIFO order and sleeps in ``select``, this loop

- runs **one** ready callback per step, the one its ``Chooser`` picks: a seed (or a replayed
  list of choices) fixes the interleaving of every task at every await;
- never sleeps: with nothing ready it jumps the virtual clock to the next timer, so a
  5-second lease expiry costs no wall time;
- belongs callbacks to **nodes** (a worker process, a client) through the ``NODE`` context
  variable every task inherits: a killed node's callbacks are dropped (its tasks vanish
  mid-await, like a SIGKILLed process), a paused node's are parked until it resumes.

There is no I/O: the store is in-process (``sim.store``), so the selector is absent.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import heapq
from collections.abc import Callable
from typing import Any, Protocol, TypeVarTuple

NODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("sim_node", default=None)
_Ts = TypeVarTuple("_Ts")


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is due: every task waits for something that never comes."""


class Chooser(Protocol):
    """Picks the index of the ready callback to run next (0 = FIFO, what asyncio does)."""

    def choose(self, step: int, ready: int) -> int: ...


class Fifo:
    """asyncio's own order: the oldest ready callback first."""

    def choose(self, step: int, ready: int) -> int:
        return 0


class _Handle(Protocol):
    """The private side of an ``asyncio.Handle`` this loop drives (typeshed declares only part)."""

    _cancelled: bool
    _context: contextvars.Context  # asyncio always sets one (a copy of the current context)

    def _run(self) -> None: ...


class _TimerHandle(_Handle, Protocol):
    """The same of an ``asyncio.TimerHandle``."""

    _when: float
    _scheduled: bool

    def __lt__(self, other: Any) -> bool: ...


class SimLoop(asyncio.BaseEventLoop):
    """An event loop whose time is virtual and whose every step is chosen."""

    # BaseEventLoop's private state this loop drives, which typeshed leaves out
    _ready: collections.deque[_Handle]
    _scheduled: list[_TimerHandle]
    _stopping: bool
    _timer_cancelled_count: int

    def __init__(self, chooser: Chooser, *, max_steps: int = 2_000_000) -> None:
        super().__init__()
        self._clock = 0.0
        self.chooser = chooser
        self.steps = 0
        self.max_steps = max_steps
        self.dead: set[str] = set()
        self.paused: set[str] = set()
        self._parked: dict[str, list[_Handle]] = {}
        self._graveyard: list[_Handle] = []  # a killed node's callbacks, for ``revive_all``
        self.before_step: Callable[[int], None] | None = None  # fault injection point
        self.signal_handlers: dict[tuple[str | None, int], tuple[Callable[..., Any], tuple[Any, ...]]] = {}

    # --- the clock ---------------------------------------------------------------------------
    def time(self) -> float:
        return self._clock

    # --- nodes -------------------------------------------------------------------------------
    def kill(self, node: str) -> None:
        """The node's callbacks never run again: its tasks vanish where they wait."""
        self.dead.add(node)
        self.paused.discard(node)
        self._graveyard.extend(self._parked.pop(node, []))

    def pause(self, node: str) -> None:
        """The node's callbacks wait (SIGSTOP) until ``resume``."""
        if node not in self.dead:
            self.paused.add(node)

    def resume(self, node: str) -> None:
        """SIGCONT: the parked callbacks run again, in the order they became ready."""
        self.paused.discard(node)
        self._ready.extend(self._parked.pop(node, []))

    def revive_all(self) -> None:
        """After the schedule: every node runs again, so its tasks can be cancelled and end
        cleanly (a task left pending would run its ``finally`` at garbage collection)."""
        self.dead.clear()
        for node in list(self.paused):
            self.resume(node)
        self._ready.extend(self._graveyard)
        self._graveyard.clear()

    def add_signal_handler(self, sig: int, callback: Callable[[*_Ts], object], *args: *_Ts) -> None:
        self.signal_handlers[(NODE.get(), int(sig))] = (callback, args)

    def remove_signal_handler(self, sig: int) -> bool:
        return self.signal_handlers.pop((NODE.get(), int(sig)), None) is not None

    def send_signal(self, node: str, sig: int) -> bool:
        """Deliver a signal to a node's handler, if it installed one (like ``kill -TERM``)."""
        got = self.signal_handlers.get((node, int(sig)))
        if got is None or node in self.dead:
            return False
        callback, args = got
        ctx = contextvars.copy_context()
        ctx.run(NODE.set, node)
        self.call_soon(callback, *args, context=ctx)
        return True

    # --- what the base loop needs from a subclass --------------------------------------------
    def _write_to_self(self) -> None:  # call_soon_threadsafe: we are the only thread
        pass

    def _process_events(self, event_list: Any) -> None:
        pass

    # --- one step ----------------------------------------------------------------------------
    def _run_once(self) -> None:
        if self.before_step is not None:
            self.before_step(self.steps)
        self._drop_cancelled_timers()
        self._move_due_timers()
        if not self._ready:
            if self._stopping:
                return
            if not self._scheduled:
                raise Deadlock(f"no task can run at virtual time {self._clock:.3f}s (step {self.steps})")
            self._clock = max(self._clock, self._scheduled[0]._when)
            self._move_due_timers()
        handle = self._pick()
        if handle is not None:
            handle._run()

    def _pick(self) -> _Handle | None:
        """The chosen ready callback, skipping cancelled ones and those of dead or paused nodes."""
        while self._ready:
            if self.steps >= self.max_steps:
                raise RuntimeError(f"the schedule ran past {self.max_steps} steps")
            index = self.chooser.choose(self.steps, len(self._ready)) if len(self._ready) > 1 else 0
            self._ready.rotate(-index)
            handle = self._ready.popleft()
            self._ready.rotate(index)
            if handle._cancelled:
                continue
            node = handle._context.get(NODE) if handle._context is not None else None
            if node is not None and node in self.dead:
                self._graveyard.append(handle)
                continue
            if node is not None and node in self.paused:
                self._parked.setdefault(node, []).append(handle)
                continue
            self.steps += 1
            return handle
        return None

    def _drop_cancelled_timers(self) -> None:
        if self._timer_cancelled_count > 64 and self._timer_cancelled_count * 2 > len(self._scheduled):
            kept = [h for h in self._scheduled if not h._cancelled]
            for h in self._scheduled:
                if h._cancelled:
                    h._scheduled = False
            heapq.heapify(kept)
            self._scheduled = kept
            self._timer_cancelled_count = 0
        while self._scheduled and self._scheduled[0]._cancelled:
            self._timer_cancelled_count -= 1
            heapq.heappop(self._scheduled)._scheduled = False

    def _move_due_timers(self) -> None:
        while self._scheduled and self._scheduled[0]._when <= self._clock:
            handle = heapq.heappop(self._scheduled)
            handle._scheduled = False
            self._ready.append(handle)
