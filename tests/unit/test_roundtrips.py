"""stores.roundtrips: one operation, run by a blocking or an asyncio client alike.

An operation yields one round trip at a time; the runners send it and hand back its reply, or
throw its error in at the ``yield`` (where the operation may catch it). Over fakeredis, both
kinds of client, and a recording client that counts what each round trip carried.
"""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest
import redis

from protocol import keys
from stores.functions import NAMES, Functions
from stores.roundtrips import Op, Pipelined, Single, arun, is_async, operation, run, run_all


@operation
def count_then_store(key: str, value: str) -> Op[tuple[int, Any]]:
    """Two round trips: a pipeline of two commands, then one command."""
    existed, _ = yield Pipelined(lambda pipe: (pipe.exists(key), pipe.set(key, value)))
    got = yield Single(lambda r: r.get(key))
    return int(existed), got


@operation
def survive(key: str) -> Op[str]:
    """A round trip that fails (a list read as a string): the operation catches it and goes on."""
    try:
        yield Single(lambda r: r.get(key))
    except redis.ResponseError as exc:
        return f"caught: {str(exc).split()[0]}"
    return "no error"


@operation
def fail(key: str) -> Op[None]:
    yield Single(lambda r: r.get(key))


def test_an_operation_runs_the_same_on_a_blocking_and_an_asyncio_client() -> None:
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server)
    assert count_then_store(r, "k", "v1") == (0, b"v1")

    async def on_asyncio() -> tuple[int, Any]:
        ar = fakeredis.FakeAsyncRedis(server=server)
        try:
            return await count_then_store(ar, "k", "v2")
        finally:
            await ar.aclose()

    assert asyncio.run(on_asyncio()) == (1, b"v2")
    assert is_async(fakeredis.FakeAsyncRedis()) and not is_async(r)


def test_a_round_trips_error_is_thrown_into_the_operation_or_raised_by_the_runner() -> None:
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server)
    r.rpush("a-list", "x")
    assert survive(r, "a-list") == "caught: WRONGTYPE"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        fail(r, "a-list")

    async def on_asyncio() -> None:
        ar = fakeredis.FakeAsyncRedis(server=server)
        try:
            assert await survive(ar, "a-list") == "caught: WRONGTYPE"
            with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                await fail(ar, "a-list")
        finally:
            await ar.aclose()

    asyncio.run(on_asyncio())


class Recording:
    """A blocking client that records each round trip: a pipeline's commands, or one command."""

    def __init__(self) -> None:
        self.trips: list[list[str]] = []

    def pipeline(self, transaction: bool = True) -> Recording.Pipe:
        return Recording.Pipe(self)

    def get(self, key: str) -> bytes:
        self.trips.append(["GET"])
        return b"v"

    class Pipe:
        def __init__(self, owner: Recording) -> None:
            self.owner, self.queued = owner, list[str]()

        def exists(self, key: str) -> None:
            self.queued.append("EXISTS")

        def set(self, key: str, value: str) -> None:
            self.queued.append("SET")

        def execute(self, raise_on_error: bool = True) -> list[Any]:
            self.owner.trips.append(self.queued)
            return [0, True]


def test_each_yield_is_one_round_trip_and_steps_run_an_operation_inline() -> None:
    rec = Recording()

    def twice() -> Op[list[Any]]:
        first = yield from count_then_store.steps("k", "v")
        second = yield from count_then_store.steps("k", "w")
        return [first, second]

    assert run(rec, twice()) == [(0, b"v"), (0, b"v")]  # type: ignore[arg-type]
    assert rec.trips == [["EXISTS", "SET"], ["GET"], ["EXISTS", "SET"], ["GET"]]

    async def runs_on_a_fake_asyncio_client() -> Any:
        class AsyncRecording(Recording):
            async def get(self, key: str) -> bytes:  # type: ignore[override]
                return super().get(key)

            class Pipe(Recording.Pipe):
                async def execute(self, raise_on_error: bool = True) -> list[Any]:  # type: ignore[override]
                    return super().execute(raise_on_error)

            def pipeline(self, transaction: bool = True) -> Recording.Pipe:
                return AsyncRecording.Pipe(self)

        arec = AsyncRecording()
        got = await arun(arec, count_then_store.steps("k", "v"))  # type: ignore[arg-type]
        return got, arec.trips

    assert asyncio.run(runs_on_a_fake_asyncio_client()) == ((0, b"v"), [["EXISTS", "SET"], ["GET"]])


def test_one_functions_registry_binds_every_function_to_either_kind_of_client() -> None:
    assert set(Functions.__annotations__) == set(NAMES)
    blocking, asyncio_ = fakeredis.FakeRedis(), fakeredis.FakeAsyncRedis()
    ready = keys.ready("chat")
    blocking.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    assert Functions(blocking).notification_touch(keys=[ready], args=[keys.GROUP, "w1"]) == 0

    async def on_asyncio() -> Any:
        await asyncio_.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
        return await Functions(asyncio_).notification_touch(keys=[ready], args=[keys.GROUP, "w1"])

    assert asyncio.run(on_asyncio()) == 0


class Counted:
    """A fakeredis client that counts its round trips: each pipeline sent, each command."""

    def __init__(self, r: redis.Redis) -> None:
        self.r, self.trips = r, 0

    def pipeline(self, transaction: bool = True) -> Any:
        pipe = self.r.pipeline(transaction=transaction)
        execute = pipe.execute

        def counted(raise_on_error: bool = True) -> Any:
            self.trips += 1
            return execute(raise_on_error=raise_on_error)

        pipe.execute = counted  # type: ignore[method-assign]
        return pipe

    def __getattr__(self, name: str) -> Any:
        self.trips += 1
        return getattr(self.r, name)


@operation
def read_then_bump(key: str) -> Op[tuple[Any, int]]:
    """Two pipelined round trips."""
    got, = yield Pipelined(lambda pipe: pipe.get(key))
    bumped, = yield Pipelined(lambda pipe: pipe.incr(key + ":n"))
    return got, bumped


@operation
def read_strict(key: str) -> Op[Any]:
    """A pipelined read that raises its command's error (a list read as a string)."""
    got, = yield Pipelined(lambda pipe: pipe.get(key))
    return got


def test_operations_side_by_side_share_each_round_trip_and_keep_their_own_errors() -> None:
    r = fakeredis.FakeRedis()
    r.set("a", "1")
    r.rpush("a-list", "x")
    counted = Counted(r)
    ops = [read_then_bump.steps("a"), read_then_bump.steps("b"), read_strict.steps("a-list"),
           survive.steps("a-list"), read_then_bump.steps("c")]
    got = run_all(counted, ops)  # type: ignore[arg-type]
    assert got[0] == (b"1", 1) and got[1] == (None, 1) and got[4] == (None, 1)
    assert isinstance(got[2], redis.ResponseError) and "WRONGTYPE" in str(got[2])
    assert got[3] == "caught: WRONGTYPE"  # a Single round trip goes alone, its error thrown in
    # two pipelines for the pipelined steps of all five, and the Single's own command
    assert counted.trips == 3
    # the same as each run alone
    r.delete("b:n", "c:n", "a:n")
    assert [read_then_bump(r, k) for k in "abc"] == [got[0], got[1], got[4]]
    assert run_all(counted, []) == []  # type: ignore[arg-type]


def test_a_failed_shared_round_trip_is_thrown_into_each_operation() -> None:
    class Down(Counted):
        def pipeline(self, transaction: bool = True) -> Any:
            pipe = super().pipeline(transaction)

            def refused(raise_on_error: bool = True) -> Any:
                raise redis.ConnectionError("refused")

            pipe.execute = refused  # type: ignore[method-assign]
            return pipe

    got = run_all(Down(fakeredis.FakeRedis()), [read_then_bump.steps("a"), read_then_bump.steps("b")])  # type: ignore[arg-type]
    assert all(isinstance(g, redis.ConnectionError) for g in got) and len(got) == 2
