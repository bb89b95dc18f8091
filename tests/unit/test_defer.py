"""``ctx.defer``: a deferral is validated where the handler makes it, and a turn's
deferrals are written by its commit, once, into the user's outbox."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import fakeredis
import pytest

from protocol import keys
from protocol.codec import decode
from protocol.deferral import MAX_DEFERRALS, Deferral, check_plain, job_id
from protocol.models import Reply, Turn
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from stores.turns import ContextPack
from worker import handlers, jobs
from worker.app import Worker
from worker.handlers import TurnContext
from worker.settings import WorkerSettings

RQ_JOB_ID = re.compile(r"[A-Za-z0-9_-]+")  # what RQ accepts as a job id


def ctx(turn_id: str = "t.1", user: str = "a@b.c") -> TurnContext:
    return TurnContext(Turn(turn_id=turn_id, user=user, text="hi", ts=1.0), ContextPack())


def test_job_ids_are_deterministic_distinct_and_fit_rq() -> None:
    a = job_id("alice", "t.1", 0)
    assert a == job_id("alice", "t.1", 0)
    assert len({a, job_id("alice", "t.1", 1), job_id("bob", "t.1", 0), job_id("alice", "t.2", 0)}) == 4
    # user and turn id are not concatenated: ("a", "b.c") and ("a\0b", "c") cannot meet
    assert job_id("a.b", "c", 0) != job_id("a", "b.c", 0)
    assert RQ_JOB_ID.fullmatch(job_id("c+d@x.y", "t-._9", 31))


@pytest.mark.parametrize("value", [None, 1, 1.5, "s", True, [1, [2, {"k": "v"}]], {"a": None}])
def test_plain_data_passes(value: Any) -> None:
    check_plain(value)


def _nested(depth: int) -> list[Any]:
    out: list[Any] = [1]
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize("value", [b"bytes", {1: "int key"}, float("nan"), object(), {"s": {1, 2}},
                                   _nested(20)])
def test_other_data_is_refused(value: Any) -> None:
    with pytest.raises(ValueError):
        check_plain(value)


def test_defer_builds_one_indexed_deferral_per_call() -> None:
    c = ctx()
    first = c.defer("count", "summaries", by=2)
    second = c.defer("noop", queue="eval", delay=1.5)
    assert [j for j, _ in c.deferred] == [first, second]
    assert [first, second] == [job_id("a@b.c", "t.1", 0), job_id("a@b.c", "t.1", 1)]
    d0, d1 = (decode(Deferral, p) for _, p in c.deferred)
    assert (d0.name, d0.args, d0.kwargs) == ("count", ["summaries"], {"by": 2})
    assert (d0.queue, d0.delay_s) == ("writeback", 0.0)
    assert (d1.name, d1.queue, d1.delay_s, d1.index) == ("noop", "eval", 1.5, 1)
    spec = jobs.get("memory_summary")
    c.defer("memory_summary")
    d2 = decode(Deferral, c.deferred[-1][1])
    assert (d2.retry_max, d2.retry_interval_s) == (spec.retry_max, spec.retry_interval_s)


@pytest.mark.parametrize(("call", "error"), [
    (lambda c: c.defer("no-such-job"), KeyError),
    (lambda c: c.defer("os.system", "rm -rf /"), KeyError),  # a name, never an import path
    (lambda c: c.defer("noop", b"bytes"), ValueError),
    (lambda c: c.defer("noop", when=object()), ValueError),
    (lambda c: c.defer("noop", queue="Bad Queue"), ValueError),
    (lambda c: c.defer("noop", delay=-1), ValueError),
    (lambda c: c.defer("noop", "x" * 70_000), ValueError),
])
def test_a_bad_deferral_fails_in_the_handler(call: Any, error: type[Exception]) -> None:
    c = ctx()
    with pytest.raises(error):
        call(c)
    assert c.deferred == []


def test_a_turn_defers_a_bounded_number_of_jobs() -> None:
    c = ctx()
    for _ in range(MAX_DEFERRALS):
        c.defer("noop")
    with pytest.raises(ValueError, match="at most"):
        c.defer("noop")


def test_job_registration_checks_its_names() -> None:
    with pytest.raises(ValueError):
        jobs.job("Bad Name")
    with pytest.raises(ValueError):
        jobs.job("fine", queue="no queue")
    with pytest.raises(ValueError):
        jobs.job("fine", retry_max=-1)
    assert {"noop", "count", "memory_summary"} <= set(jobs.names())


_FAILS_ONCE: dict[str, int] = {}


@handlers.register("test_defer_then_fail_once")
async def _defer_then_fail_once(c: TurnContext) -> str:
    """Defers, then fails its first attempt: that attempt's deferral must not be committed."""
    c.defer("count", "attempt", by=c.attempt)
    _FAILS_ONCE[c.turn.turn_id] = _FAILS_ONCE.get(c.turn.turn_id, 0) + 1
    if _FAILS_ONCE[c.turn.turn_id] == 1:
        raise handlers.HandlerError("first attempt fails")
    return "ok"


async def _serve(r: fakeredis.FakeAsyncRedis, handler: str, turns: list[tuple[str, str]]) -> Worker:
    await write_policy(r, "chat", TurnsPolicy(handler=handler, concurrency=2))
    for user, turn_id in turns:
        await r.xadd(keys.inbox(user), {"text": "hi", "turn_id": turn_id, "tier": "chat"})
        await r.xadd(keys.ready("chat"), {"user": user})
    worker = Worker(WorkerSettings(worker_id="w1", block_ms=50), r=r)
    run = asyncio.ensure_future(worker.run())
    try:
        for user, turn_id in turns:
            got = await r.blpop([keys.reply(user, turn_id)], timeout=10)
            assert got is not None and Reply.model_validate_json(got[1]).ok
    finally:
        worker.drain("test over")
        await asyncio.wait({run}, timeout=10)
    return worker


async def test_a_handlers_deferrals_are_committed_with_its_turn() -> None:
    r = fakeredis.FakeAsyncRedis()
    await _serve(r, "echo_defer", [("alice", "t1"), ("alice", "t2"), ("bob", "t1")])
    for user, turns in (("alice", ["t1", "t2"]), ("bob", ["t1"])):
        rows = await r.xrange(keys.outbox(user))
        assert [f[b"job"].decode() for _, f in rows] == [job_id(user, t, 0) for t in turns]
        assert {decode(Deferral, f[b"d"]).name for _, f in rows} == {"memory_summary"}
    assert sorted(f[b"user"] for _, f in await r.xrange(keys.OUTBOX_READY)) == [b"alice", b"alice", b"bob"]
    await r.aclose()


async def test_a_failed_attempts_deferrals_are_dropped_with_it() -> None:
    r = fakeredis.FakeAsyncRedis()
    await _serve(r, "test_defer_then_fail_once", [("carol", "t1")])
    rows = await r.xrange(keys.outbox("carol"))
    assert len(rows) == 1
    d = decode(Deferral, rows[0][1][b"d"])
    assert (d.index, d.kwargs) == (0, {"by": 2})  # the second attempt's, the only one committed
    await r.aclose()
