"""The `fleet` command as a person uses it: up, submit, policy, status, down; nothing left behind."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from protocol import keys
from tests.helpers import fleet_cli

pytestmark = pytest.mark.integration


def descendants_of_fleet(home: Path) -> list[psutil.Process]:
    """Processes whose command line points into this test's FLEET_HOME (workers log there)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if str(home) in cmd:
            found.append(proc)
    return found


def test_up_submit_policy_status_down_leaves_no_process(fleet_env, tmp_path, redis_server):
    env = dict(fleet_env)
    del env["REDIS_URL"]  # fleet up brings its own redis-server under FLEET_HOME
    home = Path(env["FLEET_HOME"])
    up = fleet_cli(env, "up", "--json", cwd=tmp_path)
    state = json.loads((home / "state.json").read_text()) if (home / "state.json").exists() else {}
    try:
        assert up.returncode == 0, up.stderr
        first = fleet_cli(env, "submit", "--user", "alice", "my", "cat", "is", "Tom", cwd=tmp_path)
        assert first.returncode == 0, first.stderr
        assert first.stdout.strip() == "echo: my cat is Tom"
        second = fleet_cli(env, "submit", "--user", "alice", "--json", "and", "now?", cwd=tmp_path)
        reply = json.loads(second.stdout)
        assert reply["ok"] and reply["context"]["session_turns"] == 1

        chat = fleet_cli(env, "chat", "--user", "bob", cwd=tmp_path, stdin="one\ntwo\n\n")
        assert chat.returncode == 0
        assert chat.stdout.splitlines() == ["echo: one", "echo: two | previous: one | memory: said: one"]

        bad = fleet_cli(env, "policy", "set", "chat", "min_workers=5", "max_workers=2", cwd=tmp_path)
        assert bad.returncode != 0 and bad.stderr.count("\n") == 1
        assert "min_workers (5) > max_workers (2)" in bad.stderr
        got = json.loads(fleet_cli(env, "policy", "get", "chat", "--json", cwd=tmp_path).stdout)
        assert got["policy"]["min_workers"] == 1 and got["policy"]["max_workers"] == 8  # unchanged

        bad_user = fleet_cli(env, "submit", "--user", "no{pe}", "hi", cwd=tmp_path)
        assert bad_user.returncode == 2 and "invalid user id" in bad_user.stderr

        status = json.loads(fleet_cli(env, "status", "--json", cwd=tmp_path).stdout)
        assert status["tiers"]["chat"]["workers_alive"] == 1
        assert status["tiers"]["chat"]["backlog"] == 0
        pids = [state["commander"]["pid"], state["redis"]["pid"],
                *(w["pid"] for w in status["workers"])]
        assert all(psutil.pid_exists(p) for p in pids)
    finally:
        down = fleet_cli(env, "down", cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not [p for p in descendants_of_fleet(home) if p.status() != "zombie"]
    assert not (home / "state.json").exists()


def test_cli_errors_are_one_line(fleet_env, tmp_path):
    for args in (["submit", "hi"], ["policy", "set", "chat", "nosuchfield=1"], ["bogus"],
                 ["policy", "set", "chat", "handler=os.system"]):
        out = fleet_cli(fleet_env, *args, cwd=tmp_path)
        assert out.returncode != 0, args
        assert out.stderr.count("\n") == 1, (args, out.stderr)


@pytest.mark.acl_denials  # the client role's tier check is refused the registry (one ACL LOG entry)
def test_a_tier_that_runs_nowhere_is_refused_unless_created(fleet_env, tmp_path, r):
    for args in (["submit", "--user", "alice", "--tier", "nosuchtier", "hi"],
                 ["chat", "--user", "alice", "--tier", "nosuchtier"]):
        out = fleet_cli(fleet_env, *args, cwd=tmp_path, stdin="hi\n")
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert "no tier 'nosuchtier'" in out.stderr and "--create-tier" in out.stderr
    assert r.keys("*") == []  # nothing submitted, nothing created

    made = fleet_cli(fleet_env, "submit", "--user", "alice", "--tier", "nosuchtier", "--create-tier",
                     "--timeout", "0.5", "hi", cwd=tmp_path)
    assert made.returncode == 3, made.stderr  # created and queued: no worker runs here to answer
    assert r.exists(keys.policy("nosuchtier")) and b"nosuchtier" in r.smembers(keys.TIERS)
    assert r.xlen(keys.inbox("alice")) == 1 and r.xlen(keys.ready("nosuchtier")) == 1


def test_embedded_fallback_when_there_is_no_redis_server(fleet_env, tmp_path):
    env = dict(fleet_env, PATH=str(tmp_path / "empty-bin"))  # no redis-server to be found
    del env["REDIS_URL"]
    up = fleet_cli(env, "up", cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stderr
        assert "NOTHING IS DURABLE" in up.stdout + up.stderr
        for text, want in (("hi", "echo: hi"), ("again", "echo: again | previous: hi")):
            out = fleet_cli(env, "submit", "--user", "emma", text, cwd=tmp_path)
            assert out.returncode == 0, out.stderr
            assert out.stdout.startswith(want)
    finally:
        down = fleet_cli(env, "down", cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert not [p for p in descendants_of_fleet(Path(env["FLEET_HOME"])) if p.status() != "zombie"]
