"""A discrete-event simulator of one tier: the SAME ``decide()`` (or another policy) over a trace.

The model, chosen to match what the real fleet does:

- **Workers** have ``concurrency`` slots. A spawned worker is *starting* for
  ``spawn_delay_s`` (0.1 s for a fork from the template, 0.35 s for a fresh interpreter),
  then *ready*: it reports at once and every ``report_interval_s`` after (busy slots, total
  slots and the turn/handler-seconds counters, the handler time of turns in service counted
  as it runs, exactly as the worker's reports count it (``TurnTally.counters``), so a worker
  busy through a report interval reads slot occupancy 1.0 however long its turns are). A
  retired worker *drains*: it takes no new turn, finishes what it holds, and leaves.
- **Turns** wait in one FIFO queue per tier. A free slot takes the oldest queued turn; among
  ready workers with a free slot the one that took work least recently gets it (Redis hands
  a stream entry to the consumer blocked longest). Per user, turns are served in order and
  never at once: a turn of a user whose previous turn is still in service waits for it, and
  that user's job then serves it on the same slot, like the worker's per-user job.
- **Pressure**: a turn that finds no free slot, when the queue is longer than the slots of
  starting workers, is a pressure event; a policy that ``wakes_on_pressure`` (the
  commander) runs a pass ``wake_s`` later instead of at its next tick.
- **Every ``interval_s``** (0.5 s) the policy runs. An observing policy gets a
  ``TierSnapshot`` built exactly as the commander builds it: worker views from the real
  ``Evaluator`` over the simulated reports (``commander.decide_inputs.worker_views``), backlog =
  the turns no worker has started (for a policy that ``counts_pending``, the KEDA-like one,
  lag + pending: the turns in service too), active users in the policy's window, pressure
  events since the last pass (only while turns still wait), rps from the counters.
- **Faults and handlers**: reports inside ``report_outages`` are lost (the commander sees
  them age: its fallback); a turn of at least ``protect_turns_over_s`` protects its worker
  from scale-in until it ends (``TurnContext.protect``).

``wait`` of a turn = its start of service - its arrival (= reply - submit - service).
Worker-seconds and scale events are counted from 0 to the last arrival (the same span: a
policy that releases workers once the traffic has ended is not charged events for workers
another keeps for free); the run goes on until every turn is served. Everything is
deterministic: no clock, no randomness.
"""

from __future__ import annotations

import heapq
import math
import time
from array import array
from bisect import insort
from collections import deque
from collections.abc import Sequence

from commander.decide_inputs import TierSignals, snapshot, tier_rates, worker_views
from commander.evaluator import Evaluator
from commander.runtime.interface import Lifecycle, WorkerHandle
from commander.snapshot import TierSnapshot
from protocol.models import Counters, OccupancyReport, Slots
from sim.scaling.model import (  # re-exported: the policies, scripts and tests import them from here
    Scale,
    SimConfig,
    SimPolicy,
    SimResult,
    SimWorker,
    quantile,
)
from sim.scaling.trace import TraceTurn

_DONE, _READY, _REPORT, _PASS, _SAMPLE = range(5)
_HANDLE_STATE = {"starting": Lifecycle.STARTING, "ready": Lifecycle.RUNNING,
                 "draining": Lifecycle.DRAINING}
__all__ = ["Scale", "SimConfig", "SimPolicy", "SimResult", "SimWorker", "Simulator",
           "quantile", "simulate"]


class Simulator:
    """One tier over one list of turns (sorted by ``at``) under one policy."""

    def __init__(self, turns: Sequence[TraceTurn], policy: SimPolicy,
                 config: SimConfig | None = None) -> None:
        self.cfg = config or SimConfig()
        self.policy = policy
        self.turns = turns
        self.horizon = turns[-1].at if turns else 0.0
        self.t = 0.0
        self.heap: list[tuple[float, int, int, str, int]] = []
        self.seq = 0
        self.workers: dict[str, SimWorker] = {}
        self.made = 0
        self.queue: deque[int] = deque()  # turns of users not in service, in arrival order
        self.pending: dict[str, list[int]] = {}  # user -> its turns waiting behind one in service
        self.user_worker: dict[str, str] = {}  # user -> the worker serving it
        self.queued = self.in_service = self.next_arrival = self.pressure = self.pass_gen = 0
        self.wait = array("d", [math.nan]) * len(turns)
        self.last_submit: dict[str, float] = {}
        self.submits: deque[tuple[float, str]] = deque()
        self.evaluator = Evaluator() if policy.observes else None
        self.worker_seconds = 0.0
        self.ups = self.downs = self.spawned = self.retired = 0
        self.timeline: list[tuple[float, int, int, int, int]] = []
        for _ in range(policy.initial_workers()):
            self._ready(self._spawn(delay=None))
        self._push(0.0, _PASS, "", 0)
        self._push(0.0, _SAMPLE, "", 0)

    # --- the event loop ----------------------------------------------------------------
    def _push(self, at: float, kind: int, wid: str, n: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, wid, n))

    def finished(self) -> bool:
        """Every turn arrived and was served."""
        return self.next_arrival >= len(self.turns) and self.queued == 0 and self.in_service == 0

    def run_until(self, end: float) -> None:
        """Process every arrival and event before ``end`` (exclusive)."""
        turns, heap = self.turns, self.heap
        while True:
            ta = turns[self.next_arrival].at if self.next_arrival < len(turns) else math.inf
            te = heap[0][0] if heap else math.inf
            if min(ta, te) >= end:
                return
            if te <= ta:
                at, _, kind, wid, n = heapq.heappop(heap)
                self._advance(at)
                self._event(kind, wid, n)
            else:
                self._advance(ta)
                self.next_arrival += 1
                self._arrive(self.next_arrival - 1)

    def run(self, tail_s: float = 600.0) -> SimResult:
        """Run the whole trace (and up to ``tail_s`` after it, until every turn is served)."""
        started = time.perf_counter()
        step = 10.0
        end = step
        while not (self.finished() and self.t >= self.horizon) and end <= self.horizon + tail_s + step:
            self.run_until(end)
            end += step
        return self.result(time.perf_counter() - started)

    def result(self, runtime_s: float = 0.0) -> SimResult:
        return SimResult(self.policy.name, list(self.wait), [t.at for t in self.turns], self.worker_seconds,
                         self.ups, self.downs, self.spawned, self.retired, list(self.timeline),
                         self.cfg.slo_s, self.horizon, runtime_s)

    def _advance(self, at: float) -> None:
        if at > self.t:
            upto = min(at, self.horizon)
            if upto > self.t:
                self.worker_seconds += len(self.workers) * (upto - self.t)
            self.t = at

    def _event(self, kind: int, wid: str, n: int) -> None:
        if kind == _DONE:
            self._done(self.workers[wid], n)
        elif kind == _READY:
            w = self.workers.get(wid)
            if w is not None and w.state == "starting":
                self._ready(w)
        elif kind == _REPORT:
            w = self.workers.get(wid)
            if w is not None and w.state != "starting":
                self._report(w)
                self._push(self.t + self.cfg.view_policy.scaling.report_interval_s, _REPORT, wid, 0)
        elif kind == _PASS:
            if n == self.pass_gen:
                self._pass()
        else:
            self.timeline.append((self.t, len(self.workers), self._count("ready"), self.queued,
                                  self.in_service))
            if not (self.finished() and self.t >= self.horizon):
                self._push(self.t + self.cfg.sample_s, _SAMPLE, "", 0)

    def _count(self, state: str) -> int:
        return sum(1 for w in self.workers.values() if w.state == state)

    # --- turns -------------------------------------------------------------------------
    def _arrive(self, i: int) -> None:
        turn = self.turns[i]
        self._note_submit(turn.user)
        if turn.user in self.user_worker:
            insort(self.pending.setdefault(turn.user, []), i)
            self.queued += 1
            return
        w = self._free_worker()
        if w is not None:
            self._start(i, w)
            return
        self.queue.append(i)
        self.queued += 1
        starting_slots = self._count("starting") * self.cfg.concurrency
        if len(self.queue) > starting_slots:
            self.pressure += 1
            if self.policy.wakes_on_pressure:
                self.pass_gen += 1
                self._push(self.t + self.cfg.wake_s, _PASS, "", self.pass_gen)

    def _note_submit(self, user: str) -> None:
        self.last_submit[user] = self.t
        self.submits.append((self.t, user))

    def _free_worker(self) -> SimWorker | None:
        best = None
        for w in self.workers.values():
            if w.state == "ready" and len(w.busy) < self.cfg.concurrency and (
                    best is None or w.last_take < best.last_take):
                best = w
        return best

    def _start(self, i: int, w: SimWorker) -> None:
        turn = self.turns[i]
        self.wait[i] = self.t - turn.at
        w.busy[turn.user] = i
        w.since[turn.user] = self.t
        w.last_take = self.t
        self.user_worker[turn.user] = w.id
        self.in_service += 1
        self._push(self.t + turn.service_s, _DONE, w.id, i)

    def _done(self, w: SimWorker, i: int) -> None:
        turn = self.turns[i]
        w.turns += 1
        w.handler_seconds += self.t - w.since.pop(turn.user)
        self.in_service -= 1
        del w.busy[turn.user]
        waiting = self.pending.get(turn.user)
        if waiting:  # the user's job goes on with its next turn on the same slot
            self.queued -= 1
            self._start(waiting.pop(0), w)
            if not waiting:
                del self.pending[turn.user]
            return
        del self.user_worker[turn.user]
        if w.state == "ready":
            self._fill(w)
        elif w.state == "draining" and not w.busy:
            self._exit(w)

    def _fill(self, w: SimWorker) -> None:
        while self.queue and len(w.busy) < self.cfg.concurrency:
            i = self.queue.popleft()
            user = self.turns[i].user
            if user in self.user_worker:  # an earlier turn of the user got there first
                insort(self.pending.setdefault(user, []), i)
                continue
            self.queued -= 1
            self._start(i, w)

    # --- workers -----------------------------------------------------------------------
    def _spawn(self, delay: float | None) -> SimWorker:
        self.made += 1
        w = SimWorker(f"{self.cfg.tier}-s{self.made:04d}", self.t)
        self.workers[w.id] = w
        self.spawned += 1
        if delay is not None:
            self._push(self.t + delay, _READY, w.id, 0)
        return w

    def _ready(self, w: SimWorker) -> None:
        w.state = "ready"
        if self.evaluator is not None:
            self._report(w)
            self._push(self.t + self.cfg.view_policy.scaling.report_interval_s, _REPORT, w.id, 0)
        self._fill(w)

    def _retire(self, wid: str) -> None:
        w = self.workers.get(wid)
        if w is None or w.state == "draining":
            return
        self.retired += 1
        if w.state == "starting" or not w.busy:
            self._exit(w)
            return
        w.state = "draining"
        if self.evaluator is not None:
            self._report(w)

    def _exit(self, w: SimWorker) -> None:
        del self.workers[w.id]
        if self.evaluator is not None:
            self.evaluator.forget(w.id)

    def _report(self, w: SimWorker) -> None:
        assert self.evaluator is not None
        if any(start <= self.t < end for start, end in self.cfg.report_outages):
            return  # lost: the commander sees this worker's reports age
        report = OccupancyReport.model_construct(
            worker=w.id, tier=self.cfg.tier, ts=self.cfg.epoch + self.t, state=w.state, users=0,
            active_users=0, slots=Slots.model_construct(busy=len(w.busy), total=self.cfg.concurrency,
                                                        queue_depth=0),
            cpu=None, rss=0, counters=Counters.model_construct(turns=w.turns, errors=0,
                                                               handler_seconds=w.handler_seconds_at(self.t)),
            load=(0.0, 0.0, 0.0), protected_until=self._protected_until(w))
        self.evaluator.add(report)

    def _protected_until(self, w: SimWorker) -> float | None:
        """A turn of at least ``protect_turns_over_s`` protects its worker until it ends, as a
        handler calling ``TurnContext.protect`` for its own length would."""
        limit = self.cfg.protect_turns_over_s
        if limit is None:
            return None
        ends = [w.since[u] + self.turns[i].service_s for u, i in w.busy.items()
                if self.turns[i].service_s >= limit]
        return self.cfg.epoch + max(ends) if ends else None

    # --- the policy --------------------------------------------------------------------
    def _pass(self) -> None:
        self.pass_gen += 1
        self._push(self.t + self.cfg.interval_s, _PASS, "", self.pass_gen)
        if not self.policy.due(self.t):
            return
        snap = self.snapshot() if self.policy.observes else None
        self.pressure = 0
        current = sum(1 for w in self.workers.values() if w.state != "draining")
        self._apply(self.policy(self.t, snap, current))

    def snapshot(self) -> TierSnapshot:
        """The tier as the commander would see it now."""
        assert self.evaluator is not None
        now = self.cfg.epoch + self.t
        handles = [WorkerHandle(w.id, self.cfg.tier, 0, _HANDLE_STATE[w.state], self.cfg.epoch + w.started)
                   for w in self.workers.values()]
        rules = self.cfg.view_policy.scale_rules()
        views = worker_views(self.cfg.tier, handles, {}, self.evaluator, rules, now, 0.0)
        # Fleet's backlog is the turns no worker has started (stores.backlog); KEDA's Redis
        # streams scaler counts lag + pending, which includes the turns in service
        backlog = len(self.queue) + (self.in_service if getattr(self.policy, "counts_pending", False) else 0)
        signals = TierSignals(backlog=backlog, active_users=self._active_users(),
                              pressure_events=self.pressure if self.queue else 0)
        return snapshot(self.cfg.tier, views, signals, tier_rates(views, self.evaluator))

    def _active_users(self) -> int:
        cutoff = self.t - self.cfg.view_policy.scaling.active_window_s
        while self.submits and self.submits[0][0] < cutoff:
            ts, user = self.submits.popleft()
            if self.last_submit.get(user) == ts:
                del self.last_submit[user]
        return len(self.last_submit)

    def _apply(self, action: Scale | int) -> None:
        if isinstance(action, int):
            action = self._toward(action)
        counted = self.t <= self.horizon  # the span worker-seconds are counted over
        if action.spawn > 0:
            self.ups += int(counted)
            for _ in range(action.spawn):
                self._spawn(self.cfg.spawn_delay_s)
        if action.retire:
            self.downs += int(counted)
            for wid in action.retire:
                self._retire(wid)

    def _toward(self, target: int) -> Scale:
        """A count-based policy's target as a Scale: newest starting workers go first, then
        the least busy ready ones (newest first), like a Deployment scaling in."""
        live = [w for w in self.workers.values() if w.state != "draining"]
        if target >= len(live):
            return Scale(spawn=target - len(live))
        order = sorted(live, key=lambda w: (w.state != "starting", len(w.busy), -w.started, w.id))
        return Scale(retire=tuple(w.id for w in order[:len(live) - target]))

    # --- what-if -----------------------------------------------------------------------
    def fork(self) -> Simulator:
        """An independent copy (the trace is shared) to try a decision without committing it."""
        other = object.__new__(Simulator)
        other.__dict__.update(self.__dict__)
        other.heap = list(self.heap)
        other.workers = {k: w.copy() for k, w in self.workers.items()}
        other.queue = deque(self.queue)
        other.pending = {u: list(v) for u, v in self.pending.items()}
        other.user_worker = dict(self.user_worker)
        other.wait = array("d", self.wait)
        other.last_submit = dict(self.last_submit)
        other.submits = deque(self.submits)
        other.timeline = list(self.timeline)
        other.policy = self.policy.copy() if hasattr(self.policy, "copy") else self.policy
        if self.evaluator is not None:
            import copy

            other.evaluator = copy.deepcopy(self.evaluator)
        return other


def simulate(turns: Sequence[TraceTurn], policy: SimPolicy, config: SimConfig | None = None,
             tail_s: float = 600.0) -> SimResult:
    """Run ``policy`` over ``turns`` (sorted by arrival) and return the outcome."""
    return Simulator(turns, policy, config).run(tail_s)
