"""The submit on a real redis-server: what its atomicity honestly covers.

A submit is one script call (``turn_submit.lua``: the inbox ``XADD``, the ready ``XADD``, the
active ``ZADD``), applied together. Proven here: a connection lost mid-submit lands nothing (no
turn without its notification, waiting for the user's next submit), a retried round trip lands
the turn once, and a write the user's ACL refuses refuses the whole submit (the script checks
them all first).
Not covered, because Redis never rolls back: a command failing while the script runs (below).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from fleet.client import AsyncFleet, Fleet, UnknownTier
from protocol import keys
from protocol.codec import decode, encode
from protocol.models import Reply, Turn
from protocol.policy import TurnsPolicy, turns_policy
from stores.connection import connect_async, connect_sync
from stores.policies import write_policy

pytestmark = pytest.mark.integration


def cut_at(command: Any, tier: str = "chat") -> tuple[bytes, int | None]:
    """The packed bytes, and where the ready ``XADD`` begins (None if they hold none)."""
    data = b"".join(bytes(c) for c in command) if isinstance(command, list) else bytes(command)
    at = data.find(b"\r\n" + keys.ready(tier).encode() + b"\r\n")
    return data, (None if at < 0 else data.rfind(b"*", 0, at))


class Cut:
    """Arms one connection loss: the next round trip that carries a notification sends only the
    bytes before it (the inbox ``XADD`` and what precedes it), half-closes, waits until the
    server has run what it got and hung up, and fails with ``ConnectionError``."""

    armed = False


class CuttingConnection(redis.Connection):
    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        data, cut = cut_at(command)
        if not Cut.armed or cut is None:
            return super().send_packed_command(command, check_health)
        Cut.armed = False
        super().send_packed_command([data[:cut]], check_health)
        assert self._sock is not None
        self._sock.shutdown(socket.SHUT_WR)
        while self._sock.recv(65536):
            pass  # the server's replies to what it ran, then its close
        self.disconnect()
        raise redis.ConnectionError("connection lost mid-submit (test)")


class AsyncCuttingConnection(aioredis.Connection):
    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        data, cut = cut_at(command)
        if not Cut.armed or cut is None:
            return await super().send_packed_command(command, check_health)
        Cut.armed = False
        await super().send_packed_command([data[:cut]], check_health)
        assert self._writer is not None and self._reader is not None
        self._writer.write_eof()
        while await self._reader.read(65536):
            pass
        await self.disconnect()
        raise redis.ConnectionError("connection lost mid-submit (test)")


@pytest.fixture
def chat(r: redis.Redis) -> Iterator[redis.Redis]:
    write_policy(r, "chat", TurnsPolicy())
    Cut.armed = False
    yield r
    Cut.armed = False


def landed(r: redis.Redis, user: str) -> tuple[int, int]:
    return r.xlen(keys.inbox(user)), r.xlen(keys.ready("chat"))


# --- a lost connection ----------------------------------------------------------------------
def test_a_connection_lost_after_the_inbox_xadd_lands_nothing(chat, redis_server) -> None:
    client = Fleet(client=connect_sync(redis_server.role_url("fleet-client"), retries=0,
                                       connection_class=CuttingConnection), retry_s=0)
    client.submit("warm", "up")  # the tier check is done: the next round trip is the submit alone
    Cut.armed = True
    with pytest.raises(redis.ConnectionError):
        client.submit("alice", "hi")
    assert not Cut.armed
    assert landed(chat, "alice") == (0, 1)  # only warm's notification: no turn without its own
    client.submit("alice", "again")
    assert landed(chat, "alice") == (1, 2)


def test_a_retried_submit_lands_once(chat, redis_server) -> None:
    client = Fleet(client=connect_sync(redis_server.role_url("fleet-client"),
                                       connection_class=CuttingConnection))
    Cut.armed = True
    handle = client.submit("bob", "hi")
    assert not Cut.armed  # the connection was lost once, and the round trip retried
    assert landed(chat, "bob") == (1, 1)
    assert chat.xrange(keys.inbox("bob"))[0][1][b"m"]  # the turn, once
    assert handle.turn_id


def test_async_a_connection_lost_mid_submit_lands_nothing_and_a_retry_lands_once(chat, redis_server) -> None:
    async def run() -> None:
        lost = AsyncFleet(client=connect_async(redis_server.role_url("fleet-client"), retries=0,
                                               connection_class=AsyncCuttingConnection), retry_s=0)
        await lost.submit("warm", "up")
        Cut.armed = True
        with pytest.raises(redis.ConnectionError):
            await lost.submit("carol", "hi")
        await lost.aclose()
        assert landed(chat, "carol") == (0, 1)
        retried = AsyncFleet(client=connect_async(redis_server.role_url("fleet-client"),
                                                  connection_class=AsyncCuttingConnection))
        Cut.armed = True
        await retried.submit("carol", "hi")
        await retried.aclose()
        assert not Cut.armed

    asyncio.run(run())
    assert landed(chat, "carol") == (1, 2)


# --- the client's own retries: the same turn ids, sent again ---------------------------------
def test_the_client_sends_a_lost_submit_again_and_it_lands_once(chat, redis_server) -> None:
    # (the connection's own retries off: as when a failover outlasts them)
    client = Fleet(client=connect_sync(redis_server.role_url("fleet-client"), retries=0,
                                       connection_class=CuttingConnection))
    client.submit("warm", "up")
    Cut.armed = True
    handle = client.submit("dora", "hi")
    assert not Cut.armed  # lost once, sent again by the client
    assert landed(chat, "dora") == (1, 2)
    assert handle.turn_id


def test_a_submit_whose_reply_was_lost_is_sent_again_with_the_same_turn_id(chat, redis_server,
                                                                           monkeypatch) -> None:
    client = Fleet(client=connect_sync(redis_server.role_url("fleet-client"), retries=0))
    client.submit("warm", "up")
    lost: list[bool] = []

    def applied_then_lost(send: Any) -> Any:
        def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
            replies = send(self, *args, **kwargs)
            if not lost:
                lost.append(True)
                raise redis.exceptions.ClusterDownError("the reply was lost in a failover (test)")
            return replies
        return patched

    # the script goes out on a pipeline with a pressure check, else alone
    monkeypatch.setattr(redis.client.Pipeline, "execute", applied_then_lost(redis.client.Pipeline.execute))
    monkeypatch.setattr(redis.Redis, "execute_command", applied_then_lost(redis.Redis.execute_command))
    handle = client.submit("erin", "hi")
    monkeypatch.undo()
    assert lost
    copies = chat.xrange(keys.inbox("erin"))
    assert len(copies) == 2  # the outcome was unknown: sent again, under the same turn id, which a
    turn_ids = {decode(Turn, fields[b"m"]).turn_id for _id, fields in copies}  # worker answers once
    assert turn_ids == {handle.turn_id}


def test_a_reply_wait_cut_by_a_lost_connection_waits_on(chat, redis_server, monkeypatch) -> None:
    client = Fleet(client=connect_sync(redis_server.role_url("fleet-client"), retries=0))
    handle = client.submit("gil", "hi")
    reply = Reply(turn_id=handle.turn_id, user="gil", ok=True, text="hello")
    chat.rpush(keys.reply("gil", handle.turn_id), encode(reply))
    blpop = redis.Redis.blpop
    cut: list[bool] = []

    def cut_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not cut:
            cut.append(True)
            raise redis.ConnectionError("connection lost during the wait (test)")
        return blpop(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "blpop", cut_once)
    assert handle.result(5).text == "hello" and cut


@pytest.mark.acl_denials  # the wrong password, in ACL LOG
def test_a_final_error_is_raised_at_once_and_a_transient_one_when_the_time_is_up(chat, redis_server,
                                                                                 monkeypatch) -> None:
    refused = Fleet(redis_server.url.replace("://", "://fleet-client:wrong@"), retry_s=30)
    started = time.monotonic()
    with pytest.raises(redis.AuthenticationError):
        refused.submit("fay", "hi")
    assert time.monotonic() - started < 5  # not retried for 30 s

    def down(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise redis.exceptions.ClusterDownError("CLUSTERDOWN (test)")

    client = Fleet(client=connect_sync(redis_server.role_url("fleet-client")), retry_s=0.5)
    client.submit("warm", "up")
    monkeypatch.setattr(redis.client.Pipeline, "execute", down)  # a submit's script with a pressure check
    monkeypatch.setattr(redis.Redis, "execute_command", down)  # ... and alone
    started = time.monotonic()
    with pytest.raises(redis.exceptions.ClusterDownError):
        client.submit("fay", "hi")
    assert 0.4 < time.monotonic() - started < 5


# --- refused and failing commands -------------------------------------------------------------
def test_a_command_refused_while_queued_discards_the_whole_submit(chat, redis_server) -> None:
    chat.acl_setuser("nozadd", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-zadd"])
    try:
        url = f"redis://nozadd:pw@127.0.0.1:{redis_server.port}/0"
        with Fleet(client=connect_sync(url, retries=0)) as client, \
                pytest.raises(redis.exceptions.NoPermissionError, match="zadd"):
            client.submit("dave", "hi")
    finally:
        chat.acl_deluser("nozadd")
    assert landed(chat, "dave") == (0, 0)
    assert not chat.exists(keys.active("chat"))


def test_a_runtime_error_inside_the_submit_is_raised_and_not_rolled_back(chat, redis_server) -> None:
    """The limit of a Redis script (as of a transaction): a command failing while it runs leaves
    the writes before it applied; the script stops there (the active mark comes after)."""
    chat.set(keys.ready("chat"), "not a stream")
    with Fleet(redis_server.role_url("fleet-client")) as client, \
            pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        client.submit("erin", "hi")
    assert chat.xlen(keys.inbox("erin")) == 1  # no rollback: the turn is there, its notification not
    assert chat.zscore(keys.active("chat"), "erin") is None


@pytest.mark.acl_denials  # the client role's tier check is refused the registry (one ACL LOG entry)
def test_an_unknown_tier_writes_nothing_on_a_real_server(r, redis_server) -> None:
    with Fleet(redis_server.role_url("fleet-client")) as client, pytest.raises(UnknownTier):
        client.submit("frank", "hi", tier="nosuchtier")
    assert r.keys("*") == []


# --- replica_acks: a WAIT after the submit --------------------------------------------------
def test_a_submit_waits_for_replicas_when_the_tier_asks_and_goes_on_without_them(r, redis_server) -> None:
    """One node without replicas: ``WAIT 1 30`` times out with 0; the turn is queued anyway
    (one round trip: the WAIT rides after EXEC), and the shortfall is counted."""
    write_policy(r, "chat", turns_policy(replica_acks=1, replica_ack_timeout_ms=30))
    client = Fleet(client=connect_sync(redis_server.role_url("fleet-client")))
    before = int(r.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
    client.submit_many([("alice", "one"), ("bob", "two")])
    client.submit("alice", "three")
    assert landed(r, "alice") == (2, 3) and r.xlen(keys.inbox("bob")) == 1
    assert int(r.info("commandstats")["cmdstat_wait"]["calls"]) - before == 2  # one per round trip
    assert client.acks.waits == client.acks.short == {"submit": 2}
    assert client.acks.acked == {"submit": 0}


async def test_async_a_tier_without_replica_acks_sends_no_wait(r, redis_server) -> None:
    write_policy(r, "chat", TurnsPolicy())
    r.config_resetstat()
    client = AsyncFleet(client=connect_async(redis_server.role_url("fleet-client")))
    try:
        await client.submit("alice", "hi")
        await client.submit_many([("bob", "a"), ("carol", "b")])
    finally:
        await client.aclose()
    assert "cmdstat_wait" not in r.info("commandstats")
    assert client.acks.waits == {"submit": 0}
