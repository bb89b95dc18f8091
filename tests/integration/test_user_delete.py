"""Erasing a user (``Fleet.delete_user``, ``fleet user delete``): every key of ``fleet:u:{U}:``,
fenced against a turn in flight, recorded in the ledger; against a real redis-server under the
roles' ACL and a real worker."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from fleet.client import AsyncFleet, Fleet, TurnTimeout
from protocol import keys
from protocol.codec import decode
from protocol.models import SessionEntry
from protocol.policy import TurnsPolicy
from stores import functions
from stores.connection import connect_async
from stores.deadletters import dead_letter_async, entry_bytes
from stores.group_assignment import pin_group
from stores.ledger import read_events
from tests.helpers import fleet_cli
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


def user_keys_left(r: redis.Redis, user: str) -> list[str]:
    return sorted(k.decode() for k in r.scan_iter(match=keys.user_prefix(user) + "*", count=1000))


def erasures(r: redis.Redis) -> list[dict[str, object]]:
    return [e.why for _, e in read_events(r, count=200) if getattr(e, "action", "") == "user-deleted"]


def give_every_key(r: redis.Redis, fleet: Fleet, user: str) -> None:
    """A served turn (state, session, done, usage, its reply list), then what a handler, the
    operator and a queued turn write (profile, memory, outbox, pins, lane, fence, inbox)."""
    handle = fleet.submit(user, "hello")
    assert handle.result(10).ok
    r.rpush(keys.reply(user, handle.turn_id), b"unread")  # a reply nobody popped yet
    r.hset(keys.profile(user), "name", "Ann")
    r.zadd(keys.memory(user), {b"likes tea": 1.0})
    r.xadd(keys.outbox(user), {"job": "j1", "d": b"x"})
    pin_group(r, user, "chat", "green")
    r.set(keys.lane(user), "ghost|7", px=60_000)
    r.xadd(keys.inbox(user), {"text": "queued", "turn_id": "t-queued"})


@pytest.mark.acl_denials  # the client role's attempt is refused, as it must be
def test_delete_user_erases_every_key_and_records_who_in_the_ledger(r, redis_server, start_worker):
    r.set(keys.policy("chat"), TurnsPolicy(handler="echo").to_json())
    start_worker()
    client = Fleet(redis_server.role_url("fleet-client"))
    give_every_key(r, client, "ann")
    give_every_key(r, client, "bob")
    for user in ("ann", "bob", "ann"):  # dead letters carry the user's turns too
        asyncio.run(dead_letter(redis_server.url, user))
    dead_before = int(r.get(keys.dead_bytes("chat")))
    left = user_keys_left(r, "ann")
    assert {keys.inbox("ann"), keys.state("ann"), keys.session("ann"), keys.done("ann"), keys.usage("ann"),
            keys.profile("ann"), keys.memory("ann"), keys.outbox("ann"), keys.pins("ann"),
            keys.lane("ann"), keys.fence("ann")} <= set(left)
    assert any(":reply:" in k for k in left)

    with pytest.raises(redis.exceptions.NoPermissionError):  # the client role may not erase
        client.delete_user("ann")
    # nor call the function on the keys it may write: it may DEL nothing
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.r.execute_command(*functions.command("user_delete", [keys.inbox("ann")],
                                                    [keys.user_prefix("ann")]))
    assert user_keys_left(r, "ann") == left

    erased = Fleet(redis_server.role_url("fleet-operator")).delete_user("ann")
    assert user_keys_left(r, "ann") == []
    assert erased.keys == len(left)
    assert user_keys_left(r, "bob")  # nobody else's
    assert [f[b"user"] for _, f in r.xrange(keys.dead("chat"))] == [b"bob"] and erased.dead_letters == 2
    assert int(r.get(keys.dead_bytes("chat"))) == sum(entry_bytes(f) for _, f in r.xrange(keys.dead("chat")))
    assert int(r.get(keys.dead_bytes("chat"))) < dead_before
    [entry] = erasures(r)
    assert entry["user"] == "ann" and entry["role"] == "fleet-operator" and entry["keys"] == len(left)
    assert "@" in str(entry["by"])
    ledger_text = json.dumps([e.model_dump() for _, e in read_events(r, count=200)])
    assert "hello" not in ledger_text and "likes tea" not in ledger_text  # never the data

    async def erase_async() -> int:
        fleet = AsyncFleet(redis_server.role_url("fleet-operator"))
        try:
            return (await fleet.delete_user("bob")).keys
        finally:
            await fleet.aclose()

    assert asyncio.run(erase_async()) > 0
    assert user_keys_left(r, "bob") == []


def test_fleet_user_delete_cli(r, redis_server, start_worker, fleet_env, tmp_path):
    r.set(keys.policy("chat"), TurnsPolicy(handler="echo").to_json())
    start_worker()
    assert Fleet(redis_server.role_url("fleet-client")).submit("cal", "hi").result(10).ok
    refused = fleet_cli(fleet_env, "user", "delete", "cal", cwd=tmp_path)
    assert refused.returncode == 2 and "--yes" in refused.stderr  # no terminal to confirm on
    assert user_keys_left(r, "cal")
    out = fleet_cli(fleet_env, "user", "delete", "cal", "--yes", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["user"] == "cal"
    assert user_keys_left(r, "cal") == []
    assert [e["user"] for e in erasures(r)][-1] == "cal"


async def dead_letter(url: str, user: str) -> None:
    ar = connect_async(url)
    try:
        await dead_letter_async(ar, "chat", user=user, entry="1-0", turn_id="t-dead", reason="boom",
                                worker="w", fields={b"text": f"secret of {user}".encode()})
    finally:
        await ar.aclose()


SLOW_MS = 4000


def test_a_turn_in_flight_writes_nothing_back_after_the_erasure(r, redis_server, start_worker):
    r.set(keys.policy("chat"), TurnsPolicy(handler="sleep", handler_options={"sleep_ms": 1}).to_json())
    w = start_worker()
    client = Fleet(redis_server.role_url("fleet-client"))
    assert client.submit("dan", "first").result(10).ok
    slow = client.submit("dan", "slow", meta={"sleep_ms": SLOW_MS})
    wait_until(lambda: r.get(keys.lane("dan")), 10, "the worker to take dan's lane")

    Fleet(redis_server.role_url("fleet-operator")).delete_user("dan")
    assert user_keys_left(r, "dan") == []

    # the worker finds its lane gone: the turn is stopped or its commit fenced, and nothing of
    # it is written back (no session, no reply, no usage), nor retried into a new inbox
    wait_until(lambda: "lane of dan lost" in w.log.read_text(), SLOW_MS / 1000 + 15,
               "the worker to find dan's lane gone")
    with pytest.raises(TurnTimeout):
        slow.result(1)
    assert client.submit("eve", "still served").result(10).text  # the fleet serves the others
    assert user_keys_left(r, "dan") == []

    # dan comes back: a new, empty user, whose session holds none of the erased turns
    assert client.submit("dan", "new start").result(15).ok
    session = [decode(SessionEntry, raw).text for raw in r.lrange(keys.session("dan"), 0, -1)]
    assert session == ["new start"]
    assert not r.exists(keys.reply("dan", slow.turn_id))
