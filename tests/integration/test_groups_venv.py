"""Canary and blue/green end to end: two real virtualenvs, each with its own version of a small
handler package built here, one tier with a group per virtualenv, a real commander (process
runtime, a fork template per interpreter) and real workers on a private redis-server.

A 90/10 split serves every user on its group's version, in order; a rollout to 100 % moves the
blue users to green between turns (every turn answered once, each session in submission order,
a user's versions never going back); an abort brings them back; and groups whose interpreter
is missing or cannot import the handler are rejected while the tier serves on.

The virtualenvs are made offline (``tests.helpers.offline_venv``: they see this environment's
dependencies), with the checkout on ``PYTHONPATH`` (the runtime sets it) and the handler package
installed with this environment's pip (``venv_install``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from commander.runtime.process import ProcessRuntime
from fleet.cli import main as fleet_main
from fleet.client import Fleet
from protocol import keys
from protocol.codec import decode
from protocol.groups import assign
from protocol.models import SessionEntry
from protocol.policy import parse_policy
from stores.group_assignment import rejected_groups
from stores.policies import read_policy, write_policy
from stores.registry import read_registry
from tests.helpers import ledger, offline_venv, venv_install
from tests.integration.conftest import wait_until, wait_workers_saw

pytestmark = pytest.mark.integration
USERS = [f"user-{i}" for i in range(30)]
PYPROJECT = """[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"
[project]
name = "fleet-canary-test"
version = "{version}"
[project.entry-points."fleet.handlers"]
canary = "fleet_canary_test:handle"
[tool.setuptools]
packages = ["fleet_canary_test"]
"""
HANDLER = """from protocol.models import HandlerResult


def handle(ctx):
    return HandlerResult(text="v{version}: " + ctx.turn.text)
"""


def handler_venv(root: Path, version: int) -> str:
    """A virtualenv holding version ``version`` of the handler package; its interpreter's path."""
    python = offline_venv(root / f"venv{version}")
    pkg = root / f"pkg{version}"
    (pkg / "fleet_canary_test").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(PYPROJECT.format(version=f"{version}.0"))
    (pkg / "fleet_canary_test" / "__init__.py").write_text(HANDLER.format(version=version))
    venv_install(python, pkg)
    return str(python)


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("venvs")
    return handler_venv(root, 1), handler_venv(root, 2)


@pytest.fixture
def group_runtimes(venvs: tuple[str, str]) -> dict[str, Any]:
    """The commander's allow-list: the two virtualenvs, a missing interpreter, and one without
    the handler package (the policy names them, never their paths)."""
    bare = sys._base_executable  # type: ignore[attr-defined]  # (no handler package: cannot load it)
    return {"app-v1": {"python": venvs[0]}, "app-v2": {"python": venvs[1]},
            "gone": {"python": "/nonexistent/bin/python"}, "bare": {"python": bare}}


def live_pools(r: redis.Redis) -> dict[str, list[str]]:
    pools: dict[str, list[str]] = {}
    for wid, (info, alive) in read_registry(r).workers.items():
        if alive:
            pools.setdefault(info.tier, []).append(wid)
    return pools


def serve_round(client: Fleet, n: int) -> dict[str, str]:
    """One turn per user, all submitted in one batch; each user's reply's version (``v1``/``v2``)."""
    handles = client.submit_many([(u, f"{u} turn {n}") for u in USERS])
    out = {}
    for h in handles:
        reply = h.result(timeout=30)
        assert reply.ok and reply.text == f"v{reply.text[1]}: {h.user} turn {n}", reply
        out[h.user] = reply.text[:2]
    return out


def rollout(url: str, runtime: ProcessRuntime, r: redis.Redis, client: Fleet, step: list[str],
            weights: str) -> None:
    """``fleet rollout chat green <step>``; wait until every worker runs the new ``weights``; the
    client reads them too."""
    assert fleet_main(["--redis-url", url, "rollout", "chat", "green", *step]) == 0
    wait_workers_saw(runtime, r, f"groups of chat now {weights}", f"every worker to see {weights}")
    client.reread_policies()


def test_canary_rollout_and_abort_across_two_virtualenvs(
        venvs: tuple[str, str], redis_server: Any, r: redis.Redis, process_commander: ProcessRuntime) -> None:
    one = {"handler": "canary", "min_workers": 1, "max_workers": 2}
    write_policy(r, "chat", parse_policy({"min_workers": 0, "report_interval_s": 0.5, "groups": [
        {"name": "blue", "runtime": "app-v1", "weight": 90, **one},
        {"name": "green", "runtime": "app-v2", "weight": 10, **one},
        {"name": "gone", "handler": "canary", "runtime": "gone", "weight": 0},
        {"name": "bare", "handler": "canary", "runtime": "bare", "weight": 0}]}))
    wait_until(lambda: {"chat.blue", "chat.green"} <= set(live_pools(r)), 60, "a worker in each group")
    wait_until(lambda: {"gone", "bare"} <= set(rejected_groups(r, "chat")), 60, "the broken groups rejected")
    why = rejected_groups(r, "chat")
    assert "/nonexistent/bin/python is missing" in why["gone"]
    assert "cannot load handler 'canary'" in why["bare"]
    assert {e.tier for e in ledger(r, None, "group-rejected")} == {"chat.gone", "chat.bare"}
    assert set(live_pools(r)) == {"chat.blue", "chat.green"}  # the tier serves on

    split = [("blue", 90.0), ("green", 10.0), ("gone", 0.0), ("bare", 0.0)]
    want = {u: "v1" if assign(u, split) == "blue" else "v2" for u in USERS}
    assert set(want.values()) == {"v1", "v2"}  # (the table's users fall in both)
    client = Fleet(redis_server.role_url("fleet-client"))
    history: dict[str, list[str]] = {u: [] for u in USERS}
    for n in range(2):  # the 90/10 split: every user on its group's version
        got = serve_round(client, n)
        assert got == want
        for u in USERS:
            history[u].append(got[u])

    rollout(redis_server.url, process_commander, r, client, ["--weight", "50"], "blue 50, green 50")
    half = [("blue", 50.0), ("green", 50.0), ("gone", 0.0), ("bare", 0.0)]
    got = serve_round(client, 2)  # only the users between the 90 and the 50 threshold moved
    assert got == {u: "v1" if assign(u, half) == "blue" else "v2" for u in USERS}
    assert all(got[u] == "v2" for u in USERS if want[u] == "v2") and set(got.values()) == {"v1", "v2"}
    for u in USERS:
        history[u].append(got[u])

    rollout(redis_server.url, process_commander, r, client, ["--to", "100"], "blue 0, green 100")
    for n in range(3, 5):  # all on green now
        got = serve_round(client, n)
        assert set(got.values()) == {"v2"}
        for u in USERS:
            history[u].append(got[u])
    wait_until(lambda: [e for e in ledger(r, None, "rollout")
                        if "-> blue 0, green 100, gone 0, bare 0 (canary green)" in e.reason], 10,
               "the rollout to 100 in the ledger")
    steps = [e.reason.partition(" -> ")[2] for e in sorted(ledger(r, None, "rollout"), key=lambda e: e.ts)]
    assert steps == ["blue 50, green 50, gone 0, bare 0 (canary green)",
                     "blue 0, green 100, gone 0, bare 0 (canary green)"]

    rollout(redis_server.url, process_commander, r, client, ["--abort"], "blue 100, green 0")
    assert set(serve_round(client, 5).values()) == {"v1"}
    client.close()

    for u in USERS:  # every turn answered once, in order; versions moved once each way
        rows = r.lrange(keys.session(u), 0, -1)
        sessions = [decode(SessionEntry, raw if isinstance(raw, bytes) else raw.encode()).text
                    for raw in rows]
        assert sessions == [f"{u} turn {n}" for n in range(6)], (u, sessions)
        assert history[u][:2] == [want[u]] * 2 and history[u][3:] == ["v2"] * 2, (u, history[u])
        assert history[u] == sorted(history[u]), (u, history[u])  # v1 ... v2, never back before the abort
    assert read_policy(r, "chat").policy.rollout.weights()[:2] == (("blue", 100.0), ("green", 0.0))
