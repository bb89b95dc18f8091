"""The worker as a sensor: raw occupancy quantities, no judgement (DESIGN §4)."""

from __future__ import annotations

import os
import time

import psutil

from protocol.models import Counters, OccupancyReport, Slots, TurnStats, WorkerState


class Sensor:
    """Samples this process: cpu since the last sample, rss, users seen, load."""

    def __init__(self, users_window_s: float = 60.0) -> None:
        self.proc = psutil.Process()
        self.users_window_s = users_window_s
        self.last_seen: dict[str, float] = {}  # user -> last time a turn of theirs was served
        self._last_cpu: tuple[float, float] | None = None  # (cpu seconds, wall seconds)

    def saw(self, user: str, now: float | None = None) -> None:
        """Note that a turn of ``user`` was served."""
        self.last_seen[user] = time.time() if now is None else now

    def _cpu_fraction(self) -> float | None:
        times = self.proc.cpu_times()
        sample = (times.user + times.system, time.monotonic())
        prev, self._last_cpu = self._last_cpu, sample
        if prev is None or sample[1] <= prev[1]:
            return None
        fraction: float = max(0.0, (sample[0] - prev[0]) / (sample[1] - prev[1]))  # psutil: untyped
        return fraction

    def _users(self, now: float, interval: float) -> tuple[int, int]:
        horizon = now - self.users_window_s
        self.last_seen = {u: t for u, t in self.last_seen.items() if t >= horizon}
        recent = sum(1 for t in self.last_seen.values() if t >= now - interval)
        return len(self.last_seen), recent

    def sample(self, *, worker: str, tier: str, state: WorkerState,
               slots: Slots, counters: Counters, interval: float,
               turn_stats: TurnStats | None = None,
               protected_until: float | None = None) -> OccupancyReport:
        """One report row."""
        now = time.time()
        users, active = self._users(now, interval)
        load = os.getloadavg()
        return OccupancyReport(worker=worker, tier=tier, ts=now, state=state, users=users,
                               active_users=active, slots=slots, cpu=self._cpu_fraction(),
                               rss=self.proc.memory_info().rss, counters=counters,
                               load=(load[0], load[1], load[2]), turn_stats=turn_stats or TurnStats(),
                               protected_until=protected_until)
