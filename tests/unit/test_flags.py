"""The worker's and the commander's flags are derived from their settings (protocol/flags.py):
the settings each lists in ``FLAGS``; every other setting is environment only."""

from __future__ import annotations

import argparse

import pytest

from commander.__main__ import add_arguments as add_commander_arguments
from commander.__main__ import settings_from
from commander.settings import CommanderSettings
from fleet.cli import build_parser
from protocol.flags import Parser, settings_from_flags
from worker.__main__ import parse_args as worker_args
from worker.settings import WorkerSettings

# the flags scripts, tests, docs and the commander's runtime use: they must keep working
KEPT_WORKER = ["--tier", "--worker-id", "--redis-url", "--log-level"]
KEPT_COMMANDER = ["--redis-url", "--commander-id", "--interval", "--spawn-mode", "--log-dir",
                  "--metrics-host", "--metrics-port", "--no-metrics", "--stop-workers-on-exit",
                  "--log-level"]


def _commander_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fleet commander")
    add_commander_arguments(p, redis_url=True)
    return p


def _flags(p: argparse.ArgumentParser) -> dict[str, str]:
    return {opt: a.dest for a in p._actions for opt in a.option_strings if opt not in ("-h", "--help")}


def test_the_listed_settings_are_flags_and_the_old_flag_names_are_kept() -> None:
    from worker.__main__ import add_arguments

    wp = Parser(prog="w")
    add_arguments(wp)
    worker = _flags(wp)
    assert set(worker.values()) == set(WorkerSettings.FLAGS)
    assert set(KEPT_WORKER) <= set(worker)
    commander = _flags(_commander_parser())
    assert set(commander.values()) == set(CommanderSettings.FLAGS)
    assert set(KEPT_COMMANDER) <= set(commander)
    assert "metrics_token" not in CommanderSettings.FLAGS  # a secret: a command line shows in ps


def test_a_setting_that_is_no_flag_is_read_from_the_environment(monkeypatch, capsys) -> None:
    monkeypatch.setenv("FLEET_WORKER_BATCH", "3")
    got = settings_from_flags(WorkerSettings, worker_args(["--tier", "vip"]), "w")
    assert got is not None and (got.tier, got.batch) == ("vip", 3)
    with pytest.raises(SystemExit):
        worker_args(["--batch", "3"])
    assert "unrecognized arguments: --batch" in capsys.readouterr().err


def test_flags_override_the_environment_which_overrides_the_defaults(monkeypatch) -> None:
    monkeypatch.setenv("FLEET_WORKER_BATCH", "7")
    monkeypatch.setenv("FLEET_WORKER_TIER", "vip")
    got = settings_from_flags(WorkerSettings, worker_args(["--tier", "gold", "--worker-id", "w1"]), "w")
    assert got is not None and (got.tier, got.worker_id, got.batch) == ("gold", "w1", 7)
    got = settings_from_flags(WorkerSettings, worker_args([]), "w")
    assert got is not None and got.tier == "vip" and got.worker_id.startswith("vip-")


def test_the_commander_switches_and_renamed_flags() -> None:
    s = settings_from(_commander_parser().parse_args(
        ["--no-metrics", "--stop-workers-on-exit", "--interval", "0.2", "--spawn-mode", "exec"]))
    assert s is not None
    assert (s.metrics_port, s.stop_workers_on_exit, s.interval_s, s.spawn_mode) == (None, True, 0.2, "exec")
    s = settings_from(_commander_parser().parse_args([]))
    assert s is not None and (s.metrics_port, s.stop_workers_on_exit, s.interval_s) == (9464, False, 0.5)


def test_fleet_worker_and_commander_take_the_fleet_redis_url() -> None:
    args = build_parser().parse_args(["--redis-url", "redis://h:1/0", "worker", "--tier", "vip",
                                      "--group", "green"])
    got = settings_from_flags(WorkerSettings, args, "fleet worker")
    assert got is not None and (got.redis_url, got.tier, got.group) == ("redis://h:1/0", "vip", "green")
    args = build_parser().parse_args(["--redis-url", "redis://h:1/0", "commander", "--commander-id", "c1"])
    got = settings_from(args)
    assert got is not None and (got.redis_url, got.commander_id) == ("redis://h:1/0", "c1")


@pytest.mark.parametrize("argv", [["--health-port", "x"], ["--log-level", "LOUD"], ["--nope"]])
def test_a_bad_worker_flag_is_one_line_and_exit_2(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        worker_args(argv)
    assert caught.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize(("argv", "env", "says"), [
    ([], {"FLEET_WORKER_BATCH": "0"}, "batch: Input should be greater than or equal to 1"),
    (["--tier", "BAD!"], {}, "tier: Value error, invalid tier"),
    ([], {"FLEET_WORKER_RENEW_INTERVAL_S": "10"}, "settings: Value error, reclaim_idle_ms must exceed"),
])
def test_an_invalid_worker_value_is_one_line(argv: list[str], env: dict[str, str], says: str,
                                             monkeypatch, capsys) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert settings_from_flags(WorkerSettings, worker_args(argv), "fleet worker") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fleet worker: ") and says in err


def test_an_invalid_commander_value_is_one_line(capsys) -> None:
    assert settings_from(_commander_parser().parse_args(["--interval", "0"])) is None
    err = capsys.readouterr().err
    assert err == "fleet commander: interval_s: Input should be greater than 0\n"
