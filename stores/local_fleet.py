"""The local fleet's state folder (``fleet up``) and what it recorded: where it is, its URL.

``$FLEET_HOME`` if set, else the nearest ``.fleet/`` in the current directory or above it
(like git, up to ``$HOME`` or the root), else a new one in the current directory.
``fleet/local.py`` writes it; here it is only read. Files, not Redis, but it lives in
``stores``: ``stores.connection.resolve_url`` falls back to the URL it recorded (so does
``python -m worker`` with no ``REDIS_URL``), and ``fleet`` sits above ``stores``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]  # the directory holding protocol/, stores/, ...
STATE_FILE = "state.json"


def fleet_home() -> Path:
    """The state directory, as an absolute path: ``$FLEET_HOME``, else the nearest ``.fleet/``
    here or above (up to ``$HOME`` or the root), else ``./.fleet`` (``fleet up`` creates it)."""
    if os.environ.get("FLEET_HOME"):
        return Path(os.environ["FLEET_HOME"]).resolve()
    return _find_upward() or Path(".fleet").resolve()


def _search_path() -> list[Path]:
    """The directories searched for ``.fleet/``: here, then each parent, ending at ``$HOME``
    if here is inside it, else at the root."""
    here = Path.cwd().resolve()
    home = Path(os.environ.get("HOME") or "/").resolve()
    dirs = [here, *here.parents]
    return dirs[:dirs.index(home) + 1] if home in dirs else dirs


def _find_upward() -> Path | None:
    for directory in _search_path():
        if (directory / ".fleet").is_dir():
            return directory / ".fleet"
    return None


def no_fleet_reason() -> str:
    """Why no running local fleet was found, in words (for the one-line refusal)."""
    home = fleet_home()
    if os.environ.get("FLEET_HOME") or home.is_dir():
        return f"the fleet of {home} is not up"
    dirs = _search_path()
    return f"no .fleet/ in {dirs[0]} or above it (up to {dirs[-1]})"


_noted: set[Path] = set()


def note_found_home() -> None:
    """Say once on stderr which fleet is used when it was found above the current directory."""
    home = fleet_home()
    if os.environ.get("FLEET_HOME") or home.parent == Path.cwd().resolve() or home in _noted:
        return
    _noted.add(home)
    sys.stderr.write(f"fleet: using the fleet of {home} (found above the current directory)\n")


def read_state() -> dict[str, Any] | None:
    """What the running local setup recorded, or None (no file or an unreadable one)."""
    try:
        state = json.loads((fleet_home() / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def recorded_url() -> str | None:
    """The Redis URL of a running local setup, or None if there is none or its Redis died."""
    state = read_state()
    if not state or not isinstance(state.get("url"), str):
        return None
    local = state.get("redis") or {}
    if local.get("pid"):
        return state["url"] if pid_alive(local["pid"], local.get("create_time")) else None
    commander = state.get("commander") or {}  # an external Redis: trust it while fleet is up
    alive = bool(commander.get("pid")) and pid_alive(commander["pid"], commander.get("create_time"))
    return state["url"] if alive else None


def pid_alive(pid: int, create_time: float | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, if given, was created at ``create_time``."""
    try:
        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(proc.pid, os.WNOHANG)  # ours: collect it
            return False
        return create_time is None or abs(proc.create_time() - float(create_time)) <= 1.0
    except (psutil.Error, ValueError, TypeError):
        return False


def child_env(extra: Mapping[str, str] | None = None,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process we start: ``base`` (else ours) with the code importable
    (this checkout first on ``PYTHONPATH``), output unbuffered, then ``extra``."""
    env = dict(os.environ if base is None else base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env
