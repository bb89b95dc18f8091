"""The runtime interface: how the control plane starts and stops workers.

A runtime only *acts*: it spawns, drains and kills workers and reports what it sees. It never
decides how many there should be; the commander does. One runtime per package behind this
interface: ``process`` and ``kubernetes``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class Lifecycle(enum.StrEnum):
    """Where a worker is in its life, as the runtime sees it."""

    STARTING = "starting"  # spawned, not yet registered with a heartbeat
    RUNNING = "running"  # registered and heartbeating at least once
    DRAINING = "draining"  # told to drain; killed at its deadline if still alive
    EXITED = "exited"  # the process is gone


LIVE_STATES = (Lifecycle.STARTING, Lifecycle.RUNNING)


@dataclass
class WorkerHandle:
    """What a runtime knows about one worker. ``list()``/``reap()`` return copies."""

    worker_id: str
    tier: str
    pid: int
    state: Lifecycle
    started: float  # unix seconds
    exit_code: int | None = None  # None while alive, or when the exit status is unknown (adopted)
    adopted: bool = False  # found in the registry, not spawned by this runtime instance
    retire_reason: str | None = None
    kill_at: float | None = None  # monotonic deadline after which a draining worker is killed
    killed: bool = False  # the runtime had to SIGKILL it
    drained: bool = False  # exited by itself with code 0 after a drain: it left no work behind
    pending_since: float | None = None  # unix time it began to wait for a place to run (a Pending pod)
    pending_why: str = ""  # ... and why, as the scheduler or the kubelet says
    error: str = ""  # a failed exit nobody asked for: the last line of its log (process), if known

    @property
    def live(self) -> bool:
        """Counts toward the tier's workers: starting or running, not draining or gone."""
        return self.state in LIVE_STATES


# module-level aliases: inside ``Runtime`` the name ``list`` is the method, not the builtin
Handles = list[WorkerHandle]
WorkerIds = list[str]


class UnknownWorker(KeyError):
    """A worker id this runtime does not track (``retire`` raises it)."""


CHECK_PENDING = "the check of its runtime is in progress"  # check_group: no verdict yet


class Refused(RuntimeError):
    """The runtime may not act on this tier now (``refusal`` says why); nothing was changed."""


@dataclass(frozen=True)
class RuntimeNote:
    """Something the runtime did that the commander's plan did not say, for the ledger."""

    tier: str
    action: str  # a LedgerEvent action
    reason: str
    workers: tuple[str, ...] = ()


Notes = list[RuntimeNote]  # (inside ``Runtime`` the name ``list`` is the method)


class Runtime(ABC):
    """Start, drain and kill workers; report them. Non-blocking except ``stop_all``."""

    name: str = "abstract"

    @abstractmethod
    def spawn(self, tier: str, n: int = 1) -> WorkerIds:
        """Start ``n`` workers of ``tier``; return their ids at once (they register later)."""

    @abstractmethod
    def retire(self, worker_id: str, reason: str = "",
               drain_timeout_s: float | None = None) -> None:
        """Ask a worker to drain; it is killed by ``reap()`` after ``drain_timeout_s``.

        ``None`` means the tier's policy ``drain_timeout_s``. Retiring twice is a no-op.
        """

    @abstractmethod
    def reap(self) -> Handles:
        """Collect exited workers (and forget them), enforce kill deadlines, note registrations."""

    @abstractmethod
    def adopt(self) -> Handles:
        """Track live workers of this runtime that another instance started; return them."""

    @abstractmethod
    def stop_all(self, timeout: float | None = None) -> Handles:
        """Drain every worker, wait, kill what is left; return them all, exited.

        ``timeout`` caps the wait for every worker; ``None`` uses each tier's drain timeout.
        """

    @abstractmethod
    def list(self) -> Handles:
        """Every tracked worker, including exited ones not yet reaped."""

    def configure(self, tier: str, kind: str, queues: Sequence[str] = ()) -> None:  # noqa: B027
        """What the tier's policy says its workers are: ``kind`` "turns" (Fleet's workers) or
        "rq" (RQ workers on ``queues``); the commander calls it each pass before it acts. A
        runtime that can run only Fleet's workers ignores it (and an rq tier gets none)."""

    def check_group(self, pool: str) -> str | None:
        """Why the workers of a group's ``pool`` cannot start here (process: its interpreter is
        missing or cannot load its handler; kubernetes: it has no Deployment and names no runtime
        with an image; either: it names a runtime the commander does not allow),
        or None; ``CHECK_PENDING`` while the answer is being found (the commander keeps the
        verdict it recorded last, and ``refusal`` holds the pool's spawns). Runtimes that cannot
        tell answer None. The commander asks every pass."""
        return None

    def pool_forgotten(self, pool: str) -> None:  # noqa: B027 - most runtimes made nothing for it
        """The commander forgot the removed group pool ``pool`` (no worker, nothing queued, no
        submit for a while): what this runtime made for it alone may go (``notes`` says so)."""

    def refusal(self, tier: str) -> str | None:
        """Why this runtime may not act on ``tier`` now (``spawn`` and ``retire`` would raise
        ``Refused``), or None. The commander asks before it acts and ledgers the answer."""
        return None

    def notes(self) -> Notes:
        """What it did since the last call that the ledger should say (and forget them)."""
        return []

    def crash_loop(self) -> dict[str, str]:
        """The pools whose workers keep exiting at start (pool -> one line: how often, the last
        error), which this runtime starts again only after a growing back-off; ``fleet status``
        shows them. Runtimes whose platform backs off itself (a kubelet) answer none."""
        return {}

    def close(self) -> None:  # noqa: B027 - most runtimes hold nothing to release
        """Release clients and helpers (the workers keep running)."""

    def live(self, tier: str | None = None) -> Handles:
        """Starting or running workers (of ``tier`` if given)."""
        return [h for h in self.list() if h.live and (tier is None or h.tier == tier)]

    def has_exits(self) -> bool:
        """Whether a worker exited since the last ``reap`` (cheap: the commander asks it often
        while it waits, so that a dead worker's users are taken over at once)."""
        return any(h.state is Lifecycle.EXITED for h in self.list())
