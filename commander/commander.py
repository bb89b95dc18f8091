"""The commander: the control loop, run by the elected leader only.

One pass every ``interval_s``, and at once when a client reports pressure or a worker exits:

    reap -> take over dead workers' users -> observe -> per tier: policy -> decide -> act -> publish

Each step is a collaborator that owns its state (built here, each given what it needs); ``decide``
is pure. Every change is ledgered, fenced by the leadership: a deposed commander's pass ends at
its first append. Errors are caught per tier, per dead worker and per pass; the loop never dies.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

import redis

from commander.actor import Actor
from commander.dead_workers import DeadWorkers
from commander.decide import decide
from commander.decide_inputs import TierSignals, ViewMemo, snapshot, tier_rates, worker_views
from commander.decide_states import DecideStates
from commander.failover import FailoverRecovery
from commander.hung_workers import HungWorkers
from commander.leadership import Deposed, Leadership
from commander.ledger_writer import LedgerWriter
from commander.metrics import Metrics
from commander.monitor.board import Board
from commander.observe import Observer
from commander.outages import Outages
from commander.presence import Presence
from commander.publish import Publisher
from commander.rollouts.pools import Pools
from commander.rollouts.rejection import GroupChecks
from commander.rollouts.removed import RemovedPools
from commander.rollouts.weights import Weights
from commander.rq.reader import RqReader
from commander.rq.tiers import RqTiers
from commander.runtime import Lifecycle, Runtime, UnknownWorker, WorkerHandle
from commander.runtime_watch import RuntimeWatch
from commander.settings import CommanderSettings
from commander.tier_policies import TierNames, TierPolicies, TierPolicy
from protocol.groups import split_pool
from protocol.models import WorkerInfo
from protocol.policy import RqPolicy, TurnsPolicy
from stores.bad_state import BadState
from stores.cluster import is_cluster
from stores.redis_errors import RedisErrors
from stores.retry import TRANSIENT, Backoff

log = logging.getLogger("fleet.commander")
ADOPT_EVERY_S = 10.0  # look for workers started apart (`fleet worker` on this host) this often
EXIT_CHECK_S = 0.05  # while waiting for the next pass, look for exited workers this often
_BACKOFF = Backoff(base=0.1, cap=5.0)  # Redis away: a wait in [0, 0.2 s], doubling up to [0, 5 s]
Registry = Mapping[str, tuple[WorkerInfo, bool]]
_NOT_A_TIERS: tuple[type[Exception], ...] = (Deposed, *TRANSIENT)  # a whole pass's, not one tier's


# The commander keeps every worker's newest report whole (10,000 models at 10,000 workers, the
# rows of their windows being plain numbers the collector skips), and a pass makes tens of
# thousands of short-lived objects. With Python's default thresholds (700, 10, 10) the cyclic
# garbage collector ran some 29 young collections a pass and a full one every seven, 142-177 ms
# of a pass's CPU on average at that size; with these, none in 20 passes (scripts/bench_commander
# --gc python / --gc commander). Collecting young objects after 50,000 allocations instead of 700,
# and the older generations 20 times less often each; cycles are still collected.
GC_THRESHOLDS = (50_000, 20, 20)


def tune_gc() -> None:
    """Set this process's garbage collector for a commander (``GC_THRESHOLDS``)."""
    gc.set_threshold(*GC_THRESHOLDS)


class Commander:
    """One commander process: a standby until it wins the lease, then the fleet's only actor."""

    def __init__(self, r: redis.Redis, runtime: Runtime, settings: CommanderSettings,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, rq: redis.Redis | None = None) -> None:
        """``rq``: RQ's Redis (``settings.rq_url``); None: Fleet's own, unless that is a Cluster.
        ``clock`` and ``monotonic``: wall and monotonic time (tests: virtual)."""
        self.r, self.runtime, self.settings = r, runtime, settings
        self.clock, self.monotonic = clock, monotonic
        # every Redis error of the loop: each kind logged once until it clears, counted in /metrics
        self.redis_errors = RedisErrors(log, counted=metrics.redis_error if metrics is not None else None)
        # every bad entry of shared state met: each warned about once, counted in /metrics
        self.bad = BadState(log, counted=metrics.state_error if metrics is not None else None)
        self.leadership = Leadership(r, settings.commander_id, settings.lease_ttl_ms, monotonic)
        self.ledger = LedgerWriter(self.leadership, clock)
        self.presence = Presence(r, runtime, self.leadership, metrics=metrics, clock=clock,
                                 stop_workers_on_exit=settings.stop_workers_on_exit, bad=self.bad)
        self.outages = Outages(settings.interval_s, monotonic)
        self.observer = Observer(r, errors=self.redis_errors, bad=self.bad)
        self.views = ViewMemo()  # the worker views of the last pass, kept where nothing changed
        self.policies = TierPolicies(r, self.ledger, metrics, self.bad)
        self.tier_names = TierNames(r, monotonic, self.bad)
        self.states = DecideStates(r, self.bad)
        self.dead = DeadWorkers(r, settings, self.ledger, self.outages, metrics, clock, monotonic,
                                self.redis_errors)
        self.hung = HungWorkers(settings.hung_after_s, clock, lambda: self.outages.trusted_since)
        self.actor = Actor(r, runtime, self.leadership, self.ledger, metrics=metrics, clock=clock,
                           max_total_workers=settings.max_total_workers)
        self.watch = RuntimeWatch(runtime, self.ledger, metrics)
        self.failover = FailoverRecovery(r, self.ledger, self.redis_errors)
        self.rq = RqTiers(RqReader(rq if rq is not None else None if is_cluster(r) else r), self.ledger)
        self.weights = Weights(r, self.ledger, self.observer.evaluator)
        self.pools = Pools(r, self.weights, self.bad)
        self.group_checks = GroupChecks(r, runtime, self.ledger, self.bad)
        self.removed_pools = RemovedPools(r, runtime, self.ledger, self.actor, metrics, monotonic, self.bad)
        self.board = Board()  # the last pass, published for the monitor (commander.monitor)
        self.publisher = Publisher(r, self.board, self.observer, self.leadership, metrics,
                                   settings.interval_s)
        self._known: set[str] = set()  # every tier and pool judged: their pressure wakes the loop
        self._adopted_at = 0.0
        # the registry last grouped by tier, its groups, and its tiers with a live entry
        self._grouped: tuple[Registry, Mapping[str, Registry], frozenset[str]] | None = None

    @property
    def leading(self) -> bool:
        """Whether this commander leads now."""
        return self.leadership.leading

    # --- the loop ------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> int:
        """Campaign, lead, step down on ``stop``. Returns the exit code. Any Redis error (BUSY,
        NOPERM, READONLY, LOADING, ...) is logged once per kind, backed off and retried; a leader
        that cannot renew its lease within its TTL is a standby (``Leadership.renew``). Any other
        error of a pass (a value no reader checked) is counted, backed off and retried too: the
        loop never dies of data."""
        failures = broken = 0
        while not stop.is_set():
            try:
                if self.leading or self.campaign():
                    self.pass_once(self.clock())
                    self._wait(stop)
                else:
                    stop.wait(self.settings.standby_poll_s)
                self.presence.register()
                failures = broken = 0
                self.redis_errors.answered("pass")
            except TRANSIENT as exc:
                failures += 1
                self.outages.interrupted()  # the next pass that succeeds ends an outage
                self.redis_errors.failed("pass", exc)  # (acting on nothing until Redis answers)
                stop.wait(_BACKOFF.compute(failures))
            except Exception as exc:
                broken += 1
                self.bad.note("pass", "pass", type(exc).__name__, exc, exc_info=exc)
                stop.wait(_BACKOFF.compute(broken))
        self.presence.leave(redis_away=failures > 0)
        return 0

    def campaign(self) -> bool:
        """Take the lease if it is free; a new leader adopts the workers its predecessor left,
        trusts only reports made from now on, and reads back the decide state it saved."""
        if not self.leadership.campaign():
            return False
        self._adopt()
        self.outages.interrupted()
        self.states.forget()
        self.failover.forget()
        try:
            self.ledger.record("*", "leader", reason=f"{self.settings.commander_id} leads")
        except Deposed:  # lost as soon as won: a standby again
            return False
        return self.leading

    def _wait(self, stop: threading.Event) -> None:
        """Until the next pass: block on pressure events, so a burst wakes us at once, in slices
        of ``EXIT_CHECK_S``, so a worker's exit does too (its users are taken over at once)."""
        deadline = self.monotonic() + self.settings.interval_s
        while not stop.is_set():
            left = deadline - self.monotonic()
            if left <= 0 or (self.leading and self.runtime.has_exits()):
                return
            if self.observer.wait_for_pressure(self._known, max(1, int(min(left, EXIT_CHECK_S) * 1000))):
                return

    # --- one pass ------------------------------------------------------------------------
    def pass_once(self, now: float) -> None:
        """One pass of the control loop at wall time ``now``, if still the leader. A fenced
        ledger append anywhere in it (another commander leads now) ends it there."""
        if not self.leadership.renew():
            return
        try:
            self.outages.note_pass(now)
            self._reap()
            if self.monotonic() - self._adopted_at > ADOPT_EVERY_S:
                self._adopt()
            registry = self.observer.registry()
            by_tier, live = self.grouped(registry)
            handles = self.runtime.list()
            tiers = self._tiers(handles, live)
            self.dead.take_over(registry, handles, tiers)
            self._retire_hung(registry, handles)
            self.observer.read_reports()
            self.observer.evaluator.forget_absent({*registry, *(h.worker_id for h in handles)}, now)
            self.views.begin(self.observer.evaluator.take_changed())
            policies = self._policies(tiers, by_tier)
            tiers = [t for t in tiers if t in policies]
            self.failover.recover({t: p.read.policy.ready_shards for t, p in policies.items()
                                   if isinstance(p.read.policy, TurnsPolicy)})
            windows = {t: p.read.policy.scale_rules().scaling.active_window_s for t, p in policies.items()}
            signals = self.observer.tier_signals(tiers, windows, now)
            for tier in tiers:
                try:
                    self._judge(tier, policies[tier], handles, by_tier.get(tier, {}), signals[tier], now)
                    self.redis_errors.answered(f"tier {tier}")
                except Deposed:
                    raise
                except TRANSIENT as exc:  # one tier's failure must not stop the others
                    self.redis_errors.failed(f"tier {tier}", exc)
                except Exception as exc:
                    self._tier_failed(tier, exc)
            self.views.retain(tiers)
            self.states.save()
            self.publisher.send()
            self.weights.guard({split_pool(t)[0] for t in tiers if split_pool(t)[1]}, now)
            self.board.publish(now, registry, self.observer.evaluator)
        except Deposed:
            log.warning("deposed during a pass: acting on nothing more")

    def grouped(self, registry: Registry) -> tuple[Mapping[str, Registry], frozenset[str]]:
        """Each tier's registry entries, and the tiers with a live one: kept from the last pass
        while the registry is the same (``stores.registry.Known.registry``: 10,000 entries not
        walked again)."""
        if self._grouped is None or self._grouped[0] is not registry:
            by_tier: dict[str, dict[str, tuple[WorkerInfo, bool]]] = {}
            for wid, entry in registry.items():
                by_tier.setdefault(entry[0].tier, {})[wid] = entry
            live = frozenset(t for t, entries in by_tier.items() if any(a for _, a in entries.values()))
            self._grouped = registry, by_tier, live
        _, groups, live = self._grouped
        return groups, live

    def _policies(self, tiers: list[str], by_tier: Mapping[str, Registry]) -> dict[str, TierPolicy]:
        """Each tier's policy for this pass (``by_tier``: each tier's registry entries); a tier
        whose read raised is left out of it."""
        out = {}
        for tier, read in self.policies.read_all(tiers, by_tier).items():
            if isinstance(read, _NOT_A_TIERS):
                raise read
            if isinstance(read, Exception):
                self._tier_failed(tier, read)
            else:
                out[tier] = read
        return out

    def _tier_failed(self, tier: str, exc: Exception) -> None:
        """One tier's pass raised (a value no reader checked): warned about once per tier and
        kind of error, counted; the other tiers go on, and the next pass retries it."""
        self.bad.note("tier_pass", tier, type(exc).__name__, f"the next pass retries: {exc}", exc_info=exc)

    def _reap(self) -> None:
        """Exited workers: an RQ worker's job goes back to RQ; any other that did not drain is
        dead, and its users are taken over."""
        for handle in self.runtime.reap():
            policy = self.policies.in_force(handle.tier)
            if not handle.drained:
                if isinstance(policy, RqPolicy):
                    self.rq.reap(handle, policy)
                else:
                    self.dead.exited(handle)
            self.observer.evaluator.forget(handle.worker_id)

    def _retire_hung(self, registry: Registry, handles: list[WorkerHandle]) -> None:
        """Kill the workers of ours whose process runs with no heartbeat (``HungWorkers``): the
        next reap ends the process the runtime started, and their users are taken over."""
        for handle, missing_s in self.hung.judge(registry, handles):
            reason = f"heartbeat missing for {missing_s:.0f}s while its process runs: stopped or hung"
            log.warning("worker %s (tier %s, pid %d): %s: killing it", handle.worker_id, handle.tier,
                        handle.pid, reason)
            with contextlib.suppress(UnknownWorker):  # (gone meanwhile: reaped as any exit)
                self.runtime.retire(handle.worker_id, reason, drain_timeout_s=0)

    def _adopt(self) -> None:
        self.runtime.adopt()  # a predecessor's workers, and workers started apart on this host
        self._adopted_at = self.monotonic()

    def _tiers(self, handles: list[WorkerHandle], registered: frozenset[str]) -> list[str]:
        """The tiers and group pools to judge: those with a policy key, ``always_tiers``, and
        those with live workers (``registered``: those with a live registry entry), each grouped
        tier as its pools (``commander.rollouts``)."""
        live = {h.tier for h in handles if h.state is not Lifecycle.EXITED} | registered
        known = self.tier_names() | set(self.settings.always_tiers)
        names = self.pools.to_judge(known | live, live)
        self._known |= names
        return sorted(names)

    def _judge(self, tier: str, policy: TierPolicy, handles: list[WorkerHandle], registry: Registry,
               signals: TierSignals, now: float) -> None:
        """policy -> decide -> act -> publish, for one tier or group pool (``registry``: its
        workers' entries)."""
        read = policy.read
        if policy.removed:
            self.removed_pools.empty(tier, handles, registry, read.policy, now)
            return
        if isinstance(read.policy, RqPolicy):
            self.runtime.configure(tier, read.policy.kind, read.policy.rq_queues(tier))
            if self.rq.refused(tier) is not None:
                return
            views, snap, judged = self.rq.inputs(tier, read.policy, handles, now)
        else:
            self.runtime.configure(tier, read.policy.kind)
            judged = read.policy.scale_rules()
            views = worker_views(tier, handles, registry, self.observer.evaluator, judged, now,
                                 self.outages.trusted_since, self.views)
            rates = self.views.rates(tier, views) or tier_rates(views, self.observer.evaluator)
            snap = snapshot(tier, views, signals, rates, self.views.holding(tier))
        started = time.perf_counter()
        plan, state = decide(snap, judged, self.states.get(tier), now)
        decide_s = time.perf_counter() - started
        group_rejected = self.group_checks.rejected(tier)  # its interpreter cannot run its handler
        if group_rejected is not None:
            plan = replace(plan, spawn=0)
        self.actor.apply(self.watch.allowed(plan), judged)
        self.watch.note_pending(tier, handles, read.policy, plan, now)
        self.watch.record_notes()
        self.states.put(tier, state)
        self.publisher.tier(read, snap, plan, views, now=now, decide_s=decide_s,
                            error=policy.rejected or group_rejected, group_rejected=group_rejected)
