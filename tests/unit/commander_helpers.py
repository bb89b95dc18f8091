"""What the commander's tests share: a recording runtime, a virtual clock, a leading commander
(on fakeredis, or a real Redis), and the ledger read back."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from commander.commander import Commander
from commander.metrics import Metrics
from commander.runtime import Handles, Lifecycle, Runtime, UnknownWorker, WorkerHandle, WorkerIds
from commander.settings import CommanderSettings
from protocol.models import LedgerEvent
from tests import helpers


class VirtualClock:
    """Wall time (starting now, so Redis TTLs and reports agree) and monotonic time, advanced by hand."""

    def __init__(self) -> None:
        self.wall, self.mono = time.time(), 1_000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


class RecordingRuntime(Runtime):
    """A runtime that starts nothing: a spawn is a running handle at once (``spawned`` lists them,
    ``on_spawn`` is told of each), retirements are recorded (an id it does not run is
    ``UnknownWorker``), and ``exit`` makes the exits the next ``reap`` returns; ``broken`` pools
    fail their group check; ``on_reap`` runs at each reap (the start of a pass), ``on_adopt`` at
    each adopt (a new leadership)."""

    name = "recording"

    def __init__(self, tier: str = "chat", clock: Callable[[], float] = time.time) -> None:
        self.tier, self.clock = tier, clock
        self.handles: dict[str, WorkerHandle] = {}
        self.spawned: WorkerIds = []
        self.exited: Handles = []
        self.retired: WorkerIds = []
        self.broken: dict[str, str] = {}
        self.forgotten: list[str] = []
        self.on_spawn: Callable[[WorkerHandle], None] | None = None
        self.on_reap: Callable[[], None] | None = None
        self.on_adopt: Callable[[], None] | None = None

    def spawn(self, tier: str, n: int = 1) -> WorkerIds:
        ids = []
        for _ in range(n):
            self.spawned.append(wid := f"{tier}-{len(self.spawned) + 1}")
            handle = WorkerHandle(wid, tier, 10_000 + len(self.spawned), Lifecycle.RUNNING, self.clock())
            self.handles[wid] = handle
            if self.on_spawn is not None:
                self.on_spawn(handle)
            ids.append(wid)
        return ids

    def check_group(self, pool: str) -> str | None:
        return self.broken.get(pool)

    def pool_forgotten(self, pool: str) -> None:
        self.forgotten.append(pool)

    def retire(self, worker_id: str, reason: str = "", drain_timeout_s: float | None = None) -> None:
        handle = self.handles.get(worker_id)
        if handle is None:
            raise UnknownWorker(worker_id)
        self.retired.append(worker_id)
        handle.state, handle.retire_reason = Lifecycle.DRAINING, reason

    def reap(self) -> Handles:
        if self.on_reap is not None:
            self.on_reap()
        out, self.exited = self.exited, []
        return out

    def adopt(self) -> Handles:
        if self.on_adopt is not None:
            self.on_adopt()
        return []

    def stop_all(self, timeout: float | None = None) -> Handles:
        return []

    def list(self) -> Handles:
        return list(self.handles.values())

    def has_exits(self) -> bool:
        return bool(self.exited)

    def exit(self, worker: str, code: int | None = -9, **how: object) -> None:
        """``worker`` exits (``how`` sets the handle's other fields: ``drained``, ``killed``...)."""
        handle = self.handles.pop(worker, None) or \
            WorkerHandle(worker, self.tier, 1, Lifecycle.RUNNING, 0.0)
        handle.state, handle.exit_code = Lifecycle.EXITED, code
        for name, value in how.items():
            setattr(handle, name, value)
        self.exited.append(handle)

    def count(self, pool: str) -> int:
        return sum(1 for h in self.handles.values() if h.tier == pool and h.state is Lifecycle.RUNNING)


def leading(r: redis.Redis, runtime: Runtime, metrics: Metrics | None = None,
            clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
            **settings: Any) -> Commander:
    """A commander ``c1`` that won the lease (``settings`` over the tests' defaults)."""
    base: dict[str, Any] = {"commander_id": "c1", "metrics_port": None, "heartbeat_grace_s": 0}
    commander = Commander(r, runtime, CommanderSettings(**{**base, **settings}), metrics,
                          clock=clock, monotonic=monotonic)
    assert commander.campaign()
    return commander


def ledger(r: redis.Redis, *actions: str) -> list[LedgerEvent]:
    """The ledger of every tier, oldest first (only ``actions`` if any are given)."""
    return helpers.ledger(r, None, *actions)
