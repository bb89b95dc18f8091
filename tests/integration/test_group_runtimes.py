"""Nothing in Redis names code to run: a group refers to a runtime the commander's own
configuration allows (``group_runtimes``), by name. A policy naming an interpreter or an image
itself is rejected (``policy-rejected``, shown by ``fleet policy get``) and a name the commander
does not know rejects the group (``group-rejected`` once, shown by ``fleet policy get``): no worker
of that group starts. An allowed interpreter that writes forever or never answers is checked off
the pass: the commander keeps leading and passing, and the group is rejected with the reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from commander.group_runtimes import GroupRuntime
from commander.runtime import Refused
from commander.runtime.process import ProcessRuntime
from commander.runtime.process.interpreters import OUTPUT_LIMIT, PENDING
from protocol import keys
from protocol.policy import parse_policy
from stores.policies import write_policy
from tests.helpers import fleet_cli, leads, ledger, live_workers, passes, wait_until

pytestmark = pytest.mark.integration
BLUE = {"name": "blue", "weight": 50, "handler": "echo", "min_workers": 1, "max_workers": 1}


def hostile(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def group_runtimes(tmp_path: Path) -> dict[str, Any]:
    """What the operator allows: a binary that writes forever and one that never answers."""
    return {"loud": {"python": hostile(tmp_path, "loud-python", "exec yes hostile")},
            "slow": {"python": hostile(tmp_path, "slow-python", "exec sleep 600")}}


def pools(r: redis.Redis) -> set[str]:
    return {w.tier for w in live_workers(r)}


@pytest.mark.parametrize("key", ["python", "image"])
def test_a_policy_naming_an_interpreter_or_image_is_rejected_and_starts_nothing(
        r: redis.Redis, process_commander: ProcessRuntime, fleet_env: dict[str, str], tmp_path: Path,
        key: str) -> None:
    value = "/bin/sh" if key == "python" else "evil/miner:1"
    # a raw edit, past the CLI's checks, of a tier the commander knows (as `fleet policy set`
    # registers it: a tier known only by its key is found by the commander's scan, every 30 s)
    r.sadd(keys.TIERS, "chat")
    r.set(keys.policy("chat"), json.dumps({"groups": [BLUE, {"name": "green", "weight": 50, key: value}]}))
    (event,) = wait_until(lambda: ledger(r, "chat", "policy-rejected"), 20, "the rejection")
    fix = f"`{key}` may not be given in a policy"
    assert fix in event.reason and "`runtime: <name>`" in event.reason
    out = fleet_cli(fleet_env, "policy", "get", "chat", cwd=tmp_path, timeout=30)
    assert "REJECTED edit" in out.stdout and fix in out.stdout
    passes(r, 5, "c-test")
    assert not {"chat.blue", "chat.green"} & pools(r)  # no group runs: the last good policy has none
    assert len(ledger(r, "chat", "policy-rejected")) == 1  # once per change, not every pass
    groups = json.dumps([BLUE, {"name": "green", "weight": 50, key: value}])
    refused = fleet_cli(fleet_env, "policy", "set", "chat", f"groups={groups}", cwd=tmp_path, timeout=30)
    assert refused.returncode != 0 and fix in refused.stderr


def test_a_runtime_name_the_commander_does_not_allow_rejects_the_group(
        r: redis.Redis, process_commander: ProcessRuntime, fleet_env: dict[str, str], tmp_path: Path) -> None:
    write_policy(r, "chat", parse_policy({"min_workers": 0, "groups": [
        BLUE, {"name": "green", "weight": 50, "runtime": "miner", "min_workers": 1}]}))
    (event,) = wait_until(lambda: ledger(r, "chat.green", "group-rejected"), 20, "the group rejected")
    why = ("group green of tier chat names runtime 'miner', which this commander does not allow (its "
           "FLEET_COMMANDER_GROUP_RUNTIMES names: loud, slow)")
    assert why in event.reason
    out = fleet_cli(fleet_env, "policy", "get", "chat", cwd=tmp_path, timeout=30)
    assert f"REJECTED group green: {why}" in out.stdout
    wait_until(lambda: "chat.blue" in pools(r), 30, "blue's worker")
    passes(r, 5, "c-test")
    assert "chat.green" not in pools(r) and len(ledger(r, "chat.green", "group-rejected")) == 1
    assert not ledger(r, "chat.green", "scale-up")


@pytest.mark.parametrize(("runtime", "why"), [
    ("loud", f"(exit 125): more than {OUTPUT_LIMIT} bytes of output"),
    ("slow", "(exit 124): no answer in 8s"),  # (0.8 of process_commander's 10 s lease)
])
def test_a_hostile_allowed_interpreter_neither_stalls_nor_grows_the_commander(
        r: redis.Redis, process_commander: ProcessRuntime, runtime: str, why: str) -> None:
    write_policy(r, "chat", parse_policy({"min_workers": 0, "groups": [
        BLUE, {"name": "green", "weight": 50, "runtime": runtime, "min_workers": 1}]}))
    wait_until(lambda: ledger(r, "chat.green"), 10, "green's pool judged")  # (a refusal: checking)
    passes(r, 10, "c-test", timeout=6)  # the passes go on while the check runs (8 s for the slow one)
    (event,) = wait_until(lambda: ledger(r, "chat.green", "group-rejected"), 30, "the group rejected")
    assert why in event.reason
    assert leads(r, "c-test")  # its lease held all along
    assert "chat.green" not in pools(r)


def test_while_an_interpreter_is_checked_its_pool_waits(r: redis.Redis, make_runtime: Any,
                                                         group_runtimes: dict[str, Any]) -> None:
    allowed = {name: GroupRuntime(**entry) for name, entry in group_runtimes.items()}
    rt: ProcessRuntime = make_runtime(group_runtimes=allowed, check_timeout_s=5)
    write_policy(r, "chat", parse_policy({"groups": [BLUE, {"name": "green", "weight": 50,
                                                            "runtime": "slow"}]}))
    assert rt.check_group("chat.green") == PENDING  # no verdict yet ...
    assert rt.refusal("chat.green") == f"group pool chat.green: {PENDING}"  # ... but nothing starts
    with pytest.raises(Refused, match=PENDING):
        rt.spawn("chat.green", 1)
    assert rt.refusal("chat.blue") is None and rt.refusal("chat") is None
