"""Virtual time for the modules the simulation runs: ``time.time()`` follows the loop.

The data plane reads the clock for stream ids, lease expiry and idle times (fakeredis),
timestamps and busy intervals (the worker, the client). Inside a simulation each of those
modules sees a stand-in ``time`` module whose clocks are the simulated loop's, so a seed
fixes every value and a 6-second lease costs no wall time. Only the names listed in
``MODULES`` are patched; ``tests/unit/test_sim.py`` checks that every data-plane module
that imports ``time`` is among them.
"""

from __future__ import annotations

import asyncio
import importlib
import time as _real_time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

EPOCH = 1_767_225_600.0  # 2026-01-01T00:00:00Z: virtual time 0

MODULES = (
    "fakeredis._helpers", "fakeredis._socket._base", "fakeredis.model._stream",
    "worker.app", "worker.host", "worker.job", "worker.renewal", "worker.tier_policy", "worker.handlers",
    "worker.sensor", "worker.pod",
    "stores.policies", "stores.commanders", "stores.worker_ops", "stores.deadletters", "stores.reports",
    "stores.redis_errors", "stores.cancel",
    "fleet.client",
    # deferred jobs' code (run by RQ workers) and the worker's watchdog thread (started by
    # `fleet worker`'s main): never in a simulation; listed so that a clock read there would
    # follow the seed if it ever were
    "worker.jobs", "stores.jobctx", "worker.watchdog",
)


class VirtualTime:
    """The parts of the ``time`` module that tell time, read from a simulated loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def time(self) -> float:
        return EPOCH + self._loop.time()

    def time_ns(self) -> int:
        return int(self.time() * 1e9)

    def monotonic(self) -> float:
        return self._loop.time()

    def monotonic_ns(self) -> int:
        return int(self._loop.time() * 1e9)

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        raise RuntimeError("a blocking time.sleep inside the simulation would stall every node")

    def __getattr__(self, name: str) -> Any:  # strftime, gmtime, process_time...
        return getattr(_real_time, name)


@contextmanager
def virtual_time(loop: asyncio.AbstractEventLoop) -> Iterator[VirtualTime]:
    """Patch ``MODULES``' ``time`` with the loop's clock for the duration."""
    fake = VirtualTime(loop)
    saved = []
    for name in MODULES:
        module = importlib.import_module(name)
        saved.append((module, module.time))
        module.time = fake  # type: ignore[attr-defined]
    try:
        yield fake
    finally:
        for module, original in saved:
            module.time = original  # type: ignore[attr-defined]
