"""Run one schedule of the simulated data plane; explore many; shrink a failing one.

A ``Schedule`` is everything that fixes a run: the seed (latencies, workload, handler
times), the workload, and either a strategy that draws the interleaving and the faults as
it goes, or the exact faults and non-FIFO choices to replay. Running a schedule returns an
``Outcome`` whose schedule has both filled in, so any run, failing or not, replays exactly.

Strategies: ``random`` (a uniform pick among the ready callbacks at every step), ``pct``
(probabilistic concurrency testing: random task priorities with ``depth`` priority
changes, which bounds the number of preemptions as preemption-bounded search does, with a
known probability of hitting any bug of that depth), ``fifo`` (asyncio's own order: only
latencies and faults vary).
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import json
import logging
import random
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from sim.checks import Violation, check, waits
from sim.clock import virtual_time
from sim.loop import Chooser, Deadlock, Fifo, SimLoop
from sim.store import Network
from sim.world import Workload, World

if TYPE_CHECKING:
    from sim.scenario import Scenario

FAULT_KINDS = ("kill", "pause", "term", "expire", "drop", "restart", "outage")
_DURATION = {"pause": (2.5, 4.5), "restart": (0.1, 1.5), "outage": (5.0, 20.0)}  # seconds
BASE_BOUND_S = 12.0  # lease expiry + reclaim idle + a reclaim pass + slack, in virtual seconds
STOP_BOUND_S = 10.0  # SIGTERM -> stopped, besides the handler time of what is in flight
ZOMBIE_BOUND_S = 2 * 0.5 + 0.2  # two renew intervals (sim.world.WORKER_TIMING) and slack
STARVE_BOUND_S = 2.0 + 2.0 + 0.5 + 1.5  # lane TTL + reclaim idle + a reclaim pass + slack


@dataclass(frozen=True)
class Fault:
    step: int
    kind: str
    target: int  # resolved at injection: the target-th live worker, user or node (mod count)
    arg: float = 0.0  # seconds, for pause and restart


@dataclass
class Schedule:
    seed: int
    workload: Workload
    strategy: str = "random"
    depth: int = 3  # pct: priority change points
    fault_rate: float = 1 / 1500  # per step, while turns are being submitted and served
    max_faults: int = 3
    faults: list[Fault] | None = None  # None: drawn while running
    choices: dict[int, int] | None = None  # None: drawn by the strategy; else these, FIFO elsewhere

    def to_json(self) -> str:
        body = asdict(self)
        if self.choices is not None:
            body["choices"] = {str(k): v for k, v in sorted(self.choices.items())}
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        body = json.loads(text)
        body["workload"] = Workload(**body["workload"])
        if body.get("faults") is not None:
            body["faults"] = [Fault(**f) for f in body["faults"]]
        if body.get("choices") is not None:
            body["choices"] = {int(k): int(v) for k, v in body["choices"].items()}
        return cls(**body)


@dataclass
class Outcome:
    schedule: Schedule  # faults and choices filled in: replays exactly
    violations: list[Violation]
    steps: int
    virtual_s: float
    commands: int
    waits: list[float] = field(default_factory=list)
    branches: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


# --- choosers -----------------------------------------------------------------------------------
class _Random:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, step: int, ready: int) -> int:
        return self.rng.randrange(ready)


class _Replay:
    """The recorded choices, by the number of the choice (see ``_Recording``)."""

    def __init__(self, choices: dict[int, int]) -> None:
        self.choices = choices
        self.asked = 0

    def choose(self, step: int, ready: int) -> int:
        index = self.choices.get(self.asked, 0)
        self.asked += 1
        return min(index, ready - 1)


class _PCT:
    """Priorities per task (its context); at ``depth`` random steps the running one drops."""

    def __init__(self, rng: random.Random, depth: int, horizon: int, loop_ref: list[SimLoop]) -> None:
        self.rng = rng
        self.changes = set(rng.sample(range(1, horizon), min(depth, horizon - 1)))
        self.prio: dict[int, tuple[contextvars.Context, float]] = {}  # keeps contexts alive: ids stay unique
        self.low = 0.0
        self.loop_ref = loop_ref

    def _priority(self, ctx: contextvars.Context) -> float:
        got = self.prio.get(id(ctx))
        if got is None:
            got = self.prio[id(ctx)] = (ctx, 1.0 + self.rng.random())
        return got[1]

    def choose(self, step: int, ready: int) -> int:
        handles = self.loop_ref[0]._ready
        best = max(range(ready), key=lambda i: self._priority(handles[i]._context))
        if step in self.changes:
            self.low -= 1.0
            self.prio[id(handles[best]._context)] = (handles[best]._context, self.low)
        return best


class _Recording:
    def __init__(self, inner: Chooser) -> None:
        self.inner = inner
        self.made: dict[int, int] = {}
        self.branches: list[tuple[int, int]] = []  # (step, ready callbacks): where another order was possible

    def choose(self, step: int, ready: int) -> int:
        """Keyed by the number of the choice, not the step: a step asks again when the callback
        it picked is cancelled or belongs to a dead or paused node (keyed by step, a replay of a
        run with kills, pauses or lost replies drifted from it)."""
        self.branches.append((step, ready))
        index = self.inner.choose(step, ready)
        if index:
            self.made[len(self.branches) - 1] = index
        return index


# --- faults -------------------------------------------------------------------------------------
class _Faults:
    """Draws faults as the run goes (or replays a given list) and applies them to the world."""

    def __init__(self, schedule: Schedule, rng: random.Random) -> None:
        self.schedule = schedule
        self.rng = rng
        self.given: dict[int, list[Fault]] | None = None
        if schedule.faults is not None:
            self.given = {}
            for f in schedule.faults:
                self.given.setdefault(f.step, []).append(f)
        self.made: list[Fault] = []
        self.world: World | None = None
        self._asked_at: dict[int, int] = {}  # replay: how often this step asked (a step that ran
        # nothing asks again, and a run may have drawn a fault at each of those asks)

    def before_step(self, step: int) -> None:
        world = self.world
        if world is None or not self._serving(world):
            return
        fault = self._next(step)
        if fault is not None and self._apply(world, fault):
            self.made.append(fault)

    def _serving(self, world: World) -> bool:
        done = world.record.clients_done
        return done is None or world.loop.time() < done + 5.0

    def _next(self, step: int) -> Fault | None:
        if self.given is not None:
            nth = self._asked_at.get(step, 0)
            self._asked_at[step] = nth + 1
            here = self.given.get(step, [])
            return here[nth] if nth < len(here) else None
        if len(self.made) >= self.schedule.max_faults or self.rng.random() >= self.schedule.fault_rate:
            return None
        kind = self.rng.choice(FAULT_KINDS)
        low, high = _DURATION.get(kind, (0.0, 0.0))
        arg = self.rng.uniform(low, high) if high else 0.0
        return Fault(step, kind, self.rng.randrange(1 << 16), round(arg, 3))

    def _apply(self, world: World, fault: Fault) -> bool:
        target = self._target(world, fault)
        if target is None:
            return False
        world.inject(fault.kind, target, fault.arg)
        return True

    @staticmethod
    def _target(world: World, fault: Fault) -> str | None:
        live = world.live_workers()
        if fault.kind in ("kill", "pause", "term"):
            return live[fault.target % len(live)] if live else None
        if fault.kind == "expire":
            return f"u{fault.target % world.workload.users}"
        if fault.kind == "drop":
            nodes = live + [f"c{i}" for i in range(world.workload.users)]
            return nodes[fault.target % len(nodes)]
        return "redis"


# --- one schedule --------------------------------------------------------------------------------
def run(schedule: Schedule, scenario: Scenario | None = None) -> Outcome:
    """Run one schedule to its end and check it; with ``scenario``, its clients follow its plan
    and its triggers watch the run (``sim.scenario``)."""
    seed = schedule.seed
    random.seed(seed)  # redis-py's and the worker's backoff jitter draw from the global generator
    loop_ref: list[SimLoop] = []
    chooser = _Recording(_chooser(schedule, loop_ref))
    loop = SimLoop(chooser)
    loop_ref.append(loop)
    try:
        net = Network(loop, random.Random(f"{seed}:net"))
        world = World(loop, net, schedule.workload, random.Random(f"{seed}:work"),
                      plan=scenario.plan if scenario is not None else None)
        if scenario is not None:
            scenario.install(world)
    except BaseException:
        loop.close()  # (left open, its finalizer would warn wherever it is collected)
        raise
    faults = _Faults(schedule, random.Random(f"{seed}:faults"))
    faults.world = world
    loop.before_step = faults.before_step
    violations: list[Violation] = []
    quiet = _quiet_logs()
    gc.disable()  # a finalizer run mid-schedule would depend on this process's history
    try:
        with virtual_time(loop):
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(_drive(world, schedule))
            except Deadlock as exc:
                violations.append(Violation("deadlock", str(exc)))
            end = loop.time()
            violations += check(net.sync_client(), world.record, bound_s=_bound(world),
                                stop_bound_s=STOP_BOUND_S, zombie_bound_s=ZOMBIE_BOUND_S,
                                starve_bound_s=STARVE_BOUND_S, end=end)
            wait_list = waits(world.record, net.sync_client())
            _wind_down(loop, net, world)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
        quiet()
        gc.enable()  # (no full collect here: in a big process, a test run's, it costs more than the run)
    filled = replace(schedule, faults=faults.made if schedule.faults is None else schedule.faults,
                     choices=chooser.made if schedule.choices is None else schedule.choices)
    return Outcome(filled, violations, loop.steps, end, net.commands, wait_list, chooser.branches)


def _chooser(schedule: Schedule, loop_ref: list[SimLoop]) -> Chooser:
    if schedule.choices is not None:
        return _Replay(schedule.choices)
    rng = random.Random(f"{schedule.seed}:choice")
    if schedule.strategy == "random":
        return _Random(rng)
    if schedule.strategy == "pct":
        return _PCT(rng, schedule.depth, 20_000, loop_ref)
    if schedule.strategy == "fifo":
        return Fifo()
    raise ValueError(f"unknown strategy {schedule.strategy!r} (random, pct or fifo)")


def _bound(world: World) -> float:
    """How long after the faults a turn may wait: the base bound plus the work queued ahead of it
    (its user's turns run one at a time; all users share the tier's slots)."""
    work = sum(t.sleep_ms for t in world.record.turns) / 1000
    slots = max(1, world.workload.workers * world.workload.concurrency)
    own = max((sum(t.sleep_ms for t in world.record.turns if t.user == u) for u in
               {t.user for t in world.record.turns}), default=0) / 1000
    return BASE_BOUND_S + own + work / slots


async def _drive(world: World, schedule: Schedule) -> None:
    w = schedule.workload
    horizon = 60.0 + 2 * w.users * w.turns * 1.5
    await world.main(horizon)
    await world.shutdown()


def _wind_down(loop: SimLoop, net: Network, world: World) -> None:
    """Cancel what still runs, with the store gone, so nothing is left pending at close. Each
    worker is drained and told to stop as well, as ``Worker._stop_background`` does: a loop whose
    cancellation redis-py's ``wait_for`` dropped (CPython gh-86296) would retry the gone store
    for ever otherwise. What starts while the wind-down waits (a worker respawned by a kill's
    timer) is cancelled in turn."""
    net.restart(1e9)
    loop.before_step = None
    loop.revive_all()
    loop.max_steps = loop.steps + 200_000
    for _ in range(10):  # again for the tasks started meanwhile (a respawn timer that fired)
        for worker in world.instances.values():
            worker.drain("wind-down")  # (the checks are done: what it records now is read by none)
            worker._stopping.set()
        tasks = sorted(asyncio.all_tasks(loop), key=_created)  # (done ones are left out)
        if not tasks:
            return
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.wait(tasks))
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                pass  # retrieved: a worker that died of the store going away is no news here


def _created(task: asyncio.Task[Any]) -> tuple[int, str]:
    """A task's place in creation order: asyncio names tasks ``Task-<n>`` from a counter.
    ``all_tasks`` is a set, iterated in the order of memory addresses, and the order of the
    wind-down's cancellations decides how many steps it takes: a run and its replay differed."""
    head, _, n = task.get_name().rpartition("-")
    return (int(n), "") if head == "Task" and n.isdigit() else (-1, task.get_name())


def _quiet_logs() -> Any:
    """The workers log every retry and takeover: thousands of lines a schedule. Hush them."""
    names = ("fleet.worker", "asyncio")
    saved = [(n, logging.getLogger(n).level) for n in names]
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL)

    def restore() -> None:
        for n, level in saved:
            logging.getLogger(n).setLevel(level)
    return restore
