"""The docs' snippets, run as written after `fleet up`: the quick start and every block marked
`run` in the README and the docs site (tests/docs_blocks.py says what each marker means).

The quick start (the one `snippet: session` block) runs in a fresh directory (its own HOME and
FLEET_HOME, no REDIS_URL, this checkout's `.venv/bin` first on PATH), on a machine where another
Redis may listen on 6379. Nothing here writes to that Redis: a block that names 6379 or
127.0.0.1, or runs `redis-cli` without `-u "$VAR"` (which means 127.0.0.1:6379), fails the test
before anything runs; every URL the snippets used must be the port of the Redis `fleet up`
started; and the keys the snippets touch are compared on 6379 with read-only commands.

The session block runs in one `bash -euo pipefail` process; the `run` blocks run from inside it,
in page order (the README, then the site's nav), at the point just before its `fleet down`
line, so that they see the environment `eval "$(fleet env)"` produced there and a fleet that is
up. Then the block's `fleet down` runs, and no process of that fleet (by pid and creation time)
may be left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest
import redis

from protocol import keys
from stores.connection import redact_url
from tests.docs_blocks import Block, all_blocks, by_kind

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
PYTHON = VENV_BIN / "python"
# The only session lines not run: the test runs in this checkout's existing .venv (its bin is
# first on PATH, VIRTUAL_ENV is set), which is what these two lines would have set up.
SKIPPED_LINES = ("./scripts/setup", ". .venv/bin/activate")
OTHER_REDIS_PORT = 6379
CHAT_INPUT = "hello from the fleet chat line\n"  # stdin of the block: what `fleet chat` reads
RUN_TIMEOUT_S = 80  # the session alone; each `run` block adds RUN_BLOCK_S
RUN_BLOCK_S = 15
RUNNERS = {"bash": ("bash -euo pipefail", ".sh"), "python": (None, ".py")}  # None: the venv's python

OTHER_REDIS = re.compile(r"6379|127\.0\.0\.1")
# redis-cli with no -u "$VAR" connects to 127.0.0.1:6379: the machine's other Redis
BARE_REDIS_CLI = re.compile(r"\bredis-cli\b(?!\s+-u\s+\"?\$\{?[A-Za-z_])")

# Run inside the block's bash at the hook (the fleet is up): what that fleet consists of, by
# pid and creation time, and the port its own redis-server listens on.
COLLECT_PIDS = r'''
import json, os, sys
from pathlib import Path
import psutil
home = Path(os.environ["FLEET_HOME"])
state = json.loads((home / "state.json").read_text())
procs = {}
def add(pid, what):  # the first name found stays: a worker is also a child of the commander
    try:
        p = psutil.Process(int(pid))
        procs.setdefault(p.pid, {"pid": p.pid, "create_time": p.create_time(), "what": what})
    except (psutil.Error, ValueError, TypeError):
        pass
for name in ("commander", "redis"):
    if (state.get(name) or {}).get("pid"):
        add(state[name]["pid"], name)
for rec in sorted((home / "run").glob("*.json")):
    with open(rec) as f:
        add(json.load(f).get("pid"), "worker " + rec.stem)
for pid in list(procs):
    with __import__("contextlib").suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            add(child.pid, "child of " + procs[pid]["what"])
listening = []
if (state.get("redis") or {}).get("pid"):
    conns = psutil.Process(state["redis"]["pid"])
    conns = conns.net_connections("tcp") if hasattr(conns, "net_connections") else conns.connections("tcp")
    listening = sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})
old = json.loads(Path(sys.argv[1]).read_text()) if Path(sys.argv[1]).exists() else {"procs": []}
for p in old["procs"]:
    procs.setdefault(p["pid"], p)
Path(sys.argv[1]).write_text(json.dumps({"state": state, "procs": list(procs.values()),
                                         "redis_listening": listening}))
'''


# --- the blocks -------------------------------------------------------------------------------
def snippets() -> tuple[Block, list[Block]]:
    """(the session block, the `run` blocks in page order)."""
    blocks = all_blocks()
    (session,) = by_kind("session", blocks)
    return session, by_kind("run", blocks)


def unsafe_lines(block: str) -> list[str]:
    """Lines that would reach the machine's other Redis on 127.0.0.1:6379."""
    return [line for line in block.splitlines()
            if OTHER_REDIS.search(line) or BARE_REDIS_CLI.search(line)]


def test_the_snippets_never_name_the_machines_other_redis() -> None:
    session, runs = snippets()
    bad = {b.where(): unsafe_lines(b.body) for b in [session, *runs, *by_kind("import")]}
    assert not {where: lines for where, lines in bad.items() if lines}, (
        "a snippet names 6379/127.0.0.1 or runs redis-cli without -u \"$REDIS_URL\": run "
        f"as written it would write to the machine's other Redis: {bad}")
    # the checks themselves catch what they are for
    assert unsafe_lines('redis-cli XADD k "*" a b') and unsafe_lines('Fleet("redis://127.0.0.1:6379/0")')
    assert unsafe_lines("redis-cli -p 6379 GET k") and unsafe_lines("x = redis.Redis(port=6379)")
    assert not unsafe_lines('redis-cli -u "$REDIS_URL" GET k  # fine')


# --- helpers ---------------------------------------------------------------------------------
def require(what: str, path: str | None) -> str:
    if path:
        return path
    msg = f"{what} is not available (./scripts/setup makes .venv; ./scripts/test installs redis)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def other_redis_fingerprint() -> dict[str, Any] | None:
    """The keys the snippets touch, as seen on 127.0.0.1:6379, by read-only commands only
    (None when nothing listens there)."""
    client = redis.Redis(port=OTHER_REDIS_PORT, socket_connect_timeout=0.5, socket_timeout=2)
    seen: dict[str, Any] = {}
    try:
        for key in (keys.inbox("alice"), keys.inbox("bob"), keys.ready("chat"),
                    keys.active("chat"), keys.policy("chat"), keys.TIERS):
            kind = client.type(key).decode()
            if kind == "stream":
                last = client.xrevrange(key, count=1)
                seen[key] = (kind, client.xlen(key), last[0][0].decode() if last else None)
            elif kind == "zset":
                seen[key] = (kind, client.zcard(key))
            elif kind == "set":
                seen[key] = (kind, sorted(client.smembers(key)))
            elif kind == "string":
                seen[key] = (kind, client.get(key))
            else:
                seen[key] = (kind,)
    except redis.RedisError:
        return None
    finally:
        client.close()
    return seen


def alive(proc: dict[str, Any]) -> bool:
    try:
        p = psutil.Process(proc["pid"])
        return abs(p.create_time() - proc["create_time"]) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def read_env(path: Path) -> dict[str, str]:
    pairs = [item.split("=", 1) for item in path.read_bytes().decode().split("\0") if "=" in item]
    return dict(pairs)


def run_name(i: int, block: Block) -> str:
    return f"run{i}-{Path(block.page).stem}-{block.line}"


def shell_hook(work: Path, runs: list[Block]) -> list[str]:
    """Lines run inside the block's bash just before its `fleet down`: dump the environment,
    record the fleet's processes, run every `run` block (its exit code and output to files),
    record again (the workers the blocks asked for may have come up meanwhile)."""
    q = shlex.quote
    py, pids = q(str(PYTHON)), q(str(work / "pids.json"))
    (work / "collect_pids.py").write_text(COLLECT_PIDS)
    lines = [f"env -0 > {q(str(work / 'env.bin'))}",
             f"{py} {q(str(work / 'collect_pids.py'))} {pids} || true"]
    for i, block in enumerate(runs):
        runner, ext = RUNNERS[block.lang]
        name = run_name(i, block)
        script = work / f"{name}{ext}"
        script.write_text(block.body)
        out, err, rc = (q(str(work / f"{name}.{s}")) for s in ("out", "err", "rc"))
        lines.append(f"__snippet_rc=0; {runner or py} {q(str(script))} </dev/null >{out} 2>{err} "
                     f"|| __snippet_rc=$?; echo \"$__snippet_rc\" >{rc}")
    lines.append(f"{py} {q(str(work / 'collect_pids.py'))} {pids} || true")
    return lines


# --- the test --------------------------------------------------------------------------------
def test_the_snippets_run_as_written_after_fleet_up(tmp_path: Path) -> None:
    require("redis-server", shutil.which("redis-server"))
    require("redis-cli", shutil.which("redis-cli"))
    require("the checkout's .venv/bin/fleet", shutil.which("fleet", path=str(VENV_BIN)))
    session, runs = snippets()
    assert runs, "no `snippet: run` block"
    for block in (session, *runs):  # before anything runs
        assert not unsafe_lines(block.body), f"{block.where()} would reach the machine's other Redis"

    lines = [line for line in session.body.splitlines() if not line.startswith(SKIPPED_LINES)]
    assert any(line.startswith('eval "$(fleet env)"') for line in lines), "the session has no `fleet env`"
    down_at = next((i for i, line in enumerate(lines) if re.match(r"fleet down\b", line)), None)
    assert down_at is not None, "the session has no `fleet down` line"

    work, project, home = tmp_path / "work", tmp_path / "project", tmp_path / "home"
    for d in (work, project, home):
        d.mkdir()
    fleet_home = project / ".fleet"  # where `fleet up` in `project` would put it anyway
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "PYTHONPATH", "PYTHONHOME") and not k.startswith("FLEET_")}
    env.update(HOME=str(home), FLEET_HOME=str(fleet_home), VIRTUAL_ENV=str(ROOT / ".venv"),
               PATH=os.pathsep.join([str(VENV_BIN), env.get("PATH", "/usr/bin:/bin")]))
    script = work / "session.sh"
    script.write_text("\n".join([
        f"trap 'echo \"{session.where()}: exit $? at line $LINENO: $BASH_COMMAND\" >&2' ERR",
        *lines[:down_at], *shell_hook(work, runs), *lines[down_at:], ""]))

    timeout = RUN_TIMEOUT_S + RUN_BLOCK_S * len(runs)
    before = other_redis_fingerprint()
    proc = subprocess.Popen(["bash", "-euo", "pipefail", str(script)], cwd=project, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(CHAT_INPUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started (bash and its children)
        out, err = proc.communicate()
        pytest.fail(f"the snippets took over {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        if (fleet_home / "state.json").exists():  # the block did not reach its own `fleet down`
            subprocess.run([str(VENV_BIN / "fleet"), "down"], cwd=project, env=env, timeout=60,
                           capture_output=True)
    after = other_redis_fingerprint()
    report = f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
    assert proc.returncode == 0, report

    # every block exited 0; where its marker says what it prints, it printed that
    for i, block in enumerate(runs):
        name = run_name(i, block)
        rc = (work / f"{name}.rc").read_text().strip()
        got = (work / f"{name}.out").read_text()
        errors = (work / f"{name}.err").read_text()
        assert rc == "0", f"{block.where()} exited {rc}:\n{got}\n{errors}\n{report}"
        if "expect" in block.options:
            assert re.search(block.options["expect"], got, re.M), \
                f"{block.where()}: no match of {block.options['expect']!r} in:\n{got}"
    assert CHAT_INPUT.strip() in out, report  # fleet chat: one turn per line, the line we typed

    # every URL the snippets used is the fleet's own Redis, never the machine's other one
    seen = json.loads((work / "pids.json").read_text())
    used = read_env(work / "env.bin")
    url = urlsplit(used["REDIS_URL"])
    assert url.hostname in ("127.0.0.1", "localhost", "::1"), used["REDIS_URL"]
    assert url.port != OTHER_REDIS_PORT, used["REDIS_URL"]
    assert used["REDIS_URL"] == seen["state"]["url"] and seen["redis_listening"] == [url.port], seen
    # `fleet up` prints what the Quick start's prose says it prints
    # (the URL without its credentials: the client role's password is for `fleet env`, not a log)
    for printed in (redact_url(seen["state"]["url"]), seen["state"]["metrics_url"], 'eval "$(fleet env)"',
                    "appendfsync always"):
        assert printed and printed in out, (printed, report)
    assert before == after, f"the machine's Redis on {OTHER_REDIS_PORT} changed: {before} -> {after}"

    # `fleet down` left no process of that fleet behind (by pid and creation time)
    kinds = {p["what"].split()[0] for p in seen["procs"]}
    assert {"commander", "redis", "worker"} <= kinds, seen["procs"]
    assert not [p for p in seen["procs"] if alive(p)], seen["procs"]
    assert not (fleet_home / "state.json").exists()
