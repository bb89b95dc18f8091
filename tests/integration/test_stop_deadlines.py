"""Deadlines and stop on real worker processes: a turn reached after its deadline is answered
``expired`` without its handler, a running handler is bounded by it; a cancelled turn is
answered ``cancelled`` exactly once, whenever the cancel comes. The handler trace
(``FLEET_WORKER_HANDLER_TRACE``) says which turns a handler ran for."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.codec import decode
from protocol.models import SessionEntry, WorkerInfo
from protocol.policy import turns_policy
from stores.policies import write_policy
from tests.helpers import fleet_cli, wait_until

pytestmark = pytest.mark.integration


def handled(trace: Path) -> list[str]:
    """The turn ids a handler was entered for, in order."""
    if not trace.exists():
        return []
    return [e["turn"] for e in map(json.loads, trace.read_text().splitlines()) if e["ev"] == "enter"]


@pytest.fixture
def serve(r: redis.Redis, start_worker: Callable[..., Any], redis_server: Any,
          tmp_path: Path) -> Callable[..., tuple[Fleet, Path]]:
    """Start a worker of the ``sleep`` handler (its handler traced) and return a client of it."""

    def start(**policy: Any) -> tuple[Fleet, Path]:
        write_policy(r, "chat", turns_policy(handler="sleep", **{"concurrency": 2, **policy}))
        trace = tmp_path / "trace.jsonl"
        start_worker(env={"FLEET_WORKER_HANDLER_TRACE": str(trace)})
        return Fleet(redis_server.role_url("fleet-client")), trace

    return start


def test_a_turn_behind_a_slow_one_expires_without_its_handler(
        serve: Callable[..., tuple[Fleet, Path]]) -> None:
    fleet, trace = serve()
    slow = fleet.submit("alice", "slow", meta={"sleep_ms": 1500})
    late = fleet.submit("alice", "late", timeout_s=0.5)
    after = fleet.submit("alice", "after", meta={"sleep_ms": 1})
    reply = late.result(10)
    assert (reply.ok, reply.status) == (False, "expired") and "deadline" in (reply.error or "")
    assert slow.result(10).ok and after.result(10).ok
    assert handled(trace) == [slow.turn_id, after.turn_id]  # never entered for the late turn


def test_a_running_handler_is_bounded_by_its_deadline(serve: Callable[..., tuple[Fleet, Path]]) -> None:
    """``sleep`` sees ``ctx.deadline`` and stops at it: the reply comes at the deadline, not
    after the whole sleep."""
    fleet, trace = serve()
    started = time.monotonic()
    turn = fleet.submit("alice", "long", meta={"sleep_ms": 20_000}, timeout_s=1.0)
    reply = turn.result(15)
    assert reply.status == "expired" and "ran into the turn's deadline" in (reply.error or "")
    assert time.monotonic() - started < 10
    # its handler ran (a retry may start too, should the first call's timer fire a hair before
    # the deadline: the retry then finds no time left and fails at once)
    assert set(handled(trace)) == {turn.turn_id}


def test_fleet_submit_sets_the_deadline_from_its_timeout(serve: Callable[..., tuple[Fleet, Path]],
                                                         fleet_env: dict[str, str], tmp_path: Path) -> None:
    fleet, _trace = serve()
    past = str(time.time() - 1)
    done = fleet_cli(fleet_env, "submit", "--user", "bob", "--deadline", past, "hi", cwd=tmp_path)
    assert done.returncode == 1 and done.stdout.startswith("expired: "), done.stdout + done.stderr
    # --timeout is the turn's deadline too: the worker stops the 20 s sleep at it, so the
    # user's next turn is served within seconds
    done = fleet_cli(fleet_env, "submit", "--user", "bob", "--timeout", "1", "--meta", '{"sleep_ms": 20000}',
                     "hi", cwd=tmp_path)
    # (the wait starts after the submit, so it may or may not see the expired reply)
    assert (done.returncode, done.stdout[:8]) in ((3, ""), (1, "expired:")), done.stdout + done.stderr
    assert fleet.submit("bob", "next", meta={"sleep_ms": 1}).result(8).ok


# --- stop --------------------------------------------------------------------------------------
HANDLERS = '''
import asyncio, pathlib, time
from protocol.models import HandlerResult


def _mark(ctx, what):
    pathlib.Path(ctx.option("marks", "")).joinpath(f"{ctx.turn.turn_id}.{what}").write_text("")


async def stream_async(ctx):
    """Emits two words, then waits for a long model call; records a CancelledError inside it."""
    ctx.emit("partial ")
    ctx.emit("answer")
    try:
        await asyncio.sleep(float(ctx.option("sleep_ms", 30000)) / 1000)
    except asyncio.CancelledError:
        _mark(ctx, "cancelled-error")
        raise
    return HandlerResult(text="partial answer, and the rest")


def loop_sync(ctx):
    """A sync handler: works in small steps until its turn is cancelled (``ctx.cancelled``)."""
    ctx.emit("sync ")
    end = time.monotonic() + float(ctx.option("sleep_ms", 30000)) / 1000
    while time.monotonic() < end:
        if ctx.cancelled:
            _mark(ctx, "flag")
            return "stopped early"
        time.sleep(0.01)
    return "ran to the end"
'''


@pytest.fixture
def stop_handlers(tmp_path: Path) -> dict[str, str]:
    """A handler package on ``PYTHONPATH`` (a module and a ``.dist-info`` naming its entry
    points): the workers started with this env can load ``t_stream_async`` and ``t_loop_sync``."""
    root = tmp_path / "handlers"
    info = root / "fleet_stop_test-0.1.dist-info"
    info.mkdir(parents=True)
    (root / "fleet_stop_test.py").write_text(HANDLERS)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fleet-stop-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fleet.handlers]\nt_stream_async = fleet_stop_test:stream_async\n"
                                           "t_loop_sync = fleet_stop_test:loop_sync\n")
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def serve_stop(r: redis.Redis, start_worker: Callable[..., Any], redis_server: Any, tmp_path: Path,
               stop_handlers: dict[str, str]) -> Callable[..., tuple[Fleet, Path, Path]]:
    """Start ``workers`` workers of ``handler`` (traced); a client, the trace and the marks' directory."""

    def start(handler: str, workers: int = 1, **options: Any) -> tuple[Fleet, Path, Path]:
        marks = tmp_path / "marks"
        marks.mkdir(exist_ok=True)
        write_policy(r, "chat", turns_policy(handler=handler, concurrency=2,
                                            handler_options={"marks": str(marks), **options}))
        trace = tmp_path / "trace.jsonl"
        for _ in range(workers):
            start_worker(env={"FLEET_WORKER_HANDLER_TRACE": str(trace), **stop_handlers})
        return Fleet(redis_server.role_url("fleet-client")), trace, marks

    return start


def session(r: redis.Redis, user: str) -> list[SessionEntry]:
    return [decode(SessionEntry, raw) for raw in r.lrange(keys.session(user), 0, -1)]


def test_a_queued_turn_is_cancelled_without_running(serve_stop: Callable[..., tuple[Fleet, Path, Path]],
                                                    r: redis.Redis) -> None:
    fleet, trace, _marks = serve_stop("t_stream_async", sleep_ms=1500)
    first = fleet.submit("alice", "first")
    queued = fleet.submit("alice", "queued")
    got = fleet.cancel("alice", queued.turn_id)
    assert got.outcome == "cancelled", got
    reply = queued.result(10)
    assert (reply.ok, reply.status) == (False, "cancelled")
    assert first.result(10).ok
    assert handled(trace) == [first.turn_id]  # never ran
    assert [e.turn_id for e in session(r, "alice")] == [first.turn_id]  # nothing said: not in the session
    again = fleet.cancel("alice", queued.turn_id)
    # (its reply was read: no status to tell)
    assert (again.outcome, str(again)) == ("answered", f"turn {queued.turn_id} already answered")


def test_a_running_async_handler_is_cancelled_at_once(serve_stop: Callable[..., tuple[Fleet, Path, Path]],
                                                      r: redis.Redis) -> None:
    fleet, trace, marks = serve_stop("t_stream_async")
    turn = fleet.submit("alice", "tell me")
    wait_until(lambda: handled(trace) == [turn.turn_id], 10, "the handler to start")
    cancelled_at = time.monotonic()
    assert fleet.cancel("alice", turn.turn_id).outcome == "cancelled"
    nxt = fleet.submit("alice", "next one", meta={"sleep_ms": 1})  # served at once after the cancel
    reply = turn.result(10)
    assert time.monotonic() - cancelled_at < 5  # not the handler's 30 s
    assert (reply.ok, reply.status, reply.text) == (False, "cancelled", "partial answer")
    assert (marks / f"{turn.turn_id}.cancelled-error").exists()  # CancelledError raised inside it
    assert nxt.result(5).ok
    entries = session(r, "alice")
    assert [(e.turn_id, e.reply, e.cut) for e in entries] == [
        (turn.turn_id, "partial answer", True), (nxt.turn_id, "partial answer, and the rest", False)]


def test_a_running_sync_handler_sees_the_flag(serve_stop: Callable[..., tuple[Fleet, Path, Path]]) -> None:
    fleet, trace, marks = serve_stop("t_loop_sync")
    turn = fleet.submit("alice", "work")
    wait_until(lambda: handled(trace) == [turn.turn_id], 10, "the handler to start")
    assert fleet.cancel("alice", turn.turn_id).outcome == "cancelled"
    reply = turn.result(10)
    assert (reply.status, reply.text) == ("cancelled", "sync ")  # its result replaced
    assert (marks / f"{turn.turn_id}.flag").exists()


def test_cancel_of_an_answered_or_unknown_turn_says_so(serve_stop: Callable[..., tuple[Fleet, Path, Path]],
                                                       fleet_env: dict[str, str], tmp_path: Path,
                                                       r: redis.Redis) -> None:
    fleet, _trace, _marks = serve_stop("sleep", sleep_ms=1)
    turn = fleet.submit("alice", "quick")
    assert turn.result(10).ok
    got = fleet.cancel("alice", turn.turn_id)
    assert (got.outcome, got.status) == ("answered", None)  # its reply was read already
    assert str(got) == f"turn {turn.turn_id} already answered"
    unread = fleet.submit("alice", "unread")
    wait_until(lambda: r.zscore(keys.done("alice"), unread.turn_id) is not None, 10, "the answer")
    cli = fleet_cli(fleet_env, "cancel", "--user", "alice", unread.turn_id, cwd=tmp_path)
    said = (cli.returncode, cli.stdout.strip())
    assert said == (0, f"turn {unread.turn_id} already answered (ok)"), cli.stderr
    cli = fleet_cli(fleet_env, "cancel", "--user", "alice", "no-such-turn", cwd=tmp_path)
    assert cli.returncode == 1 and "no-such-turn" in cli.stdout and "not known" in cli.stdout, cli


def test_a_cancel_outlives_the_worker_that_heard_it(serve_stop: Callable[..., tuple[Fleet, Path, Path]],
                                                    start_worker: Callable[..., Any], r: redis.Redis) -> None:
    """The worker serving the turn is stuck (its event loop blocked: it cannot hear the cancel)
    and is killed: the turn's retry on another worker finds the cancel and answers ``cancelled``
    without running the handler again."""
    fleet, trace, _marks = serve_stop("sleep", workers=1)
    turn = fleet.submit("alice", "stuck", meta={"block_loop_ms": 20_000})
    wait_until(lambda: handled(trace) == [turn.turn_id], 10, "the handler to start")
    holder = (r.get(keys.lane("alice")) or b"").decode().split("|")[0]
    assert fleet.cancel("alice", turn.turn_id).outcome == "cancelled"
    os.kill(decode(WorkerInfo, r.hget(keys.WORKERS, holder) or b"").pid, signal.SIGKILL)
    serve_stop("sleep", workers=1)
    reply = turn.result(20)
    assert reply.status == "cancelled"
    assert handled(trace) == [turn.turn_id]  # entered once, by the killed worker only


def test_the_raw_protocol_cancels_a_running_turn(serve_stop: Callable[..., tuple[Fleet, Path, Path]],
                                                 redis_server: Any) -> None:
    """As docs/guide/protocol.md says, on the client role's credentials: a plain turn, the
    cancel function, then the plain control command to the lane's holder."""
    _fleet, trace, marks = serve_stop("t_stream_async")
    raw = redis.Redis.from_url(redis_server.role_url("fleet-client"))
    entry = raw.xadd(keys.inbox("carol"), {"text": "hi", "turn_id": "raw-1"}).decode()
    raw.xadd(keys.ready("chat"), {"user": "carol"})
    wait_until(lambda: handled(trace) == ["raw-1"], 10, "the handler to start")
    version = raw.fcall("fleet_version", 0).decode()
    got = raw.fcall(f"fleet_turn_cancel_{version}", 4, keys.state("carol"), keys.inbox("carol"),
                    keys.done("carol"), keys.reply("carol", "raw-1"), "raw-1", int(time.time() * 1000))
    assert got == [b"cancelled", entry.encode(), 1]
    worker = (raw.get(keys.lane("carol")) or b"").decode().split("|")[0]
    raw.xadd(keys.cancels(worker), {"kind": "cancel", "user": "carol", "turn_id": "raw-1", "entry": entry},
             maxlen=64, approximate=True)
    popped = raw.blpop([keys.reply("carol", "raw-1")], timeout=5)  # well before the handler's 30 s
    assert popped is not None
    reply = json.loads(popped[1])
    assert (reply["status"], reply["text"]) == ("cancelled", "partial answer")
    assert (marks / "raw-1.cancelled-error").exists()
