"""A commander driven pass by pass on a virtual clock, on a real Redis, with simulated workers.

``Rig.step(dt)`` advances the clock ``dt`` seconds, lets every simulated worker report what the
test set for it (an occupancy report at the virtual time; a frozen one reports nothing), and
runs one ``Commander.pass_once``. So "nothing happened after N seconds" is asserted after the
clock moved N seconds and the passes ran: deterministic, no sleeps.

The simulated workers stand for real ones at the commander's boundary: a registry entry with a
heartbeat, occupancy reports, and an exit after a drain (reaped at the next pass); the runtime
the commander drives is the unit tests' ``RecordingRuntime``.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from commander.commander import Commander
from commander.runtime import Lifecycle, WorkerHandle
from commander.settings import CommanderSettings
from protocol import keys
from protocol.codec import encode
from protocol.models import Counters, LedgerEvent, OccupancyReport, Slots, WorkerInfo
from stores.policies import read_policy
from tests.helpers import ledger
from tests.unit.commander_helpers import RecordingRuntime, VirtualClock

INTERVAL_S = 0.2  # the pass interval of the real-process scenarios
HANDLERS = ("echo", "noop", "sleep")  # the built-ins every simulated worker has


@dataclass
class SimWorker:
    """What a simulated worker reports: set ``busy``; ``frozen`` stops its reports (SIGSTOP)."""

    handle: WorkerHandle
    concurrency: int
    busy: int = 0
    frozen: bool = False
    outside: bool = False  # started separately (`fleet worker`): in the registry, not the runtime's
    handler_seconds: float = 0.0


class SimWorkers:
    """The simulated workers behind a recording runtime (``recording``, the one the commander
    drives): a worker it spawns is registered and ready at once, and a retired one exits, drained,
    at the next reap once it has nothing in hand."""

    def __init__(self, r: redis.Redis, clock: VirtualClock, concurrency: int) -> None:
        self.r, self.clock, self.concurrency = r, clock, concurrency
        self.workers: dict[str, SimWorker] = {}
        self.recording = RecordingRuntime(clock=clock.time)
        self.recording.on_spawn = self._register
        self.recording.on_reap = self._exit_drained

    @property
    def spawned(self) -> list[str]:
        return self.recording.spawned

    def add(self, wid: str, tier: str = "chat", outside: bool = False) -> SimWorker:
        """A registered, reporting worker: the runtime's, or one started ``outside`` it."""
        handle = WorkerHandle(wid, tier, 10_000 + len(self.workers), Lifecycle.RUNNING, self.clock.time())
        if not outside:
            self.recording.handles[wid] = handle
        return self._register(handle, outside)

    def _register(self, handle: WorkerHandle, outside: bool = False) -> SimWorker:
        wid, tier = handle.worker_id, handle.tier
        info = WorkerInfo(worker=wid, tier=tier, pid=handle.pid, host="sim", started=handle.started,
                          handlers=list(HANDLERS))
        self.r.hset(keys.WORKERS, wid, encode(info))
        self.r.set(keys.heartbeat(wid), "1", px=600_000)
        read_policy(self.r, tier, HANDLERS, record=True, reader=wid)  # as a worker does at start
        self.workers[wid] = worker = SimWorker(handle, self.concurrency, outside=outside)
        return worker

    def _exit_drained(self) -> None:
        for wid, worker in list(self.workers.items()):
            if worker.handle.state is Lifecycle.DRAINING and worker.busy == 0:
                del self.workers[wid]
                self.r.hdel(keys.WORKERS, wid)
                self.r.delete(keys.heartbeat(wid))
                self.recording.exit(wid, 0, drained=True)

    def report(self, dt: float) -> None:
        """Every unfrozen worker reports its slots as of now (handler time accrued over ``dt``)
        and reads its tier's policy as a worker does (recording an accepted key as last good)."""
        for wid, w in self.workers.items():
            if w.frozen:
                continue
            read_policy(self.r, w.handle.tier, HANDLERS, record=True, reader=wid)
            w.handler_seconds += w.busy * dt
            state = "draining" if w.handle.state is Lifecycle.DRAINING else "ready"
            rep = OccupancyReport(worker=wid, tier=w.handle.tier, ts=self.clock.time(), state=state,
                                  users=w.busy, active_users=w.busy,
                                  slots=Slots(busy=w.busy, total=w.concurrency), rss=50_000_000,
                                  counters=Counters(turns=0, handler_seconds=w.handler_seconds),
                                  load=(0.0, 0.0, 0.0))
            self.r.xadd(keys.REPORTS, {"m": encode(rep)})


class Rig:
    """One commander ``name`` leading on the virtual clock, and its simulated workers."""

    def __init__(self, r: redis.Redis, concurrency: int, name: str = "c1",
                 clock: VirtualClock | None = None, group: bool = True) -> None:
        self.r = r
        self.clock = clock or VirtualClock()
        self.runtime = SimWorkers(r, self.clock, concurrency)
        settings = CommanderSettings(commander_id=name, metrics_port=None, interval_s=INTERVAL_S,
                                     always_tiers=("chat",))
        self.commander = Commander(r, self.runtime.recording, settings, clock=self.clock.time,
                                   monotonic=self.clock.monotonic)
        if group:  # (what the first worker does)
            r.xgroup_create(keys.ready("chat"), keys.GROUP, id="0", mkstream=True)

    def campaign(self) -> bool:
        return self.commander.leading or self.commander.campaign()

    def step(self, dt: float = INTERVAL_S) -> None:
        """``dt`` seconds pass, the workers report, the commander runs one pass."""
        self.clock.advance(dt)
        self.runtime.report(dt)
        self.commander.pass_once(self.clock.time())

    def run_for(self, seconds: float, dt: float = INTERVAL_S) -> None:
        """Passes every ``dt`` for ``seconds`` of virtual time."""
        for _ in range(round(seconds / dt)):
            self.step(dt)

    def live(self) -> list[str]:
        return sorted(w for w, s in self.runtime.workers.items() if s.handle.state is Lifecycle.RUNNING)

    def park(self, n: int, tier: str = "chat") -> None:
        """``n`` turns waiting for a worker (notifications no worker has read)."""
        for i in range(n):
            self.r.xadd(keys.ready(tier), {"user": f"p{i:03d}"})

    def serve_all(self, worker: str, tier: str = "chat") -> None:
        """``worker`` takes every waiting notification and acks it: the backlog is gone."""
        ready = keys.ready(tier)
        for _stream, rows in self.r.xreadgroup(keys.GROUP, worker, {ready: ">"}) or []:
            ids = [rid for rid, _ in rows]
            if ids:
                self.r.xack(ready, keys.GROUP, *ids)
                self.r.xdel(ready, *ids)

    def ledger(self, tier: str | None = "chat") -> list[LedgerEvent]:
        return ledger(self.r, tier)

    def actions(self, *names: str) -> list[LedgerEvent]:
        return ledger(self.r, "chat", *names)
