"""``fleet rollout`` and ``fleet group``: one-line errors with exit 2, the weights written."""

from __future__ import annotations

import fakeredis
import pytest

from fleet import cli_groups
from fleet.cli import main
from protocol.policy import parse_policy
from stores.group_assignment import user_pins
from stores.policies import read_policy, write_policy


@pytest.fixture
def r(monkeypatch: pytest.MonkeyPatch) -> fakeredis.FakeRedis:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    monkeypatch.setattr(cli_groups, "cli_client", lambda _args: client)
    return client


def run(argv: list[str]) -> int:
    """``fleet <argv>``'s exit code (argparse's usage errors exit by SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def grouped(r: fakeredis.FakeRedis) -> None:
    write_policy(r, "chat", parse_policy({"groups": [{"name": "blue", "weight": 95},
                                                     {"name": "green", "weight": 5}]}))


@pytest.mark.parametrize(("argv", "error"), [
    (["rollout", "chat", "green", "--weight", "10"], "tier 'chat' has no policy"),
    (["group", "pin", "alice", "green"], "tier 'chat' has no policy"),
    (["rollout", "chat", "green", "--weight", "150"], "must be a percentage (0..100), got 150"),
    (["rollout", "chat", "green", "--weight", "nan"], "must be a percentage"),
    (["rollout", "chat", "green"], "one of the arguments --weight --to --abort is required"),
    (["rollout", "chat", "green", "--to", "10", "--abort"], "not allowed with argument"),
    (["rollout", "Chat!", "green", "--abort"], "invalid tier"),
    (["group", "pin", "bad user", "green"], "invalid user id"),
])
def test_bad_arguments_are_one_line_and_exit_2(r: fakeredis.FakeRedis, capsys: pytest.CaptureFixture[str],
                                              argv: list[str], error: str) -> None:
    assert run(argv) == 2
    err = capsys.readouterr().err.strip()
    assert error in err and "\n" not in err


def test_a_tier_without_groups_or_an_unknown_group_is_refused(r: fakeredis.FakeRedis,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    write_policy(r, "chat", parse_policy({}))
    assert main(["rollout", "chat", "green", "--weight", "10"]) == 2
    assert "has no groups" in capsys.readouterr().err
    grouped(r)
    assert main(["rollout", "chat", "red", "--weight", "10"]) == 2
    assert "no group 'red' (groups: blue, green)" in capsys.readouterr().err
    assert main(["group", "pin", "alice", "red"]) == 2
    assert "has no group 'red'" in capsys.readouterr().err


def test_rollout_steps_write_the_weights_and_the_canary(r: fakeredis.FakeRedis) -> None:
    grouped(r)
    assert main(["rollout", "chat", "green", "--weight", "10"]) == 0
    policy = read_policy(r, "chat").policy
    assert policy.rollout.weights() == (("blue", 90.0), ("green", 10.0)) and policy.rollout.canary == "green"
    assert main(["rollout", "chat", "green", "--to", "100"]) == 0
    assert read_policy(r, "chat").policy.rollout.weights() == (("blue", 0.0), ("green", 100.0))
    assert main(["rollout", "chat", "green", "--abort"]) == 0
    assert read_policy(r, "chat").policy.rollout.weights() == (("blue", 100.0), ("green", 0.0))


def test_pin_and_unpin(r: fakeredis.FakeRedis) -> None:
    grouped(r)
    assert main(["group", "pin", "alice", "green"]) == 0
    assert user_pins(r, "alice") == {"chat": "green"}
    assert main(["group", "unpin", "alice"]) == 0
    assert user_pins(r, "alice") == {}
