"""Run records of the ``process`` runtime: one small JSON file per spawned worker.

Written by the process runtime (``workers.py``); read by its adoption (``adoption.py``) and by
``fleet down``.

``<run_dir>/<worker id>.json`` holds the tier, pid, start time and the process creation
time, so that the next commander can adopt a worker that had not registered
yet when the previous one died, and never mistake a reused pid for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Protocol

import psutil

from protocol.groups import validate_pool
from protocol.ids import validate_token

log = logging.getLogger(__name__)


class Recorded(Protocol):
    """What a record keeps of a worker (``commander.runtime.WorkerHandle`` has it)."""

    worker_id: str
    tier: str
    pid: int
    started: float


def write_record(run_dir: Path, handle: Recorded, proc: psutil.Process | None, rq: bool = False) -> None:
    """Record a worker we track (atomically; a failure is logged, never raised); ``rq``: an RQ
    worker (``worker.rq.rq_worker``), adopted as one."""
    create_time = None
    with contextlib.suppress(psutil.Error):
        create_time = proc.create_time() if proc is not None else None
    record = {"worker": handle.worker_id, "tier": handle.tier, "pid": handle.pid,
              "started": handle.started, "create_time": create_time, "rq": rq}
    path = run_dir / f"{handle.worker_id}.json"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot write run record %s: %s", path, exc)


def read_records(run_dir: Path, quiet: bool = False) -> list[dict[str, Any]]:
    """Every readable record, validated, with its ``path``; unreadable ones are skipped (and
    logged unless ``quiet``)."""
    records = []
    for path in sorted(run_dir.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            validate_pool(rec["tier"])  # a tier, or a group's pool
            validate_token(rec["worker"], "worker id")
            records.append({**rec, "pid": int(rec["pid"]), "started": float(rec["started"]),
                            "rq": rec.get("rq") is True, "path": path})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not quiet:
                log.warning("ignoring unreadable run record %s: %s", path, exc)
    return records


def drop_record(run_dir: Path, worker_id: str) -> None:
    """Forget a worker's record (it is gone)."""
    with contextlib.suppress(OSError):
        (run_dir / f"{worker_id}.json").unlink(missing_ok=True)
