"""The CLI's view of policies and commanders, through the real CLI."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from protocol import keys
from protocol.codec import encode
from protocol.models import CommanderInfo, WorkerInfo
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.helpers import fleet_cli

pytestmark = pytest.mark.integration


def _installed_answer(tmp_path: Path) -> Path:
    """A package with a ``fleet.handlers`` entry point, importable only where PYTHONPATH has it:
    the CLI's environment, not the workers'."""
    site = tmp_path / "site"
    (site / "answerpkg-0.1.dist-info").mkdir(parents=True)
    (site / "answerpkg.py").write_text("def answer(ctx):\n    return '42'\n")
    (site / "answerpkg-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: answerpkg\n"
                                                               "Version: 0.1\n")
    (site / "answerpkg-0.1.dist-info" / "entry_points.txt").write_text(
        "[fleet.handlers]\nanswer = answerpkg:answer\n")
    return site


def test_policy_set_warns_when_no_live_worker_has_the_handler(r, fleet_env, tmp_path):
    write_policy(r, "chat", TurnsPolicy())
    info = WorkerInfo(worker="chat-w1", tier="chat", pid=1, host="h", started=time.time(),
                      handlers=["echo", "noop", "sleep"])
    r.hset(keys.WORKERS, "chat-w1", encode(info))
    r.set(keys.heartbeat("chat-w1"), "1", px=60_000)
    env = dict(fleet_env, PYTHONPATH=f"{_installed_answer(tmp_path)}:{fleet_env['PYTHONPATH']}")
    out = fleet_cli(env, "policy", "set", "chat", "handler=answer", cwd=tmp_path)
    assert out.returncode == 0, out.stderr  # saved: it is valid where the CLI runs
    assert "warning: no live worker of tier chat has handler 'answer' (they have: echo, noop, sleep)" \
        in out.stderr
    assert json.loads(r.get(keys.policy("chat")))["handler"] == "answer"
    assert r.get(keys.policy_good("chat")) is None  # not the last good one until a worker accepts it
    out = fleet_cli(env, "policy", "set", "chat", "handler=sleep", cwd=tmp_path)
    assert out.returncode == 0 and "warning" not in out.stderr


def test_status_and_policy_get_show_the_workers_rejection(r, fleet_env, tmp_path):
    """The CLI may have the handler; the workers' recorded verdict is what counts."""
    write_policy(r, "chat", TurnsPolicy())
    r.hset(keys.policy_status("chat"), mapping={
        "ok": "0", "source": "last-good", "by": "worker chat-w1", "ts": "1",
        "error": "handler: 'answer' is not registered (known: echo, noop, sleep)"})
    got = fleet_cli(fleet_env, "policy", "get", "chat", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert "REJECTED edit of fleet:policy:{chat} by worker chat-w1: handler: 'answer'" in got.stdout
    status = fleet_cli(fleet_env, "status", cwd=tmp_path)
    assert "REJECTED by worker chat-w1: handler: 'answer'" in status.stdout, status.stdout
    data = json.loads(fleet_cli(fleet_env, "status", "--json", cwd=tmp_path).stdout)
    assert data["tiers"]["chat"]["policy_rejected_by"] == "worker chat-w1"


def test_a_dead_commander_is_not_listed_as_leader(r, fleet_env, tmp_path):
    now = time.time()
    r.hset(keys.COMMANDERS, "cmd-old", encode(CommanderInfo(
        commander="cmd-old", pid=11, host="h1", started=now - 600, role="leader", epoch=3,
        metrics="127.0.0.1:9", seen=now - 120)))
    r.hset(keys.COMMANDERS, "cmd-new", encode(CommanderInfo(
        commander="cmd-new", pid=12, host="h1", started=now - 60, role="leader", epoch=4,
        metrics="127.0.0.1:9464", seen=now)))
    r.set(keys.LEADER, "cmd-new|4", px=60_000)
    out = fleet_cli(fleet_env, "status", cwd=tmp_path)
    first = out.stdout.splitlines()[0]
    assert first.startswith("commander: cmd-new leads (epoch 4), metrics http://127.0.0.1:9464/metrics")
    assert "cmd-old gone (last seen 12" in first and "cmd-old leader" not in first, first
    data = json.loads(fleet_cli(fleet_env, "status", "--json", cwd=tmp_path).stdout)
    by_id = {c["commander"]: c for c in data["commanders"]}
    assert by_id["cmd-old"]["alive"] is False and by_id["cmd-new"]["alive"] is True
    assert by_id["cmd-new"]["metrics_url"] == "http://127.0.0.1:9464/metrics"
    assert by_id["cmd-new"]["monitor_url"] == data["monitor_url"] == "http://127.0.0.1:9464/"
    assert ", monitor http://127.0.0.1:9464/" in first
