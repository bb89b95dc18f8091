"""The ``process`` runtime: workers are local processes (``runtime.py`` says how)."""

from commander.runtime.process.interpreters import GroupRejected
from commander.runtime.process.launch import SpawnError, new_worker_id
from commander.runtime.process.runtime import ProcessRuntime

__all__ = ["GroupRejected", "ProcessRuntime", "SpawnError", "new_worker_id"]
