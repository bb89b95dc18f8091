"""What a group may run is the commander's allow-list (``group_runtimes``), never the policy's; the
check of an allowed interpreter runs off the pass, bounded in time and output, even for a hostile
binary the operator configured; the spawn proof a worker carries, and its private file."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from pydantic import ValidationError

from commander.group_runtimes import GroupRuntime, resolve
from commander.runtime.interface import CHECK_PENDING
from commander.runtime.process.interpreters import OUTPUT_LIMIT, PENDING, Interpreters, run_check
from commander.runtime.process.proof import PROOF_ENV, PROOF_FILE, Proof, load_secret, proof_of
from commander.settings import CommanderSettings
from protocol.groups import Group
from tests.helpers import running, wait_until
from tests.unit.commander_helpers import RecordingRuntime

ALLOWED = {"py312": GroupRuntime(python="/opt/py312/bin/python"), "gpu": GroupRuntime(image="reg/x:1.2"),
           "both": GroupRuntime(python="/opt/b/bin/python", image="reg/b:1")}


def test_the_allow_list_is_read_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_COMMANDER_GROUP_RUNTIMES", '{"py312": {"python": "/opt/py312/bin/python"}, '
                       '"gpu": {"image": "registry/x:1.2"}}')
    got = CommanderSettings(commander_id="c").group_runtimes
    assert got == {"py312": GroupRuntime(python="/opt/py312/bin/python"),
                   "gpu": GroupRuntime(image="registry/x:1.2")}
    assert CommanderSettings(commander_id="c", lease_ttl_ms=3000).check_timeout_s() < 3.0


@pytest.mark.parametrize(("runtimes", "error"), [
    ({"py": {"python": "bin/python"}}, "not an absolute interpreter path"),
    ({"py": {}}, "gives a `python`, an `image`, or both"),
    ({"Py 3": {"python": "/usr/bin/python3"}}, "invalid runtime name"),
    ({"py": {"python": "/usr/bin/python3", "cmd": "x"}}, "cmd"),
])
def test_a_bad_allow_list_is_a_settings_error(runtimes: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        CommanderSettings(commander_id="c", group_runtimes=runtimes)


@pytest.mark.parametrize(("runtime", "need", "value", "why"), [
    (None, "python", None, None),  # no runtime: the tier's own
    ("py312", "python", "/opt/py312/bin/python", None),
    ("gpu", "image", "reg/x:1.2", None),
    ("both", "image", "reg/b:1", None),
    ("gpu", "python", None, "group green of tier chat: runtime 'gpu' gives no interpreter (`python`) "
                            "for the process runtime"),
    ("py312", "image", None, "runtime 'py312' gives no image (`image`) for the kubernetes runtime"),
    ("miner", "image", None, "group green of tier chat names runtime 'miner', which this commander does "
                             "not allow (its FLEET_COMMANDER_GROUP_RUNTIMES names: both, gpu, py312)"),
])
def test_a_group_runtime_name_resolves_only_through_the_allow_list(
        runtime: str | None, need: Any, value: str | None, why: str | None) -> None:
    got_value, got_why = resolve(ALLOWED, "chat", Group(name="green", weight=1, runtime=runtime), need)
    assert got_value == value
    assert (got_why is None) == (why is None) and (why is None or why in (got_why or ""))


def test_with_no_allow_list_every_runtime_name_is_refused() -> None:
    _, why = resolve({}, "chat", Group(name="green", weight=1, runtime="py312"), "python")
    assert why is not None and why.endswith("names: none)")


# --- the interpreter check: off the pass, bounded ------------------------------------------
def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def verdict(interpreters: Interpreters, python: str, timeout: float = 30) -> str | None:
    """Ask until the check's verdict is in; each ask must answer at once."""
    def asked() -> tuple[str | None] | None:
        started = time.monotonic()
        why = interpreters.check(python, "echo")
        assert time.monotonic() - started < 0.2, "the check was waited for"
        return None if why == PENDING else (why,)
    answer = wait_until(asked, timeout, f"the verdict on {python}")
    assert isinstance(answer, tuple)
    return answer[0]


def test_an_interpreter_writing_forever_is_cut_off_without_growing_the_commander(tmp_path: Path) -> None:
    loud = script(tmp_path, "loud-python", "exec yes 'hostile output'")  # (GNU yes itself refuses -c)
    interpreters = Interpreters(None, {}, tmp_path, fork=False, timeout_s=20.0)
    rss = psutil.Process().memory_info().rss
    started = time.monotonic()
    try:
        why = verdict(interpreters, loud)
    finally:
        interpreters.close()
    assert why == f"interpreter {loud} cannot load handler 'echo' (exit 125): more than " \
                  f"{OUTPUT_LIMIT} bytes of output"
    assert time.monotonic() - started < 10  # cut at the limit, not at the timeout
    assert psutil.Process().memory_info().rss - rss < 32 * 2**20


def test_an_interpreter_that_never_answers_is_killed_at_the_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    slow = script(tmp_path, "slow-python", f"echo $$ > {pid_file}\nexec sleep 600")
    interpreters = Interpreters(None, {}, tmp_path, fork=False, timeout_s=0.5)
    try:
        why = verdict(interpreters, slow)
    finally:
        interpreters.close()
    assert why == f"interpreter {slow} cannot load handler 'echo' (exit 124): no answer in 0.5s"
    assert not running(int(pid_file.read_text()))  # killed, not left behind


def test_a_verdict_is_kept_and_a_recheck_runs_in_the_background(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def runner(argv: list[str], env: Any, timeout_s: float) -> tuple[int, str]:
        calls.append(argv)
        return 0, "ok"

    now = [0.0]
    interpreters = Interpreters(None, {}, tmp_path, fork=False, runner=runner, recheck_s=30,
                                clock=lambda: now[0])
    try:
        assert interpreters.check(sys.executable, "echo") == PENDING
        assert verdict(interpreters, sys.executable) is None and len(calls) == 1
        now[0] = 31.0  # stale: checked again, the old verdict answers meanwhile
        assert interpreters.check(sys.executable, "echo") is None
        wait_until(lambda: len(calls) == 2, 10, "the recheck")
    finally:
        interpreters.close()


def test_run_check_returns_the_last_line_of_a_short_output() -> None:
    code, out = run_check([sys.executable, "-c", "print('a'); print('ok')"], dict(os.environ), 30)
    assert (code, out) == (0, "ok")
    code, out = run_check(["/nonexistent/python"], {}, 1)
    assert code == 127 and "FileNotFoundError" in out


# --- the spawn proof ------------------------------------------------------------------------
def test_the_spawn_proof_is_private_kept_across_restarts_and_repaired(tmp_path: Path) -> None:
    secret = load_secret(tmp_path)
    path = tmp_path / PROOF_FILE
    assert len(secret) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_secret(tmp_path) == secret  # the next commander of this run dir: the same
    path.chmod(0o644)
    assert load_secret(tmp_path) == secret and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("short\n")
    fresh = load_secret(tmp_path)
    assert fresh != secret and len(fresh) == 64 and load_secret(tmp_path) == fresh


class _Env:
    def __init__(self, env: dict[str, str] | Exception) -> None:
        self._env = env

    def environ(self) -> dict[str, str]:
        if isinstance(self._env, Exception):
            raise self._env
        return self._env


@pytest.mark.parametrize(("env", "proof"), [
    ({PROOF_ENV: "s" * 64}, Proof.PROVEN),
    ({PROOF_ENV: "t" * 64}, Proof.WRONG),
    ({"PATH": "/bin"}, Proof.MISSING),
    (psutil.AccessDenied(1), Proof.UNREADABLE),  # another user's process: its environ is closed
    (psutil.NoSuchProcess(1), Proof.UNREADABLE),
])
def test_a_process_proves_it_is_ours_only_by_the_secret_it_carries(env: Any, proof: Proof) -> None:
    assert proof_of(_Env(env), "s" * 64) is proof  # type: ignore[arg-type]


def test_this_process_carries_no_proof() -> None:
    assert proof_of(psutil.Process(), "s" * 64) is Proof.MISSING


class _Exec:
    """A process whose exec is in progress: its parent's environment for the first reads."""

    def __init__(self, stale_reads: int) -> None:
        self.reads, self.stale = 0, stale_reads

    def environ(self) -> dict[str, str]:
        self.reads += 1
        return {} if self.reads <= self.stale else {PROOF_ENV: "s" * 64}


def test_a_process_just_started_is_given_a_moment_to_show_its_proof() -> None:
    assert proof_of(_Exec(3), "s" * 64, wait_s=5.0) is Proof.PROVEN  # type: ignore[arg-type]
    assert proof_of(_Exec(3), "s" * 64) is Proof.MISSING  # type: ignore[arg-type]  # (no wait: one look)


def test_a_check_in_progress_keeps_the_recorded_verdict() -> None:
    import fakeredis

    from commander.rollouts.rejection import GroupChecks
    from stores.group_assignment import reject_group, rejected_groups

    r = fakeredis.FakeRedis()
    reject_group(r, "chat", "green", "interpreter /opt/v/bin/python is missing")  # a former leader's verdict
    recorded: list[tuple[str, str]] = []

    class Ledger:
        def record(self, tier: str, action: str, **_: Any) -> None:
            recorded.append((tier, action))

    checking = RecordingRuntime()
    checking.broken["chat.green"] = CHECK_PENDING
    checks = GroupChecks(r, checking, Ledger())  # type: ignore[arg-type]
    assert checks.rejected("chat.green") == "interpreter /opt/v/bin/python is missing"  # kept meanwhile
    assert rejected_groups(r, "chat") == {"green": "interpreter /opt/v/bin/python is missing"}
    assert not recorded
    fresh = GroupChecks(fakeredis.FakeRedis(), checking, Ledger())  # type: ignore[arg-type]
    assert fresh.rejected("chat.green") is None and not recorded  # no verdict yet: not rejected either
