"""A commander driven pass by pass on a virtual clock, on a real Redis, with simulated workers.

``Rig.step(dt)`` advances the clock ``dt`` seconds, lets every simulated worker report what the
test set for it (an occupancy report at the virtual time; a frozen one reports nothing), and
runs one ``Commander.pass_once``. So "nothing happened after N seconds" is asserted after the
clock moved N seconds and the passes ran: deterministic, no sleeps.

The simulated workers stand for real ones at the commander's boundary: a registry entry with a
heartbeat, occupancy reports, and an exit after a drain (reaped at the next pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from commander.commander import Commander
from commander.runtime import Handles, Lifecycle, Runtime, UnknownWorker, WorkerHandle, WorkerIds
from commander.settings import CommanderSettings
from protocol import keys
from protocol.codec import decode, encode
from protocol.models import Counters, LedgerEvent, OccupancyReport, Slots, WorkerInfo
from stores.policies import read_policy
from tests.unit.commander_helpers import VirtualClock

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


class SimRuntime(Runtime):
    """Spawns simulated workers: registered and ready at once; a retired one exits drained."""

    name = "sim"

    def __init__(self, r: redis.Redis, clock: VirtualClock, concurrency: int) -> None:
        self.r, self.clock, self.concurrency = r, clock, concurrency
        self.workers: dict[str, SimWorker] = {}
        self.spawned: list[str] = []
        self._exited: list[WorkerHandle] = []

    def spawn(self, tier: str, n: int = 1) -> WorkerIds:
        ids = []
        for _ in range(n):
            wid = f"{tier}-s{len(self.spawned)}"
            self.spawned.append(wid)
            self.add(wid, tier)
            ids.append(wid)
        return ids

    def add(self, wid: str, tier: str = "chat", outside: bool = False) -> SimWorker:
        """A registered, reporting worker: ours (in ``list()``), or one started ``outside``."""
        handle = WorkerHandle(wid, tier, 10_000 + len(self.workers), Lifecycle.RUNNING, self.clock.time())
        info = WorkerInfo(worker=wid, tier=tier, pid=handle.pid, host="sim", started=handle.started,
                          handlers=list(HANDLERS))
        self.r.hset(keys.WORKERS, wid, encode(info))
        self.r.set(keys.heartbeat(wid), "1", px=600_000)
        read_policy(self.r, tier, HANDLERS, record=True, reader=wid)  # as a worker does at start
        self.workers[wid] = worker = SimWorker(handle, self.concurrency, outside=outside)
        return worker

    def retire(self, worker_id: str, reason: str = "", drain_timeout_s: float | None = None) -> None:
        worker = self.workers.get(worker_id)
        if worker is None or worker.outside:
            raise UnknownWorker(worker_id)
        worker.handle.state, worker.handle.retire_reason = Lifecycle.DRAINING, reason

    def reap(self) -> Handles:
        for wid, worker in list(self.workers.items()):
            if worker.handle.state is Lifecycle.DRAINING and worker.busy == 0:  # drained: exits
                del self.workers[wid]
                self.r.hdel(keys.WORKERS, wid)
                self.r.delete(keys.heartbeat(wid))
                worker.handle.state, worker.handle.exit_code, worker.handle.drained = \
                    Lifecycle.EXITED, 0, True
                self._exited.append(worker.handle)
        out, self._exited = self._exited, []
        return out

    def adopt(self) -> Handles:
        return []

    def stop_all(self, timeout: float | None = None) -> Handles:
        return []

    def list(self) -> Handles:
        return [w.handle for w in self.workers.values() if not w.outside]

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
        self.runtime = SimRuntime(r, self.clock, concurrency)
        settings = CommanderSettings(commander_id=name, metrics_port=None, interval_s=INTERVAL_S,
                                     always_tiers=("chat",))
        self.commander = Commander(r, self.runtime, settings, clock=self.clock.time,
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
        events = [decode(LedgerEvent, f[b"m"]) for _, f in self.r.xrange(keys.EVENTS)]
        return [e for e in events if tier is None or e.tier == tier]

    def actions(self, *names: str) -> list[LedgerEvent]:
        return [e for e in self.ledger() if e.action in names]
