"""The commander: observe -> evaluate -> decide -> act, per tier, by the elected leader only.

One pass every ``interval_s``, and at once when a client reports pressure. A pass reaps
exited workers, takes over the users of dead ones (``stores.takeover``), reads new reports,
the registry and each tier's signals and policy, runs the pure ``decide`` and acts on its plan:
the ledger entry first (fenced by the leader epoch), then the runtime; a scale-up's entry, which
names the workers started, right after the runtime, behind a lease renewal just before it.
Errors are caught per tier, per dead worker and per pass; the loop never dies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import redis

from commander.decide import Plan, TierState, decide
from commander.groups import Groups
from commander.leader import Deposed, Leadership
from commander.monitor.board import Board, TierSeen
from commander.observe import Observer
from commander.records import Records
from commander.recovery import Recovering, Recovery
from commander.rqtier import RqReader, RqTiers
from commander.runtime import Runtime, UnknownWorker, WorkerHandle, WorkerState
from commander.runtime_notes import RuntimeNotes
from commander.settings import CommanderSettings
from commander.views import TierSignals, snapshot, tier_rates, worker_views
from protocol.groups import split_pool
from protocol.models import Control, LedgerEvent
from protocol.policy import Policy
from stores.backlog import write_starting
from stores.cluster import is_cluster
from stores.control import send_control
from stores.policies import PolicyRead, list_tiers, read_policy
from stores.retry import TRANSIENT, Backoff
from stores.takeover import Takeover, sweep, take_over

log = logging.getLogger("fleet.commander")
ADOPT_EVERY_S = 10.0
EXIT_CHECK_S = 0.05  # while waiting for the next pass, look for exited workers this often
_BACKOFF = Backoff(base=0.1, cap=5.0)  # Redis away: a wait in [0, 0.2 s], doubling up to [0, 5 s]


@dataclass
class _Tier:
    """What the commander remembers of a tier between passes."""

    state: TierState = field(default_factory=TierState)
    policy: Policy = field(default_factory=Policy)
    verdict: tuple[str, str | None] | None = None  # (source, error) last recorded in the ledger
    held: str | None = None  # the last hold reason recorded
    rejected: str | None = None  # why the policy key is rejected now (None: it is in force)
    removed: bool = False  # a pool no group of its tier's policy names: its workers are drained
    loaded: bool = False  # decide state read back from Redis after an election


@dataclass(frozen=True)
class _Dead:
    """A worker known dead whose pending notifications are still to hand on."""

    tier: str
    why: str
    unasked: bool = False  # an exit nobody asked for (a crash): recorded even if it left nothing


class Commander(Records, RuntimeNotes, RqTiers, Groups, Recovering):
    """One commander process: a standby until it wins the lease, then the fleet's only actor."""

    def __init__(self, r: redis.Redis, runtime: Runtime, settings: CommanderSettings,
                 metrics: Any | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, rq: redis.Redis | None = None) -> None:
        """``rq``: RQ's Redis (``settings.rq_url``); None: Fleet's own, unless that is a Cluster."""
        self.r, self.runtime, self.settings, self.metrics = r, runtime, settings, metrics
        self.clock, self.monotonic = clock, monotonic  # wall and monotonic time (tests: virtual)
        self.leader = Leadership(r, settings.commander_id, settings.lease_ttl_ms)
        self.observer = Observer(r)
        self.rq = RqReader(rq if rq is not None else None if is_cluster(r) else r)  # (rqtier.py)
        self._rq_refusals: set[str] = set()
        self.tiers: dict[str, _Tier] = {}
        self.started = self.clock()
        self._adopted_at = 0.0
        self._pressure_total: dict[str, int] = {}
        self._last_pass: float | None = None  # monotonic start of the last completed pass
        self._dead: dict[str, _Dead] = {}  # workers known dead whose takeover is still to do
        self._taken: set[str] = set()  # registry entries with an expired heartbeat, taken over
        self._swept_at = 0.0  # monotonic time of the last sweep of the ready groups
        self.trusted_since = 0.0  # wall time an outage ended: older reports are not trusted
        self.board = Board()  # the last pass, published for the monitor (commander.monitor)
        self.recovery = Recovery()  # re-notifies after a Cluster failover
        self._refusals: dict[str, str] = {}  # (runtime_notes.py)
        self._no_capacity: dict[str, set[str]] = {}
        self._seen_weights, self._group_verdicts, self._removed = {}, {}, set()  # (groups.py)
        self._moved, self._moved_at = {}, {}

    # --- the loop ------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> int:
        """Campaign, lead, step down on ``stop``. Returns the exit code."""
        failures = 0
        while not stop.is_set():
            try:
                if self.leader.leading or self._campaign():
                    self.pass_once(self.clock())
                    self._wait(stop)
                else:
                    stop.wait(self.settings.standby_poll_s)
                self._register()
                failures = 0
            except TRANSIENT as exc:
                failures += 1
                self._last_pass = None  # the next pass that succeeds ends an outage
                delay = _BACKOFF.compute(failures)
                log.warning("Redis unavailable (%s); retrying in %.1fs, acting on nothing", exc, delay)
                stop.wait(delay)
        self._shutdown(redis_away=failures > 0)
        return 0

    def _campaign(self) -> bool:
        if not self.leader.campaign():
            return False
        self.runtime.adopt()  # a new leader takes over the workers its predecessor left
        self._adopted_at = self.monotonic()
        self._last_pass = None  # and trusts only reports made after it took over
        for tier in self.tiers.values():
            tier.loaded = False  # re-read the stabilization history the last leader saved
        self.recovery.forget()  # and the cluster epoch it last recovered from
        try:
            self._append(LedgerEvent(ts=self.clock(), tier="*", epoch=self.leader.epoch or 0,
                                     commander=self.settings.commander_id, action="leader",
                                     reason=f"{self.settings.commander_id} leads"))
        except Deposed:  # lost as soon as won: a standby again
            return False
        return self.leader.leading

    def _wait(self, stop: threading.Event) -> None:
        """Until the next pass: block on pressure events, so a burst wakes us at once, in slices
        of ``EXIT_CHECK_S``, so a worker's exit does too (its users are taken over at once)."""
        deadline = self.monotonic() + self.settings.interval_s
        while not stop.is_set():
            left = deadline - self.monotonic()
            if left <= 0 or (self.leader.leading and self.runtime.has_exits()):
                return
            if self.observer.wait_for_pressure(self.tiers, max(1, int(min(left, EXIT_CHECK_S) * 1000))):
                return

    # --- one pass ------------------------------------------------------------------------
    def pass_once(self, now: float) -> None:
        """Observe every tier and act on its plan, if still the leader."""
        if not self.leader.renew():
            return
        try:
            self._pass(now)
        except Deposed:  # a fenced append anywhere in the pass: another commander leads now
            log.warning("deposed during a pass: acting on nothing more")

    def _pass(self, now: float) -> None:
        self._note_outage(now)
        self._reap(now)
        if self.monotonic() - self._adopted_at > ADOPT_EVERY_S:
            self.runtime.adopt()  # workers started separately with `fleet worker` on this host
            self._adopted_at = self.monotonic()
        self.observer.read_reports()
        registry = self.observer.registry()
        handles = self.runtime.list()
        names = self._tier_names(handles, registry)
        self._take_over_dead(registry, handles, names)
        policies = {t: self._policy(t, registry) for t in names}
        self._recover({t: p.policy.ready_shards for t, p in policies.items()})
        windows = {t: p.policy.active_window_s for t, p in policies.items()}
        try:
            signals = self.observer.tier_signals(names, windows, now)
        except redis.RedisError as exc:  # decide still runs: it holds, and counts toward the fallback
            log.warning("tier signals could not be read (%s: %s): no scale-in this pass",
                        type(exc).__name__, exc)
            signals = {t: TierSignals(observed=False) for t in names}
        for tier in names:
            try:
                self._judge(tier, policies[tier], handles, registry, signals[tier], now)
            except Deposed:
                raise
            except Exception:
                log.exception("tier %s: pass failed; the next pass retries", tier)
        self._guard_rollouts({split_pool(n)[0] for n in names if split_pool(n)[1]}, now)
        self.board.publish(now, registry, self.observer.evaluator)

    def _note_outage(self, now: float) -> None:
        """The first pass of a leadership, a pass after a failed one, or after a long stall
        (Redis paused): reports from before now do not describe the workers' load (they could
        not reach Redis, or we did not see them), so scale-in waits for reports made after."""
        mono = self.monotonic()
        if self._last_pass is None or mono - self._last_pass > max(3 * self.settings.interval_s, 2.0):
            if self.trusted_since:
                log.warning("observations were interrupted: scale-in waits for new reports")
            self.trusted_since = now
        self._last_pass = mono

    def _tier_names(self, handles: list[WorkerHandle], registry: dict[str, Any]) -> list[str]:
        """The tiers and group pools to judge (commander.groups)."""
        live = {h.tier for h in handles if h.state is not WorkerState.EXITED}
        live |= {info.tier for info, alive in registry.values() if alive}
        names = self._with_pools(set(list_tiers(self.r)) | set(self.settings.always_tiers) | live, live)
        for name in names:
            self.tiers.setdefault(name, _Tier())
        return sorted(names)

    def _policy(self, tier: str, registry: dict[str, Any]) -> PolicyRead:
        """The policy the tier's workers run: the key, unless it is invalid or names a handler
        that none of the tier's live workers has (they keep their last good one then)."""
        known = sorted({name for info, alive in registry.values()
                        if alive and info.tier == tier for name in info.handlers})
        base, group = split_pool(tier)  # a group's pool runs its group's policy (groups.py)
        read = read_policy(self.r, base, known or None,  # no live worker said: structure only
                           group=group or None)
        memo = self.tiers[tier]
        verdict = (read.source, read.error)
        why = read.error
        if read.missing_handler is not None:
            why = (f"no live worker of tier {tier} has handler {read.missing_handler!r} "
                   f"(they have: {', '.join(known)}; install it where they run)")
        memo.rejected = why  # shown by the monitor while the key stays rejected
        if verdict != memo.verdict and (read.error or memo.verdict is not None):
            action = "policy-rejected" if read.error else "policy-applied"
            reason = f"policy key rejected: {why}; running the {read.source} policy" \
                if read.error else f"policy from {read.source} in force"
            self._append(self._event(tier, action, reason=reason))
            (log.warning if read.error else log.info)("tier %s: %s", tier, reason)
        read, memo.removed = self._pool_read(tier, read)
        memo.verdict, memo.policy = verdict, read.policy
        if self.metrics is not None:
            self.metrics.policy_rejected(tier, read.error is not None)
        return read

    def _judge(self, tier: str, read: PolicyRead, handles: list[WorkerHandle],
               registry: dict[str, Any], signals: Any, now: float) -> None:
        memo = self.tiers[tier]
        if memo.removed:
            self._move_users(tier, self._drain_removed(tier, handles, registry, read.policy), now)
            return
        if not memo.loaded:
            memo.state, memo.loaded = self._load_state(tier), True
        policy = read.policy
        self.runtime.configure(tier, policy.kind, policy.rq_queues(tier))
        if policy.kind == "rq" and self._rq_refused(tier) is not None:
            return  # no RQ Redis (a Cluster without rq_url): said once in the ledger
        if policy.kind == "rq":
            views, snap, policy = self._rq_inputs(tier, policy, handles, now)
        else:
            views = worker_views(tier, handles, registry, self.observer.evaluator, policy, now,
                                 self.trusted_since)
            snap = snapshot(tier, views, signals, tier_rates(views, self.observer.evaluator))
        started = time.perf_counter()
        plan, state = decide(snap, policy, memo.state, now)
        elapsed = time.perf_counter() - started
        group_rejected = self._group_rejected(tier)  # its interpreter cannot run its handler
        if group_rejected is not None:
            plan = replace(plan, spawn=0)
        self._act(plan, policy)
        self._note_pending(tier, handles, read.policy, plan, now)
        self._record_notes()
        if state != memo.state:
            memo.state = state
            self._save_state(tier, state)
        starting = sum(1 for v in views if v.state == "starting")
        write_starting(self.r, tier, starting * read.policy.concurrency,
                       ttl_ms=int(3 * self.settings.interval_s * 1000) + 1000)
        self._observe_metrics(tier, snap, plan, views, starting, elapsed)
        self.board.tier(TierSeen(tier=tier, ts=now, policy=read.policy, source=read.source,
                                 error=memo.rejected or group_rejected, snapshot=snap, plan=plan,
                                 starting=starting, group_rejected=group_rejected))

    def _act(self, plan: Plan, policy: Policy) -> None:
        memo = self.tiers[plan.tier]
        if self._refused_now(plan):  # (ledgered once per reason)
            plan = replace(plan, spawn=0, retire=())
        spawn = min(plan.spawn, self._room())
        if spawn < plan.spawn:
            log.warning("tier %s wants %d more workers; the fleet-wide cap max_total_workers=%d "
                        "leaves room for %d", plan.tier, plan.spawn, self.settings.max_total_workers, spawn)
        if spawn > 0:
            # the ids are known only once the runtime started the workers: the lease is renewed
            # (fenced) just before, so the entry written just after names them
            self.leader.confirm()
            ids = self.runtime.spawn(plan.tier, spawn)
            self._append(self._event(plan.tier, "scale-up", plan, to=plan.current + spawn, spawned=ids))
            log.info("tier %s: %d -> %d (%s): spawned %s", plan.tier, plan.current,
                     plan.current + spawn, plan.reason, ", ".join(ids))
            self._count_scale(plan.tier, "up")
        left = plan.current
        for action in dict.fromkeys(r.action for r in plan.retire):  # recycle, reclaim-idle, consolidate
            victims = [r.worker for r in plan.retire if r.action == action]
            self._append(self._event(plan.tier, action, plan, to=left - len(victims), victims=victims))
            for victim in victims:
                self._retire(victim, f"{action}: {plan.reason}", policy.drain_timeout_s)
            log.info("tier %s: %d -> %d (%s): draining %s", plan.tier, left, left - len(victims),
                     plan.reason, ", ".join(victims))
            left -= len(victims)
            if action != "recycle":
                self._count_scale(plan.tier, "down")
        if plan.held != memo.held:
            if plan.held:
                self._append(self._event(plan.tier, "hold", plan, to=plan.current))
            memo.held = plan.held

    def _room(self) -> int:
        """Workers this commander may still start under the fleet-wide cap (all tiers)."""
        running = sum(1 for h in self.runtime.list() if h.state is not WorkerState.EXITED)
        return max(0, self.settings.max_total_workers - running)

    def _retire(self, worker_id: str, reason: str, drain_timeout_s: float) -> None:
        try:
            self.runtime.retire(worker_id, reason, drain_timeout_s)
        except UnknownWorker:  # registered elsewhere (another host): drain it over Redis
            send_control(self.r, worker_id, Control(kind="drain", ts=self.clock(), reason=reason[:200]),
                         maxlen=100)

    def _reap(self, now: float) -> None:
        for handle in self.runtime.reap():
            memo = self.tiers.get(handle.tier)
            if memo is not None and memo.policy.kind == "rq":
                if not handle.drained:  # an RQ worker: its job goes back to RQ, no users to take over
                    self._reap_rq(handle, memo.policy)
            elif not handle.drained:  # crashed, killed, or ended unseen: its users are taken over
                how = "was killed" if handle.killed else f"exited (code {handle.exit_code})"
                self._dead[handle.worker_id] = _Dead(handle.tier, f"worker {handle.worker_id} {how}",
                                                     unasked=handle.retire_reason is None)
            self.observer.evaluator.forget(handle.worker_id)

    # --- takeover of dead workers' users ---------------------------------------------------
    def _take_over_dead(self, registry: dict[str, Any], handles: list[WorkerHandle],
                        names: list[str]) -> None:
        """Hand on at once what dead workers left pending (their lanes cleared, fenced).

        Dead: a process of ours that exited uncleanly (``_reap``), a registered worker we do not
        run whose heartbeat expired, and (every ``sweep_interval_s``) any consumer of a ready
        group that is no live worker. A failure is logged and retried next pass.
        """
        ours = {h.worker_id for h in handles}
        # right after an outage every heartbeat may have expired, the live workers' too: they
        # beat again once Redis is back, so a missing one is believed only after a grace
        settled = self.clock() - self.trusted_since >= self.settings.heartbeat_grace_s
        expired = {wid: info.tier for wid, (info, alive) in registry.items()
                   if not alive and wid not in ours} if settled else {}
        self._taken &= set(expired)  # alive again, or gone from the registry: forget it
        for wid, tier in expired.items():
            if wid not in self._taken:
                self._dead.setdefault(wid, _Dead(tier, f"the heartbeat of worker {wid} expired"))
        for wid, dead in list(self._dead.items()):
            try:
                done = take_over(self.r, dead.tier, wid, self.settings.takeover_batch)
            except Exception as exc:  # noqa: BLE001 - one worker's failure must not stop the others
                log.warning("takeover of worker %s (tier %s) failed (%s: %s); retried next pass",
                            wid, dead.tier, type(exc).__name__, exc)
                continue
            del self._dead[wid]
            self._taken.add(wid)
            self._record_takeover(done, dead.why, dead.unasked)
        if settled and self.monotonic() - self._swept_at >= self.settings.sweep_interval_s:
            self._sweep(names, ours)

    def _sweep(self, names: list[str], ours: set[str]) -> None:
        live = ours | set(self._dead)  # (a worker of ours is never judged by its heartbeat)
        for tier in names:
            try:
                done = sweep(self.r, tier, live, self.settings.takeover_batch)
            except Exception as exc:  # noqa: BLE001
                log.warning("tier %s: sweep of dead consumers failed (%s: %s); retried next sweep",
                            tier, type(exc).__name__, exc)
                continue
            for one in done:
                self._record_takeover(one, f"consumer {one.worker} is no live worker")
        self._swept_at = self.monotonic()

    def _record_takeover(self, done: Takeover, why: str, unasked: bool = False) -> None:
        """Log and count a takeover; a ledger event when it did something, or when the exit
        was nobody's request (a crash is always recorded)."""
        if not (done.changed or unasked):
            return
        consumer = "consumer removed" if done.consumer_removed else \
            "consumer kept (still pending)" if done.pending_left else "no consumer"
        n = len(done.users)
        summary = (f"{why}; handed {n} user{'' if n == 1 else 's'} on at once "
                   f"({len(done.lanes_cleared)} lanes cleared, {done.acked} notifications acked); "
                   f"{consumer}")
        (log.warning if n else log.info)("tier %s: %s", done.tier, summary)
        if done.acked and self.metrics is not None:
            self.metrics.takeover(done.tier, len(done.users))
        self._append(self._event(done.tier, "worker-exited", reason=summary, victims=[done.worker],
                                 why={"takeover": {"users": len(done.users),
                                                   "lanes_cleared": len(done.lanes_cleared),
                                                   "acked": done.acked, "trimmed": done.trimmed,
                                                   "unreadable": done.unreadable,
                                                   "consumer_removed": done.consumer_removed}}))
