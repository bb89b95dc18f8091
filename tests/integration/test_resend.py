"""A call re-sent after its reply was lost counts nothing twice, on a real redis-server.

redis-py sends a command (or a whole pipeline: the worker's group commit batches the acquires
and commits of one loop pass) again when the connection drops before the reply: the server
may have run it already. Each test loses one reply after the server ran the call; the product's
client (``connect_async``, retries on) sends it again, and the attempt counts must be those of
one call: a turn is dead-lettered after ``max_attempts`` real attempts, not after connection
flaps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio.connection as aioconnection

from protocol import keys
from stores.connection import connect_async
from stores.turns import Lease, StoreConfig, UserStore, Writes
from tests.conftest import RedisServer

pytestmark = pytest.mark.integration


class LostReplies:
    """Arm it and the next ``n`` replies read are lost: each is read (the server ran the call),
    then the connection is dropped and a ConnectionError raised, as when the network fails
    between the server's reply and the client."""

    def __init__(self) -> None:
        self.left = 0
        self.lost = 0

    def arm(self, n: int = 1) -> None:
        self.left = n


@pytest.fixture
def lost(monkeypatch: pytest.MonkeyPatch) -> Iterator[LostReplies]:
    state = LostReplies()
    real = aioconnection.AbstractConnection.read_response

    async def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        if state.left <= 0:
            return await real(self, *args, **kwargs)
        state.left -= 1
        await real(self, *args, **kwargs)
        state.lost += 1
        await self.disconnect()
        raise redis.ConnectionError("the connection dropped before the reply")

    monkeypatch.setattr(aioconnection.AbstractConnection, "read_response", read_response)
    yield state


@pytest.fixture
async def store(redis_server: RedisServer, r: redis.Redis) -> AsyncIterator[UserStore]:
    client = connect_async(redis_server.role_url("fleet-worker"), cluster="no")
    await client.ping()  # connected: a lost reply is a command's, not the AUTH's at connect
    yield UserStore(client, "w1", StoreConfig())
    await client.aclose()


def attempts(r: redis.Redis, user: str, entry: str) -> int:
    raw = r.hget(keys.state(user), f"att:{entry}")
    return int(raw.split(b"|")[0]) if raw else 0


async def test_a_resent_acquire_counts_the_attempt_once(r: redis.Redis, store: UserStore,
                                                        lost: LostReplies) -> None:
    entry = r.xadd(keys.inbox("ann"), {"text": "hi"}).decode()
    lost.arm()
    lease = await store.acquire("ann")
    assert lost.lost == 1, "no reply was lost: the test did not test anything"
    assert isinstance(lease, Lease) and lease.next is not None and lease.next.pulled is not None
    assert lease.next.pulled.attempts == 1
    assert attempts(r, "ann", entry) == 1


async def test_a_resent_pull_counts_the_retry_once(r: redis.Redis, store: UserStore,
                                                   lost: LostReplies) -> None:
    entry = r.xadd(keys.inbox("bea"), {"text": "hi"}).decode()
    lease = await store.acquire("bea")
    assert isinstance(lease, Lease)
    lost.arm()
    pulled = await store.pull("bea", entry, entry)  # the second attempt (a handler failed)
    assert lost.lost == 1
    assert pulled.attempts == 2 and attempts(r, "bea", entry) == 2


async def test_a_resent_uncount_takes_the_attempt_back_once(r: redis.Redis, store: UserStore,
                                                            lost: LostReplies) -> None:
    entry = r.xadd(keys.inbox("cid"), {"text": "hi"}).decode()
    lease = await store.acquire("cid")
    assert isinstance(lease, Lease) and attempts(r, "cid", entry) == 1
    lost.arm()
    await store.uncount("cid", entry, lease)  # a hand-over: the acquire's count is taken back
    assert lost.lost == 1
    assert attempts(r, "cid", entry) == 0


async def test_a_batch_resent_in_the_middle_counts_each_attempt_once(r: redis.Redis, store: UserStore,
                                                                      lost: LostReplies) -> None:
    users = ["dan", "eve", "fay"]
    first = {u: r.xadd(keys.inbox(u), {"text": "one"}).decode() for u in users}
    second = {u: r.xadd(keys.inbox(u), {"text": "two"}).decode() for u in users}
    leases = await asyncio.gather(*(store.acquire(u) for u in users))
    assert all(isinstance(lease, Lease) for lease in leases)
    fresh = r.xadd(keys.inbox("gus"), {"text": "hi"}).decode()
    lost.arm()  # the batch: three commits (each hands back the user's next turn) and an acquire
    done = await asyncio.gather(*(store.commit(lease, first[lease.user], f"t-{lease.user}",
                                               Writes(turn_id=f"t-{lease.user}", reply=b"r"), 1)
                                  for lease in leases if isinstance(lease, Lease)),
                                store.acquire("gus"))
    assert lost.lost == 1
    assert max(store.batcher.stats.sizes) == 4  # one pipeline: 3 commits, 1 acquire
    for u in users:
        assert attempts(r, u, second[u]) == 1, u  # the next turn, handed back by the commit
        assert r.llen(keys.reply(u, f"t-{u}")) == 1  # one reply, whatever the re-send said
    assert attempts(r, "gus", fresh) == 1
    assert isinstance(done[-1], Lease)
