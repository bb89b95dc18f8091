"""Runtimes: how workers are started and stopped (``process`` now, ``kubernetes`` later)."""

from commander.runtime.base import (
    LIVE_STATES,
    Handles,
    Runtime,
    UnknownWorker,
    WorkerHandle,
    WorkerIds,
    WorkerState,
)

__all__ = ["LIVE_STATES", "Handles", "Runtime", "UnknownWorker", "WorkerHandle", "WorkerIds", "WorkerState"]
