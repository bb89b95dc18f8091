"""The ``process`` runtime: workers are local processes (``runtime.py`` says how)."""

from commander.runtime.process.runtime import ProcessRuntime, new_worker_id

__all__ = ["ProcessRuntime", "new_worker_id"]
