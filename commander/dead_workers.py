"""The users of dead workers, handed on at once (``stores.takeover``: lanes cleared and fenced,
fresh notifications posted, the old ones acked).

Dead: a process of ours that exited uncleanly (``exited``), a registered worker we do not run
whose heartbeat expired, and (every ``sweep_interval_s``) any consumer of a ready group that is
no live worker. Right after an outage every heartbeat may have expired, the live workers' too:
they beat again once Redis is back, so a missing one is believed only after a grace. A failure
is logged and retried next pass; a takeover that did something (or followed a crash) is ledgered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis

from commander.ledger_writer import LedgerWriter
from commander.metrics import Metrics
from commander.outages import Outages
from commander.runtime import WorkerHandle
from commander.settings import CommanderSettings
from protocol.models import WorkerInfo, exit_meaning
from stores.backlog import live_ids
from stores.redis_errors import RedisErrors
from stores.retry import TRANSIENT
from stores.takeover import Takeover, sweep, take_over

log = logging.getLogger("fleet.commander")


@dataclass(frozen=True)
class _Dead:
    """A worker known dead whose pending notifications are still to hand on."""

    tier: str
    why: str
    unasked: bool = False  # an exit nobody asked for (a crash): recorded even if it left nothing


class DeadWorkers:
    """The dead workers whose takeover is still to do, and those already taken over."""

    def __init__(self, r: redis.Redis, settings: CommanderSettings, ledger: LedgerWriter,
                 outages: Outages, metrics: Metrics | None, clock: Callable[[], float],
                 monotonic: Callable[[], float], errors: RedisErrors | None = None) -> None:
        self._r, self._ledger, self._outages, self._metrics = r, ledger, outages, metrics
        self._errors = errors or RedisErrors(log)  # the commander's, which counts them
        self._batch = settings.takeover_batch
        self._grace_s, self._sweep_every_s = settings.heartbeat_grace_s, settings.sweep_interval_s
        self._clock, self._monotonic = clock, monotonic
        self._dead: dict[str, _Dead] = {}  # worker -> why it is dead, until its takeover is done
        self._taken: set[str] = set()  # registry entries with an expired heartbeat, taken over
        self._swept_at = 0.0  # monotonic time of the last sweep of the ready groups

    def exited(self, handle: WorkerHandle) -> None:
        """A worker of ours ended without draining (crashed, killed, or ended unseen)."""
        how = "was killed" if handle.killed else f"exited with {exit_meaning(handle.exit_code)}"
        how += f" ({handle.retire_reason})" if handle.retire_reason else ""
        how += f", its log ends: {handle.error}" if handle.error else ""
        self._dead[handle.worker_id] = _Dead(handle.tier, f"worker {handle.worker_id} {how}",
                                             unasked=handle.retire_reason is None)

    def take_over(self, registry: Mapping[str, tuple[WorkerInfo, bool]], handles: list[WorkerHandle],
                  tiers: list[str]) -> None:
        """Hand on what the dead workers left pending; sweep ``tiers`` when it is time."""
        ours = {h.worker_id for h in handles}
        settled = self._clock() - self._outages.trusted_since >= self._grace_s
        expired = {wid: info.tier for wid, (info, alive) in registry.items()
                   if not alive and wid not in ours} if settled else {}
        self._taken &= set(expired)  # alive again, or gone from the registry: forget it
        for wid, tier in expired.items():
            if wid not in self._taken:
                self._dead.setdefault(wid, _Dead(tier, f"the heartbeat of worker {wid} expired"))
        for wid, dead in list(self._dead.items()):
            try:
                done = take_over(self._r, dead.tier, wid, self._batch)
            except TRANSIENT as exc:  # one worker's failure must not stop the others: retried next pass
                self._errors.failed(f"takeover of worker {wid}", exc)
                continue
            except Exception as exc:  # noqa: BLE001 - not Redis's: logged, retried next pass
                log.warning("takeover of worker %s (tier %s) failed (%s: %s); retried next pass",
                            wid, dead.tier, type(exc).__name__, exc)
                continue
            self._errors.answered(f"takeover of worker {wid}")
            del self._dead[wid]
            self._taken.add(wid)
            self._record(done, dead.why, dead.unasked)
        if settled and self._monotonic() - self._swept_at >= self._sweep_every_s:
            self._sweep(tiers, ours | live_ids(registry))

    def _sweep(self, tiers: list[str], live: set[str]) -> None:
        """Take over the consumers of ``tiers`` that are no live worker: ``live`` are ours (a
        worker of ours is never judged by its heartbeat) and those whose heartbeat this pass
        read alive (one that died since is this path's at the next pass); the others' heartbeats
        are read after their consumers are listed (``stores.takeover.sweep``)."""
        live = live | set(self._dead)
        for tier in tiers:
            try:
                done = sweep(self._r, tier, live, self._batch)
            except TRANSIENT as exc:  # retried next sweep
                self._errors.failed(f"sweep of tier {tier}", exc)
                continue
            except Exception as exc:  # noqa: BLE001 - not Redis's: logged, retried next sweep
                log.warning("tier %s: sweep of dead consumers failed (%s: %s); retried next sweep",
                            tier, type(exc).__name__, exc)
                continue
            self._errors.answered(f"sweep of tier {tier}")
            for one in done:
                self._record(one, f"consumer {one.worker} is no live worker")
        self._swept_at = self._monotonic()

    def _record(self, done: Takeover, why: str, unasked: bool = False) -> None:
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
        if done.acked and self._metrics is not None:
            self._metrics.takeover(done.tier, len(done.users))
        self._ledger.record(done.tier, "worker-exited", reason=summary, victims=[done.worker],
                            why={"takeover": {"users": len(done.users),
                                              "lanes_cleared": len(done.lanes_cleared),
                                              "acked": done.acked, "trimmed": done.trimmed,
                                              "unreadable": done.unreadable,
                                              "consumer_removed": done.consumer_removed}})
