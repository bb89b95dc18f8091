"""Observe: read what the fleet reports (reports, registry, backlog, users, pressure).

Readers only measure; ``decide`` judges. Every read here is batched per pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable

import redis

from commander.decide_inputs import TierSignals
from commander.evaluator import Evaluator
from commander.turn_metrics import TurnTotals
from protocol import keys
from protocol.codec import CodecError, decode
from protocol.models import OccupancyReport, WorkerInfo
from stores.backlog import live_ids, read_tier_load, unserved_by_tier
from stores.bad_state import BadState, reject_wrong_type
from stores.redis_errors import RedisErrors
from stores.registry import Known, read_registry
from stores.replies import Row
from stores.reports import last_pressure_id, newest_reports, reports_after, wait_pressure

log = logging.getLogger("fleet.commander")
REPORT_BATCH = 5_000
WARM_REPORTS = 2_000  # on start, rebuild the evaluator's windows from this many recent reports


class Observer:
    """Keeps the evaluator fed and the stream positions of one commander."""

    def __init__(self, r: redis.Redis, evaluator: Evaluator | None = None,
                 unserved_ms: int | None = None, errors: RedisErrors | None = None,
                 bad: BadState | None = None) -> None:
        self.r = r
        self.errors = errors or RedisErrors(log)  # the commander's, which counts them
        self.bad = bad or BadState(log)  # the commander's, which counts them
        self.evaluator = evaluator or Evaluator()
        # a live worker's pending notification idle this long is no job's: it is backlog (by
        # default two renews of the tier's slowest live worker, from this pass's registry)
        self.unserved_ms = unserved_ms
        self.reports_from: str | None = None  # last report id read
        self.pressure_from: dict[str, str] = {}  # tier -> last pressure id read
        self.pressure_pending: dict[str, int] = {}  # tier -> events read, not yet judged
        self.bad_pressure: set[str] = set()  # tiers whose pressure key is of another type (this pass)
        self._live: frozenset[str] | None = None  # live worker ids of this pass's registry read
        self._workers: dict[str, tuple[WorkerInfo, bool]] = {}  # ... and the entries
        self._all_live: frozenset[str] | None = None  # the live ids of the registry in _workers
        self._unserved: tuple[list[str], dict[str, int]] | None = None  # (tiers, unserved_by_tier)
        self._known = Known(time.monotonic)  # the registry as last read, decoded (read_entries)
        self.turns = TurnTotals()  # the tiers' turn counts, from every report read

    # --- reports -----------------------------------------------------------------------
    def read_reports(self) -> int:
        """Feed every new occupancy report to the evaluator (and its turn counts to ``turns``);
        return how many the evaluator kept. (A new pass: pressure keys found bad are looked at again.)"""
        self.bad_pressure.clear()
        if self.reports_from is None:
            return self._warm_up()
        n = 0
        while True:
            rows = self._reports(lambda: reports_after(self.r, self.reports_from or "0-0", REPORT_BATCH))
            for rid, fields in rows:
                self.reports_from = rid
                n += self._add(rid, fields)
            if len(rows) < REPORT_BATCH:
                return n

    def _warm_up(self) -> int:
        rows = self._reports(lambda: newest_reports(self.r, WARM_REPORTS))
        self.reports_from = rows[0][0] if rows else "0-0"
        return sum(self._add(rid, fields) for rid, fields in reversed(rows))

    def _reports(self, read: Callable[[], list[Row]]) -> list[Row]:
        """``read``'s rows; none if the reports' key is of another type (told to ``bad``)."""
        try:
            return read()
        except redis.ResponseError as exc:
            self.bad.note("report", keys.REPORTS, "", reject_wrong_type(exc))
            return []

    def _add(self, rid: str, fields: dict[bytes, bytes]) -> int:
        try:
            report = decode(OccupancyReport, fields.get(b"m", b""))
        except CodecError as exc:
            self.bad.note("report", keys.REPORTS, rid, exc)
            return 0
        self.turns.add(report)
        return int(self.evaluator.add(report))

    # --- registry ----------------------------------------------------------------------
    def registry(self) -> dict[str, tuple[WorkerInfo, bool]]:
        """Registered workers and whether their heartbeat is alive."""
        reg = read_registry(self.r, self.bad, self._known)
        if reg.workers is not self._workers or self._all_live is None:  # (the same registry: the same ids)
            self._all_live, self._unserved = live_ids(reg.workers), None
        self._live, self._workers = self._all_live, reg.workers
        return reg.workers

    # --- per tier ----------------------------------------------------------------------
    def tier_signals(self, tiers: Iterable[str], windows: dict[str, float], now: float,
                     live: Collection[str] | None = None) -> dict[str, TierSignals]:
        """Backlog, active users and pressure events per tier, in one round trip.

        The backlog counts turns no worker has started (``stores.backlog``): notifications
        pending with a live worker that keeps claiming them are its jobs in progress, not
        backlog, and say which workers hold jobs (``held``). ``live`` are the live worker ids;
        by default those of the registry read this pass (:meth:`registry`), else read now.
        When the reads fail, every tier's signals say they were not observed.
        """
        tiers = list(tiers)
        if live is None:
            if self._live is None:
                self.registry()
            live, self._live = self._live, None  # used once: the next pass reads it afresh
        unserved = self.unserved_ms if self.unserved_ms is not None else self._unserved_by_tier(tiers)
        try:
            loads = read_tier_load(self.r, tiers, live or (), unserved,
                                   {tier: now - windows.get(tier, 60.0) for tier in tiers})
        except redis.RedisError as exc:  # decide still runs: it holds, and counts toward the fallback
            self.errors.failed("tier signals", exc)  # (no scale-in while they cannot be read)
            return {tier: TierSignals(observed=False) for tier in tiers}
        self.errors.answered("tier signals")
        out = {}
        for tier in tiers:
            backlog, active = loads[tier]
            events = self.pressure_pending.pop(tier, 0)
            # a pressure event is a client's momentary view: it counts only while turns still
            # wait undelivered now, so a notification a worker took a moment later is no demand
            out[tier] = TierSignals(backlog=backlog.backlog, active_users=active,
                                    pressure_events=events if backlog.undelivered > 0 else 0,
                                    held=backlog.held)
        return out

    def _unserved_by_tier(self, tiers: list[str]) -> dict[str, int]:
        """``unserved_by_tier`` of this pass's registry, kept while the registry and the tiers are
        the same (10,000 entries not walked again)."""
        if self._unserved is None or self._unserved[0] != tiers:
            self._unserved = tiers, unserved_by_tier(self._workers, tiers)
        return self._unserved[1]

    def wait_for_pressure(self, tiers: Iterable[str], block_ms: int) -> int:
        """Block up to ``block_ms`` for pressure events on any tier; count them per tier.

        ``stores.reports.wait_pressure`` picks how: one blocking read over every tier on one
        node; on a Cluster, where the tiers' streams are in different slots, a blocking read of
        the only tier, or a poll of each tier's stream every ``CLUSTER_POLL_MS``.

        A tier whose pressure key is of another type is told to ``bad`` and left out of the
        waits until the next pass (:meth:`read_reports`) looks again."""
        after = {}
        for tier in tiers:
            if tier in self.bad_pressure:
                continue
            try:
                if tier not in self.pressure_from:
                    self.pressure_from[tier] = last_pressure_id(self.r, tier)
            except redis.ResponseError as exc:
                self._bad_pressure(tier, exc)
                continue
            after[tier] = self.pressure_from[tier]
        if not after:
            time.sleep(block_ms / 1000)
            return 0
        try:
            found = wait_pressure(self.r, after, 10_000, block_ms)
        except redis.ResponseError as exc:
            reject_wrong_type(exc)
            for tier in after:  # which of them: each one read alone
                try:
                    last_pressure_id(self.r, tier)
                except redis.ResponseError as one:
                    self._bad_pressure(tier, one)
            return 0
        total = 0
        for tier, rows in found.items():
            self.pressure_from[tier] = rows[-1][0]
            self.pressure_pending[tier] = self.pressure_pending.get(tier, 0) + len(rows)
            total += len(rows)
        return total

    def _bad_pressure(self, tier: str, exc: redis.ResponseError) -> None:
        self.bad.note("pressure", keys.pressure(tier), "", reject_wrong_type(exc))
        self.bad_pressure.add(tier)
        self.pressure_from.pop(tier, None)  # read afresh once it is a stream again
