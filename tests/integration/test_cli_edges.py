"""The `fleet` CLI at its edges, as a subprocess against the module's private redis-server.

Oversize turns, bad URLs and values, a closed stdout, the ledger's table, `top` in 80 columns and
its `q`, and the messages of `policy get` and `worker`. Every failure must be one line on stderr.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
import redis

from protocol import keys
from protocol.codec import encode
from protocol.models import MAX_TEXT_CHARS, WorkerInfo
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.helpers import fleet_cli
from tests.integration.test_events_top import T0, _populate, event, ledger, register, report

pytestmark = pytest.mark.integration


def one_line_error(out: subprocess.CompletedProcess[str], code: int) -> str:
    assert out.returncode == code, (out.returncode, out.stderr)
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    return out.stderr


# --- item 1: the turn size limit ----------------------------------------------------------
def test_text_over_the_limit_is_one_line_exit_2_and_nothing_written(r: redis.Redis,
                                                                  fleet_env: dict[str, str]) -> None:
    write_policy(r, "chat", TurnsPolicy())
    before = sorted(r.keys("*"))
    err = one_line_error(fleet_cli(fleet_env, "submit", "--user", "alice", "x" * (MAX_TEXT_CHARS + 1)), 2)
    assert f"over the limit of {MAX_TEXT_CHARS} characters" in err and "nothing was submitted" in err
    big_meta = json.dumps({"pad": "y" * 70_000})
    err = one_line_error(fleet_cli(fleet_env, "submit", "--user", "alice", "--meta", big_meta, "hi"), 2)
    assert "over the limit of 65536 bytes" in err
    assert sorted(r.keys("*")) == before

    chat = fleet_cli(fleet_env, "chat", "--user", "alice", stdin="x" * (MAX_TEXT_CHARS + 1) + "\n\n")
    assert chat.returncode == 0 and "Traceback" not in chat.stderr
    assert chat.stderr.count("\n") == 1 and "not sent" in chat.stderr
    assert sorted(r.keys("*")) == before


# --- item 2: a URL that is not one ---------------------------------------------------------
@pytest.mark.parametrize("args", [["status"], ["top", "--once"], ["events"], ["policy", "get", "chat"],
                                  ["submit", "--user", "a", "hi"]])
def test_a_bad_redis_url_is_one_line_and_exit_2(fleet_env: dict[str, str], args: list[str]) -> None:
    err = one_line_error(fleet_cli(fleet_env, "--redis-url", "notaurl", *args), 2)
    assert "bad --redis-url 'notaurl'" in err and "redis://" in err
    err = one_line_error(fleet_cli({**fleet_env, "REDIS_URL": "notaurl"}, *args), 2)
    assert "bad $REDIS_URL 'notaurl'" in err


def test_a_bad_url_does_not_print_its_password(fleet_env: dict[str, str]) -> None:
    err = one_line_error(fleet_cli(fleet_env, "--redis-url", "http://me:s3cret@h:1/0", "status"), 2)
    assert "s3cret" not in err


# --- item 3: a closed stdout -------------------------------------------------------------
@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["top", "--once"], ["events"],
                                  ["events", "--follow"], ["policy", "get", "chat"], ["dead-letters"],
                                  ["user", "ann"], ["user", "ann", "--json"], ["--help"]])
def test_a_closed_stdout_ends_quietly_with_exit_0(r: redis.Redis, fleet_env: dict[str, str],
                                                  args: list[str]) -> None:
    write_policy(r, "chat", TurnsPolicy())
    ledger(r, event())
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes a byte: `| head -0`
    try:
        out = subprocess.run([sys.executable, "-m", "fleet.cli", *args], env=fleet_env, stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=30)
    finally:
        os.close(write_end)
    assert (out.returncode, out.stderr) == (0, "")


# --- item 4: bad values are usage errors ----------------------------------------------------
@pytest.mark.parametrize("args", [
    ["policy", "set", "chat", "concurrency=-3"],
    ["policy", "set", "chat", "nosuchfield=1"],
    ["submit", "--user", "alice", "--meta", "[1]", "hi"],
    ["submit", "--user", "alice", "--meta", "{nope", "hi"],
    ["top", "--interval", "0"],
    ["events", "--count", "-1"],
    ["dead-letters", "--count", "-1"],
    ["dead-letters", "purge"],
    ["dead-letters", "retry", "--all", "1-0"],
    ["dead-letters", "retry", "not-an-id"],
    ["user", "a b"],
    ["worker"],
])
def test_bad_values_exit_2_with_one_line_and_write_nothing(r: redis.Redis, fleet_env: dict[str, str],
                                                           args: list[str]) -> None:
    write_policy(r, "chat", TurnsPolicy(concurrency=4))
    before = {k: r.dump(k) for k in r.keys("*")}
    one_line_error(fleet_cli(fleet_env, *args), 2)
    assert {k: r.dump(k) for k in r.keys("*")} == before


def test_worker_needs_its_tier(fleet_env: dict[str, str]) -> None:
    assert "--tier" in one_line_error(fleet_cli(fleet_env, "worker"), 2)


# --- item 5 and 8: policy get --------------------------------------------------------------
def test_a_rejected_policy_names_its_real_key(r: redis.Redis, fleet_env: dict[str, str]) -> None:
    r.set(keys.policy("chat"), '{"min_workers": 5, "max_workers": 2}')
    out = fleet_cli(fleet_env, "policy", "get", "chat")
    assert out.returncode == 0, out.stderr
    assert "REJECTED edit of fleet:policy:{chat}: " in out.stdout


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_policy_get_of_a_tier_without_policy_says_so_and_exits_1(r: redis.Redis, fleet_env: dict[str, str],
                                                                 json_flag: list[str]) -> None:
    out = fleet_cli(fleet_env, "policy", "get", "nosuchtier", *json_flag)
    err = one_line_error(out, 1)
    assert "tier 'nosuchtier' has no policy (defaults would apply: handler=echo" in err
    assert out.stdout == ""
    assert r.keys("*") == []  # a read writes nothing, not even a verdict


# --- item 6: the ledger's table -------------------------------------------------------------
def test_events_show_from_to_only_for_scale_changes_and_keep_their_columns(r: redis.Redis,
                                                                         fleet_env: dict[str, str]) -> None:
    many = [f"chat-{i:08x}" for i in range(6)]
    ledger(r, event(ts=T0, spawned=many, from_count=1, to_count=7, reason="R-up"))
    ledger(r, event(tier="*", action="leader", ts=T0 + 1, from_count=0, to_count=0, reason="R-leader"))
    ledger(r, event(action="hold", ts=T0 + 2, from_count=3, to_count=3, reason="R-hold"))
    ledger(r, event(action="policy-rejected", ts=T0 + 3, from_count=0, to_count=0, reason="R-rejected"))
    ledger(r, event(tier="a-very-long-tier-name-of-32-chars", ts=T0 + 4, reason="R-long"))
    out = fleet_cli(fleet_env, "events")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "0->0" not in out.stdout and "3->3" not in out.stdout
    assert "1->7" in lines[0] and "+chat-00000000," in lines[0] and "chat-00000005" not in lines[0]
    assert len({line.index("R-") for line in lines}) == 1, out.stdout  # the reasons line up

    status = fleet_cli(fleet_env, "status")
    assert status.returncode == 0, status.stderr
    assert "0->0" not in status.stdout and "3->3" not in status.stdout


# --- item 7: top in 80 columns, its legend, q, and AGE ---------------------------------------
def _frame_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_top_fits_80_columns_and_explains_its_columns(r: redis.Redis, fleet_env: dict[str, str]) -> None:
    _populate(r)
    register(r, "chat-1a2b3c4d")
    ledger(r, event(ts=T0 + 20, spawned=["chat-1a2b3c4d", "chat-99999999"], from_count=1, to_count=3,
                    reason="backlog 40 > 16 per worker: " + "detail " * 20))
    out = fleet_cli({**fleet_env, "COLUMNS": "80"}, "top", "--once")
    assert out.returncode == 0, out.stderr
    lines = _frame_lines(out.stdout)
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    a = next(line for line in lines if line.startswith("chat-a "))
    assert "ready" in a and "0.50" in a and "2/4" in a and "3/1" in a
    assert "USERS: users served in the last minute / since the previous report" in out.stdout
    assert "AGE: since the worker started" in out.stdout
    assert "LAST 5 EVENTS" in out.stdout and "backlog 40 > 16" in out.stdout

    narrow = fleet_cli({**fleet_env, "COLUMNS": "60"}, "top", "--once")
    assert max(len(line) for line in _frame_lines(narrow.stdout)) <= 60
    whole = fleet_cli(fleet_env, "top", "--once")  # into a pipe, no $COLUMNS: every column, full bars
    assert f"[{'#' * 10}{'.' * 10}] 0.50" in whole.stdout and "200MB" in whole.stdout


def test_age_is_the_time_since_the_worker_started_in_top_and_status(r: redis.Redis,
                                                                    fleet_env: dict[str, str]) -> None:
    started = time.time() - 3 * 3600 - 100
    r.hset(keys.WORKERS, "chat-old", encode(WorkerInfo(worker="chat-old", tier="chat", pid=1, host="h",
                                                       started=started)))
    r.set(keys.heartbeat("chat-old"), "1", ex=60)
    r.xadd(keys.REPORTS, {"m": encode(report("chat-old", time.time() - 2, busy=1))})  # LAST: 2 s
    status = json.loads(fleet_cli(fleet_env, "status", "--json").stdout)["workers"][0]
    assert 3 * 3600 + 90 < status["age_s"] < 3 * 3600 + 160
    top = fleet_cli(fleet_env, "top", "--once").stdout
    head = next(line for line in top.splitlines() if line.startswith("WORKER"))
    row = next(line for line in top.splitlines() if line.startswith("chat-old "))
    at = head.index("AGE")  # a right-aligned column: its value ends where the header ends
    assert row[at - 2:at + 3].strip() == "3h", (head, row)
    for command in ("top", "status"):  # and the help of both says so
        assert "since the worker started" in " ".join(fleet_cli(fleet_env, command, "--help").stdout.split())


def test_q_quits_top_in_a_terminal(r: redis.Redis, fleet_env: dict[str, str]) -> None:
    _populate(r)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in fleet_env.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "top", "--interval", "30"], env=env,
                            stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while b"LAST 5 EVENTS" not in seen and time.monotonic() < deadline:  # the first frame is drawn
            if select.select([leader], [], [], 1)[0]:
                seen += os.read(leader, 65536)
        assert b"LAST 5 EVENTS" in seen, seen[-500:]
        os.write(leader, b"q")  # the next frame is 30 s away: only the key can end it now
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        os.close(leader)
    frame = seen.decode(errors="replace").split("\x1b[H\x1b[2J")[-1]
    assert max(len(line) for line in frame.replace("\r", "").splitlines()) <= 80
