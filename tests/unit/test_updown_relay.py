"""``fleet up``'s relay: started whenever the rq extra is installed, kept across a resumed
``up``, and reported (or its absence) in one line."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from fleet import local, updown


def test_without_the_rq_extra_no_relay_is_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(updown.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(local, "spawn_detached", lambda *a, **k: pytest.fail("spawned"))
    assert updown._start_relay({}, {"REDIS_URL": "redis://127.0.0.1:1/0"}) is None


def test_a_resumed_up_keeps_the_live_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "spawn_detached", lambda *a, **k: pytest.fail("spawned"))
    monkeypatch.setattr(updown, "_alive", lambda part: part is not None)
    kept = {"pid": 123, "create_time": 1.0}
    assert updown._start_relay({"relay": kept}, {"REDIS_URL": "redis://127.0.0.1:1/0"}) == kept


def test_with_the_extra_a_dead_relay_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    spawned: list[list[str]] = []

    def spawn(argv: list[str], log_name: str, env: dict[str, str] | None = None) -> int:
        spawned.append(argv)
        assert log_name == "relay.log" and env is not None and env["REDIS_URL"] == "redis://h:1/0"
        return 4242

    monkeypatch.setattr(local, "spawn_detached", spawn)
    monkeypatch.setattr(updown, "_alive", lambda part: False)
    assert updown._start_relay({"relay": {"pid": 1}}, {"REDIS_URL": "redis://h:1/0"})["pid"] == 4242
    assert spawned and spawned[0][-2:] == ["fleet.cli", "relay"]


@pytest.mark.parametrize(("flag", "env", "want"), [
    (None, None, None), ("redis://rq:2/0", None, "redis://rq:2/0"),
    (None, "redis://rq:3/0", "redis://rq:3/0"), ("redis://rq:2/0", "redis://rq:3/0", "redis://rq:2/0"),
])
def test_up_passes_rqs_redis_to_the_commander_and_the_relay(
        monkeypatch: pytest.MonkeyPatch, flag: str | None, env: str | None, want: str | None) -> None:
    monkeypatch.delenv("FLEET_RQ_URL", raising=False)
    if env:
        monkeypatch.setenv("FLEET_RQ_URL", env)
    args = argparse.Namespace(**({"rq_url": flag} if flag else {}))
    got = updown._urls_env("redis://h:1/0", args)
    assert got == {"REDIS_URL": "redis://h:1/0", **({"FLEET_RQ_URL": want} if want else {})}


@pytest.mark.parametrize(("relay", "line"), [
    ({"pid": 7, "log": "/x/relay.log"}, "  relay       pid 7 (log /x/relay.log)"),
    (None, "  relay       not started: the rq extra is not installed (no deferred jobs)"),
])
def test_up_says_whether_a_relay_runs(capsys: pytest.CaptureFixture[str], relay: Any, line: str) -> None:
    updown._print({"status": "up", "home": "/h", "url": "redis://h:1/0", "redis": {},
                   "commander": {"pid": 1, "log": "/x/commander.log"}, "relay": relay, "workers": []}, False)
    assert line in capsys.readouterr().out.splitlines()
