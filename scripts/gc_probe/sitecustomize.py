"""The garbage collector's work in a process, by generation: put this directory on a process's
PYTHONPATH with ``FLEET_GC_PROBE_DIR`` set (``scripts/bench_peers --gc-probe DIR`` does, for Fleet's
workers). Each collection's CPU time (the collecting thread's: a preempted process does not
inflate it) is kept, and written at exit to ``DIR/gc-<pid>.json``: generation -> milliseconds."""

from __future__ import annotations

import atexit
import gc
import json
import os
import time

_DIR = os.environ.get("FLEET_GC_PROBE_DIR")
if _DIR:
    _started: list[float] = [0.0]
    _took: dict[int, list[float]] = {0: [], 1: [], 2: []}

    def _probe(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            _started[0] = time.thread_time()
        else:
            _took[info["generation"]].append(round((time.thread_time() - _started[0]) * 1000, 3))

    def _write() -> None:
        with open(os.path.join(_DIR, f"gc-{os.getpid()}.json"), "w") as out:
            json.dump(_took, out)

    gc.callbacks.append(_probe)
    atexit.register(_write)
