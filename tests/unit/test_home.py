"""stores.local_fleet.recorded_url: which URL a client without --redis-url or REDIS_URL uses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from stores.local_fleet import STATE_FILE, recorded_url


def _write(home: Path, state: dict[str, object]) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / STATE_FILE).write_text(json.dumps(state))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLEET_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _this_process() -> dict[str, object]:
    return {"pid": os.getpid(), "create_time": psutil.Process().create_time()}


def test_an_external_redis_is_used_while_the_commander_of_fleet_up_runs(home: Path) -> None:
    """`fleet up --redis-url X` records no local server, only its commander: X is the fleet's
    Redis while that commander lives (the state once called it the supervisor)."""
    _write(home, {"url": "redis://10.0.0.5:6379/0", "commander": _this_process()})
    assert recorded_url() == "redis://10.0.0.5:6379/0"


def test_an_external_redis_whose_commander_is_gone_is_not_used(home: Path) -> None:
    _write(home, {"url": "redis://10.0.0.5:6379/0", "commander": {"pid": 2**22 + 12345, "create_time": 1.0}})
    assert recorded_url() is None


def test_a_local_redis_is_used_while_its_server_runs(home: Path) -> None:
    _write(home, {"url": "redis://127.0.0.1:7001/0", "redis": _this_process(), "commander": {}})
    assert recorded_url() == "redis://127.0.0.1:7001/0"


def test_no_state_no_url(home: Path) -> None:
    assert recorded_url() is None
