"""A tier's dead letters are bounded in bytes as well as in entries (``dead_trim.lua``), against a
real redis-server: the oldest go first, the count follows every write and purge."""

from __future__ import annotations

import asyncio

import pytest
import redis

from protocol import keys
from stores.connection import connect_async
from stores.deadletters import dead_letter_async, entry_bytes, purge_dead_letters

pytestmark = pytest.mark.integration

BIG = b"x" * 10_000


def write(url: str, n: int, max_bytes: int, first: int = 0) -> None:
    async def go() -> None:
        ar = connect_async(url)
        try:
            for i in range(first, first + n):
                await dead_letter_async(ar, "chat", user=f"u{i}", entry=f"{i + 1}-0", turn_id=f"t{i}",
                                        reason="boom", worker="w", fields={b"text": BIG}, max_bytes=max_bytes)
        finally:
            await ar.aclose()
    asyncio.run(go())


def stored_bytes(r: redis.Redis) -> int:
    return sum(entry_bytes(f) for _, f in r.xrange(keys.dead("chat")))


def test_the_oldest_dead_letters_go_once_the_tier_holds_too_many_bytes(r, redis_server):
    one = 0
    write(redis_server.url, 1, 10**9)
    one = stored_bytes(r)
    assert int(r.get(keys.dead_bytes("chat"))) == one > len(BIG)  # the count is the entries' lengths

    cap = 5 * one + one // 2  # room for five entries
    write(redis_server.url, 11, cap, first=1)
    users = [f[b"user"] for _, f in r.xrange(keys.dead("chat"))]
    assert users == [f"u{i}".encode() for i in range(7, 12)]  # the five newest
    assert int(r.get(keys.dead_bytes("chat"))) == stored_bytes(r) <= cap

    first = r.xrange(keys.dead("chat"))[0][0].decode()
    assert purge_dead_letters(r, "chat", [first, "1-0"]) == 1  # its bytes leave the count
    assert int(r.get(keys.dead_bytes("chat"))) == stored_bytes(r)
    purge_dead_letters(r, "chat", None)
    assert not r.exists(keys.dead_bytes("chat")) and r.xlen(keys.dead("chat")) == 0


def test_a_counter_of_another_type_is_counted_again(r, redis_server):
    r.hset(keys.dead_bytes("chat"), "x", "y")  # hostile state
    write(redis_server.url, 2, 10**9)
    assert int(r.get(keys.dead_bytes("chat"))) == stored_bytes(r)
    r.set(keys.dead_bytes("chat"), "not a number")
    write(redis_server.url, 1, 10**9, first=2)
    assert int(r.get(keys.dead_bytes("chat"))) == stored_bytes(r) // 3  # counted from this entry on
