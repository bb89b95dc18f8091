"""Runtimes: how workers are started and stopped (``process``, ``kubernetes``)."""

from commander.runtime.base import (
    LIVE_STATES,
    Handles,
    Notes,
    Refused,
    Runtime,
    RuntimeNote,
    UnknownWorker,
    WorkerHandle,
    WorkerIds,
    WorkerState,
)

__all__ = ["LIVE_STATES", "Handles", "Notes", "Refused", "Runtime", "RuntimeNote", "UnknownWorker",
           "WorkerHandle", "WorkerIds", "WorkerState"]
