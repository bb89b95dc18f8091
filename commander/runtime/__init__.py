"""Runtimes: how workers are started and stopped (``process``, ``kubernetes``).

The interface is :class:`Runtime` (``interface.py``); each runtime is a package of its own.
The kubernetes runtime needs the ``k8s`` extra (the official client): its names are imported
on first use, so ``from commander.runtime import KubernetesRuntime`` raises ``ImportError``
there, and only there, when the client is missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from commander.runtime.interface import (
    Handles,
    Lifecycle,
    Notes,
    Refused,
    Runtime,
    RuntimeNote,
    UnknownWorker,
    WorkerHandle,
    WorkerIds,
)
from commander.runtime.process import ProcessRuntime

if TYPE_CHECKING:
    from commander.runtime.kubernetes.api import KubeApi, api_client, default_namespace
    from commander.runtime.kubernetes.runtime import KubernetesRuntime

_KUBERNETES = {"KubeApi": "api",  # name -> its module in kubernetes/, imported on first use
               "api_client": "api", "default_namespace": "api",
               "KubernetesRuntime": "runtime"}

__all__ = ["Handles", "KubeApi", "KubernetesRuntime", "Lifecycle", "Notes",
           "ProcessRuntime", "Refused", "Runtime", "RuntimeNote", "UnknownWorker", "WorkerHandle",
           "WorkerIds", "api_client", "default_namespace"]


def __getattr__(name: str) -> Any:
    module = _KUBERNETES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"commander.runtime.kubernetes.{module}"), name)
