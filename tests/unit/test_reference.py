"""docs/reference.md is what ``fleet.reference`` makes from the code, and names everything."""

from __future__ import annotations

import re
from pathlib import Path

from fleet.reference import COMMAND, ENVIRONMENT, render
from protocol.policy import RqPolicy, TurnsPolicy, field_paths

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference.md"


def test_the_committed_reference_is_fresh() -> None:
    assert PAGE.read_text() == render(), f"docs/reference.md is stale: run `{COMMAND}`"


def test_the_reference_lists_every_policy_field_of_each_kind() -> None:
    text = render()
    turns, rq = text.split("### An rq tier")
    for model, part in ((TurnsPolicy, turns), (RqPolicy, rq)):
        for path in field_paths(model):
            assert f"| `{'.'.join(path)}` |" in part, path


def test_every_environment_variable_read_by_hand_is_listed() -> None:
    """The FLEET_* and REDIS_URL names the code reads outside the settings models."""
    from commander.settings import CommanderSettings
    from worker.settings import WorkerSettings

    settings = {str(m.model_config.get("env_prefix", "")) + f.upper()
                for m in (CommanderSettings, WorkerSettings) for f in m.model_fields}
    prefixes = {str(m.model_config.get("env_prefix", "")) for m in (CommanderSettings, WorkerSettings)}
    read: set[str] = set()
    for package in ("protocol", "stores", "worker", "commander", "fleet", "sim"):
        for path in (ROOT / package).rglob("*.py"):
            read |= set(re.findall(r"\b(?:FLEET_[A-Z0-9_]*[A-Z0-9]|REDIS_URL)\b", path.read_text()))
    by_hand = {name for name in read if name not in settings and name + "_" not in prefixes}
    assert by_hand <= set(ENVIRONMENT), sorted(by_hand - set(ENVIRONMENT))
