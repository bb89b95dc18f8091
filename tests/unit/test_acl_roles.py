"""The ACL roles as data (protocol.acl), their passwords (stores.roles) and ``fleet acl``.

What each role may do is proven against a real server in tests/integration/test_acl_roles.py;
here: the patterns come from the key builders, the file is what Redis loads, the passwords
never reach the file or the output unless asked, and files holding them are 0600.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from fleet.cli import main
from protocol import keys
from protocol.acl import ROLE_NAMES, ROLES, SCRIPTING, USER, acl_file, password_hash, pattern, role
from stores.roles import (
    ADMIN,
    PasswordsFileError,
    as_role,
    ensure_passwords,
    password_env,
    read_passwords,
    with_credentials,
)


def test_patterns_are_the_key_builders_with_stars() -> None:
    assert pattern(keys.inbox, USER) == "fleet:u:{*}:inbox"
    assert pattern(keys.reply, USER, "ACLXTOKEN") == "fleet:u:{*}:reply:*"
    assert pattern(keys.ready, "aclxtier") == "fleet:{*}:ready"
    assert pattern(keys.ready, "aclxtier", 1) == "fleet:{*}:ready"  # the shards share the glob
    assert pattern(keys.heartbeat, "aclxworker") == "fleet:w:{*}:hb"


def test_every_role_is_one_line_with_the_password_hashed() -> None:
    passwords = {name: f"pw-{name}" for name in ROLE_NAMES}
    text = acl_file(passwords)
    lines = text.splitlines()
    assert lines[0] == "user default off resetkeys resetchannels -@all"
    assert [line.split()[1] for line in lines[1:]] == list(ROLE_NAMES)
    for line, name in zip(lines[1:], ROLE_NAMES, strict=True):
        assert f"#{password_hash(f'pw-{name}')}" in line
        assert f"pw-{name}" not in line
        assert " -@all " in line and "+@all" not in line
    admin = acl_file(passwords, default="adm").splitlines()[0]
    assert admin == f"user default on #{password_hash('adm')} ~* &* +@all"


@pytest.mark.parametrize("name", ROLE_NAMES)
def test_no_role_may_run_admin_or_arbitrary_code(name: str) -> None:
    rules = role(name).rules().split()
    for forbidden in ("+eval", "+script", "+function", "+flushall", "+flushdb", "+config", "+keys", "+acl",
                      "+shutdown", "+debug", "+@all", "+@dangerous", "+@admin", "+@scripting", "+module"):
        assert forbidden not in rules, f"{name} grants {forbidden}"
    assert not any(r.startswith(("+evalsha", "+script", "+function")) for r in rules), rules
    # every role calls Fleet's functions but the relay, which calls none
    assert (set(SCRIPTING.split()) <= set(rules)) == (name != "fleet-relay")


def test_the_client_role_touches_only_the_documented_keys() -> None:
    client = role("fleet-client")
    writable = {k.glob for k in client.keys if k.access == ""}
    # (state and done: the keys of the cancel function, which records a cancel in the state hash)
    assert writable == {"fleet:u:{*}:inbox", "fleet:{*}:ready", "fleet:{*}:active", "fleet:{*}:pressure",
                        "fleet:u:{*}:reply:*", "fleet:{*}:starting", "fleet:u:{*}:state", "fleet:u:{*}:done"}
    # a cancel tells the lane's holder on its cancels stream (never its control stream): write
    # only; the lane: read only
    assert {k.glob: k.access for k in client.keys if ":w:" in k.glob or k.glob.endswith(":lane")} == {
        "fleet:w:{*}:cancels": "W", "fleet:u:{*}:lane": "R"}
    assert not any(k.glob in (keys.WORKERS, f"{keys.PREFIX}:*") for k in client.keys)
    assert "scan" not in client.commands and "set" not in client.commands


def test_role_password_env_names() -> None:
    assert password_env("fleet-client") == "FLEET_ACL_PASSWORD_CLIENT"
    assert password_env("fleet-operator") == "FLEET_ACL_PASSWORD_OPERATOR"
    assert password_env(ADMIN) == "FLEET_ACL_PASSWORD_ADMIN"


def test_passwords_come_from_the_environment_else_the_file_else_are_generated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sub" / "acl-passwords"
    monkeypatch.setenv("FLEET_ACL_PASSWORD_WORKER", "from-env")
    first = ensure_passwords(path)
    assert first["fleet-worker"] == "from-env"
    assert set(first) == {*ROLE_NAMES, ADMIN} and len(set(first.values())) == len(first)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_passwords(path) == first
    monkeypatch.delenv("FLEET_ACL_PASSWORD_WORKER")
    assert ensure_passwords(path) == first  # kept, not generated again


def test_a_bad_passwords_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "acl-passwords"
    path.write_text("[1, 2]")
    with pytest.raises(PasswordsFileError, match="role -> password"):
        read_passwords(path)


def test_a_url_as_a_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert with_credentials("redis://old:x@h:1/0", "fleet-client", "p/w") == "redis://fleet-client:p%2Fw@h:1/0"
    assert with_credentials("rediss://h:1/0?ssl_ca_certs=/a", "u", "p") == "rediss://u:p@h:1/0?ssl_ca_certs=/a"
    monkeypatch.delenv("FLEET_ACL_PASSWORD_CLIENT", raising=False)
    nowhere = tmp_path / "none"
    assert as_role("redis://h:1/0", "fleet-client", nowhere) == "redis://h:1/0"  # no password: as given
    monkeypatch.setenv("FLEET_ACL_PASSWORD_CLIENT", "s3cret")
    assert as_role("redis://h:1/0", "fleet-client", nowhere) == "redis://fleet-client:s3cret@h:1/0"


def test_fleet_acl_prints_the_file_and_never_the_passwords(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in (*ROLE_NAMES, ADMIN):
        monkeypatch.delenv(password_env(name), raising=False)
    pwfile = tmp_path / "pw"
    assert main(["acl", "--passwords", str(pwfile)]) == 0
    out = capsys.readouterr().out
    passwords = json.loads(pwfile.read_text())
    assert out == acl_file(passwords, default=passwords[ADMIN])
    assert not any(pw in out for pw in passwords.values())
    assert "rq:" not in out  # RQ's rights only with --rq
    assert main(["acl", "--passwords", str(pwfile), "--rq"]) == 0
    shared = capsys.readouterr().out
    assert shared == acl_file(passwords, default=passwords[ADMIN], shared_with_rq=True)
    assert [line.split()[1] for line in shared.splitlines() if "(~rq:* " in line] == [
        "fleet-worker", "fleet-commander", "fleet-relay", "fleet-operator"]

    acl = tmp_path / "users.acl"
    assert main(["acl", "--passwords", str(pwfile), "--out", str(acl), "--no-admin"]) == 0
    assert str(acl) in capsys.readouterr().out
    assert acl.read_text() == acl_file(passwords)
    assert stat.S_IMODE(acl.stat().st_mode) == 0o600

    assert main(["acl", "--passwords", str(pwfile), "--show-passwords"]) == 0
    shown = dict(line.split(" ", 1) for line in capsys.readouterr().out.splitlines())
    assert shown == passwords


def test_fleet_acl_table_names_every_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["acl", "--table"]) == 0
    out = capsys.readouterr().out
    assert [line.split("`")[1] for line in out.splitlines()[2:]] == [r.name for r in ROLES]


def test_the_security_page_shows_the_roles_fleet_acl_prints() -> None:
    from fleet.cli_acl import roles_table

    page = (Path(__file__).resolve().parents[2] / "docs" / "operations" / "security.md").read_text()
    start = page.index("<!-- roles: generated")
    block = page[page.index("\n", start) + 1:page.index("<!-- /roles -->")]
    assert block == roles_table(), "docs/operations/security.md's roles are stale: paste `fleet acl --table`"
