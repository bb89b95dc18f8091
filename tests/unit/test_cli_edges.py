"""Edges of the client and the CLI that need no server: size limits, argument checks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import fakeredis
import pytest

from fleet.cli import build_parser
from fleet.client import AsyncFleet, Fleet, TurnTooLarge
from protocol.models import MAX_TEXT_CHARS
from protocol.policy import TurnsPolicy
from stores.policies import write_policy


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


def test_text_over_the_limit_is_turn_too_large_with_the_limit_and_nothing_written(server) -> None:
    r = fakeredis.FakeRedis(server=server)
    write_policy(r, "chat", TurnsPolicy())
    client = Fleet(client=r)
    client.submit("alice", "x" * MAX_TEXT_CHARS)  # at the limit: accepted
    before = sorted(r.keys("*"))
    with pytest.raises(TurnTooLarge, match="32000 characters") as caught:
        client.submit("bob", "x" * (MAX_TEXT_CHARS + 1))
    assert isinstance(caught.value, ValueError)
    assert sorted(r.keys("*")) == before  # nothing written


def test_async_fleet_raises_turn_too_large_too(server) -> None:
    async def go() -> None:
        client = AsyncFleet(client=fakeredis.FakeAsyncRedis(server=server))
        with pytest.raises(TurnTooLarge, match="32000 characters"):
            await client.submit("bob", "y" * (MAX_TEXT_CHARS + 1), create_tier=True)
        await client.aclose()

    asyncio.run(go())


def test_the_turn_too_large_message_names_the_size_limit_too() -> None:
    client = Fleet(client=fakeredis.FakeRedis(), max_turn_bytes=300)
    with pytest.raises(TurnTooLarge, match="over the limit of 300 bytes"):
        client.submit("alice", "hi", meta={"pad": "x" * 400})


@pytest.mark.parametrize("argv", [
    ["top", "--interval", "0"],
    ["top", "--interval", "-1"],
    ["top", "--interval", "soon"],
    ["events", "--count", "-1"],
    ["dead-letters", "--count", "-5"],
    ["submit", "--user", "a", "--timeout", "-1", "hi"],
    ["worker"],
])
def test_bad_numbers_and_a_missing_tier_are_usage_errors(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_every_option_of_events_and_top_has_help_text() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("events", "top", "status", "dead-letters", "worker", "submit", "chat"):
        for action in sub.choices[name]._actions:  # type: ignore[attr-defined]
            assert action.help, (name, action.dest)


# --- the docs say what the CLI and the client do ----------------------------------------------
def _docs_section(page: str, title: str | None = None) -> str:
    """A page of the docs site, or its section ``## title``."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "guide" / page).read_text()
    return text if title is None else text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_cli_page_lists_every_command_and_built_in_handler() -> None:
    from worker import handlers

    built_in = [name for name in handlers.registered_names()  # (not the ones tests register)
                if handlers.get(name).__module__ == handlers.__name__]
    cli = _docs_section("cli.md")
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    missing = [name for name in sub.choices if f"`fleet {name}" not in cli]  # type: ignore[union-attr]
    assert not missing, missing
    assert built_in and not [h for h in built_in if f"`{h}`" not in cli]


def test_the_client_page_documents_async_wait_and_every_size_limit() -> None:
    from fleet.client import DEFAULT_MAX_REPLY_BYTES, DEFAULT_MAX_TURN_BYTES
    from protocol.ids import USER_ID_MAX
    from worker.settings import WorkerSettings

    assert "await fleet.wait(user, turn.turn_id" in _docs_section("client.md")
    limits = _docs_section("client.md", "Limits")
    worker = WorkerSettings()
    assert f"{MAX_TEXT_CHARS:,} characters" in limits
    assert f"{DEFAULT_MAX_TURN_BYTES:,} bytes" in limits and worker.max_turn_bytes == DEFAULT_MAX_TURN_BYTES
    assert f"{worker.max_reply_bytes:,} bytes" in limits and DEFAULT_MAX_REPLY_BYTES == 1024 * 1024
    assert f"1–{USER_ID_MAX} characters" in limits
    assert f"{worker.session_max} turns, the newest {worker.context_turns}" in limits


def test_the_cli_imports_the_replay_driver_only_for_fleet_replay() -> None:
    """`fleet replay` runs the scaling benchmark's library (sim.scaling): building the parser,
    and any other command, must not import it (tests/unit/test_layers.py allows this one
    import only because it is deferred)."""
    import subprocess
    import sys

    probe = ("import sys; from fleet.cli import build_parser; p = build_parser(); "
             "p.parse_args(['status']); print(any(m == 'sim' or m.startswith('sim.') for m in sys.modules)); "
             "p.parse_args(['replay', '--help'])")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.stdout.splitlines()[0] == "False", run.stdout + run.stderr
    assert "replay" in run.stdout


@pytest.mark.parametrize(("argv", "says"), [
    (["relay", "--batch", "0"], "fleet relay: --batch:"),
    (["relay", "--batch", "many"], "invalid int value"),
    (["rq-worker", "--queues", ","], "fleet rq-worker: --queues names no queue"),
    (["rq-worker", "--queues", "Bad Queue"], "fleet rq-worker: invalid queue"),
    (["jobs", "requeue"], "fleet jobs: name the job ids to requeue, or --all"),
    (["jobs", "requeue", "x", "--all"], "fleet jobs: name the job ids to requeue, or --all"),
    (["jobs", "failed", "--count", "-1"], "--count"),
])
def test_the_async_tier_commands_refuse_bad_arguments_in_one_line(argv: list[str], says: str, capsys) -> None:
    from fleet.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and says in err and err.count("\n") == 1, err
