"""turn_commit's profile/memory/usage arguments on a real redis-server, and the hot path's
scripts (the submit, the pressure check, the acquire's context pack, the commit's release) on
it: what fakeredis' Lua runs in the unit tests and the explorer, on Redis's own Lua 5.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from protocol import keys
from protocol.codec import decode
from protocol.models import MemoryItem
from stores.memory import new_member
from stores.turns import Lease, StoreConfig, UserStore, Writes

if TYPE_CHECKING:
    from tests.conftest import RedisServer

pytestmark = pytest.mark.integration

U = "alice"
KEYS_ = [keys.lane(U), keys.state(U), keys.inbox(U), keys.session(U), keys.done(U), keys.reply(U, "t1"),
         keys.usage(U), keys.profile(U), keys.memory(U), keys.outbox(U)]


@pytest.fixture
async def store(r: redis.Redis, redis_server: RedisServer) -> AsyncIterator[UserStore]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield UserStore(client, "w1", StoreConfig(memory_max=3))
    await client.aclose()


def snapshot(r: redis.Redis) -> dict[str, object]:
    return {k.decode(): r.dump(k) for k in sorted(r.keys(f"fleet:u:{{{U}}}:*"))}


async def _lease(store: UserStore) -> Lease:
    lease = await store.acquire(U)
    assert isinstance(lease, Lease)
    return lease


async def test_commit_writes_profile_memories_and_usage(r: redis.Redis, store: UserStore) -> None:
    e1 = r.xadd(keys.inbox(U), {"text": "a"}).decode()
    e2 = r.xadd(keys.inbox(U), {"text": "b"}).decode()
    lease = await _lease(store)
    w = Writes(turn_id="t1", session_entry=b"s", reply=b"r", profile={"name": "Alice", "lang": "fr"},
               memories=[new_member("likes tea", 0.9, 1000.0), new_member("old", 0.1, 1.0)],
               usage={"turns": 1, "chars_in": 5})
    assert (await store.commit(lease, e1, "t1", w, 1)).result == "ok"
    assert r.hgetall(keys.profile(U)) == {b"name": b"Alice", b"lang": b"fr"}
    assert r.hgetall(keys.usage(U)) == {b"turns": b"1", b"chars_in": b"5"}
    pulled = await store.pull(U, "t2", e2)
    assert [m.text for m in pulled.pack.memories] == ["likes tea", "old"]  # ranked, decoded intact
    assert pulled.pack.profile["name"] == "Alice"
    w2 = Writes(turn_id="t2", usage={"turns": 1, "errors": 1})
    assert (await store.commit(lease, e2, "t2", w2, 2)).result == "ok"
    assert r.hgetall(keys.usage(U)) == {b"turns": b"2", b"chars_in": b"5", b"errors": b"1"}


async def test_memory_is_bounded_by_score(r: redis.Redis, store: UserStore) -> None:
    entry = r.xadd(keys.inbox(U), {"text": "a"}).decode()
    lease = await _lease(store)
    mems = [new_member(f"m{i}", imp, 1000.0) for i, imp in enumerate([0.1, 0.9, 0.5, 0.2, 0.8])]
    assert (await store.commit(lease, entry, "t1", Writes(memories=mems), 1)).result == "ok"
    kept = [decode(MemoryItem, m).text for m in r.zrevrange(keys.memory(U), 0, -1)]
    assert kept == ["m1", "m4", "m2"]  # memory_max=3 keeps the highest scores


BAD_ARGS = {
    "counts": [1, 0, 0, 0, "name"],  # says one profile pair, gives half of one
    "memory-score": [0, 1, 0, 0, b"member", "not-a-number"],
    "usage-increment": [0, 0, 1, 0, "turns", "x"],
    "deferral-count": [0, 0, 0, 1, "job-1"],  # says one deferral pair, gives half of one
}


@pytest.mark.parametrize("tail", BAD_ARGS.values(), ids=BAD_ARGS.keys())
async def test_bad_arguments_leave_no_partial_write(r: redis.Redis, store: UserStore,
                                                   tail: list[object]) -> None:
    entry = r.xadd(keys.inbox(U), {"text": "a"}).decode()
    lease = await _lease(store)
    before = snapshot(r)
    head: list[object] = [lease.owner, entry, "t1", b"session", 10, b"reply", 60_000, 10, 1, 10, "chat", 20,
                          5]
    with pytest.raises(ResponseError, match="BADARGS"):
        await store.scripts.turn_commit(keys=KEYS_, args=head + tail)
    assert snapshot(r) == before
    good = [1, 1, 1, 1, "name", "A", b"member", "1.0", "turns", 1, "job-1", b"payload"]
    assert await store.scripts.turn_commit(keys=KEYS_, args=head + good) == [b"ok", 1, []]  # released


@pytest.mark.parametrize("script", ["notification_ack", "notification_touch"])
async def test_the_notification_scripts_act_only_on_the_callers_own_entries(
        r: redis.Redis, redis_server: RedisServer, script: str) -> None:
    """What fakeredis runs in the explorer, on the real server: an entry another consumer
    reclaimed is neither acked nor taken back."""
    from stores.functions import Functions

    client = aioredis.Redis.from_url(redis_server.url)
    ready = keys.ready("chat")
    await client.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    mine = (await client.xadd(ready, {"user": "alice"})).decode()
    theirs = (await client.xadd(ready, {"user": "bob"})).decode()
    await client.xreadgroup(keys.GROUP, "w1", {ready: ">"})
    await client.xclaim(ready, keys.GROUP, "w2", 0, [theirs])
    run = getattr(Functions(client), script)
    assert await run(keys=[ready], args=[keys.GROUP, "w1", mine, theirs, "0-1"]) == 1
    pending = {p["message_id"].decode(): p["consumer"].decode()
               for p in await client.xpending_range(ready, keys.GROUP, "-", "+", 10)}
    assert pending == ({theirs: "w2"} if script == "notification_ack" else {mine: "w1", theirs: "w2"})
    await client.aclose()


async def test_a_busy_path_ack_needs_the_holders_carrier_on_the_real_server(
        r: redis.Redis, redis_server: RedisServer) -> None:
    from stores.functions import Functions

    client = aioredis.Redis.from_url(redis_server.url)
    ready = keys.ready("chat")
    await client.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    mine = (await client.xadd(ready, {"user": "alice"})).decode()
    await client.xreadgroup(keys.GROUP, "w1", {ready: ">"})
    scripts = Functions(client)
    args = [keys.GROUP, "w1", "w0", "alice", mine]
    assert await scripts.notification_ack_covered(keys=[ready], args=args) == -1
    await client.xadd(ready, {"user": "alice"})
    await client.xreadgroup(keys.GROUP, "w0", {ready: ">"})
    assert await scripts.notification_ack_covered(keys=[ready], args=args) == 1
    await client.aclose()


async def test_the_hot_path_scripts_on_the_real_server(r: redis.Redis, redis_server: RedisServer) -> None:
    from protocol.codec import encode as encode_model
    from protocol.models import SessionEntry, Turn
    from stores import submit

    client = aioredis.Redis.from_url(redis_server.url)
    try:
        turns = [Turn(turn_id=f"t{i}", user=U, text=f"turn {i}", ts=1.0) for i in range(2)]
        event = {"tier": "chat", "user": U, "ts": "1"}
        done = await submit.submit_turns(client, [(t, encode_model(t)) for t in turns], "chat",
                                         pressure=event, cluster=False)
        assert done.posted and r.xlen(keys.pressure("chat")) == 1  # no worker ever read the tier
        store = UserStore(client, "w1")
        lease = await store.acquire(U)
        assert isinstance(lease, Lease) and lease.next is not None and lease.next.pulled is not None
        assert (lease.next.turn_id, lease.next.pulled.attempts) == ("t0", 1)
        entry = encode_model(SessionEntry(turn_id="t0", entry=lease.next.entry, text="turn 0", reply="r",
                                          ts=1.0))
        w = Writes(turn_id="t0", session_entry=entry, reply=b"r", usage={"turns": 1})
        first = await store.commit(lease, lease.next.entry, "t0", w, 1)
        assert (first.result, first.released) == ("ok", False)
        assert first.next is not None and first.next.pulled is not None and first.next.turn_id == "t1"
        assert [e.turn_id for e in first.next.pulled.pack.session] == ["t0"]
        second = await store.commit(lease, first.next.entry, "t1", Writes(turn_id="t1"), 2)
        assert (second.result, second.released, second.next) == ("ok", True, None)
        assert r.get(keys.lane(U)) is None
        from stores.functions import Functions
        ready = keys.ready("chat")
        r.xgroup_create(ready, keys.GROUP, id="0")
        ids = [nid.decode() for _s, rows in r.xreadgroup(keys.GROUP, "w1", {ready: ">"}) for nid, _f in rows]
        assert await Functions(client).notification_ack(keys=[ready], args=[keys.GROUP, "w1", *ids]) == 2
    finally:
        await client.aclose()


# --- a key of the user's holding the wrong type ------------------------------------------------
# Redis does not undo a script that fails halfway: the scripts check every key they need before
# their first write, so a wrong-type key leaves the turn in the inbox, answered by nothing yet.
WRONG_TYPE = {"state": keys.state(U), "session": keys.session(U), "done": keys.done(U),
              "reply": keys.reply(U, "t1"), "usage": keys.usage(U), "profile": keys.profile(U),
              "memory": keys.memory(U), "outbox": keys.outbox(U)}
EVERY_WRITE = Writes(turn_id="t1", session_entry=b"s", reply=b"r", profile={"name": "A"},
                     memories=[new_member("m", 0.5, 1.0)], usage={"turns": 1}, deferrals=[("job-1", b"p")])


@pytest.mark.parametrize("role", WRONG_TYPE)
async def test_a_wrong_type_key_fails_the_commit_before_its_first_write(
        r: redis.Redis, store: UserStore, role: str) -> None:
    entry = r.xadd(keys.inbox(U), {"text": "a", "turn_id": "t1"}).decode()
    lease = await _lease(store)
    r.delete(WRONG_TYPE[role])
    r.set(WRONG_TYPE[role], "garbage")
    before = snapshot(r)
    with pytest.raises(Exception) as raised:  # noqa: PT011 - its kind is asserted below
        await store.commit(lease, entry, "t1", EVERY_WRITE, 1)
    assert snapshot(r) == before  # the cursor, the inbox and every other key as they were
    from stores.turns import UserDataError
    assert isinstance(raised.value, UserDataError)
    assert [(w.role, w.found) for w in raised.value.wrong] == [(role, "string")]
    assert f"{WRONG_TYPE[role]} holds a string" in str(raised.value)
    r.delete(WRONG_TYPE[role])
    assert (await store.commit(lease, entry, "t1", EVERY_WRITE, 1)).result == "ok"


async def test_a_wrong_type_context_key_hands_the_next_turn_back_without_its_pack(
        r: redis.Redis, store: UserStore) -> None:
    """The commit's release reads the next turn's context after its writes: a wrong-type key
    there must not fail the commit that was written; the worker reads the pack itself."""
    e1 = r.xadd(keys.inbox(U), {"text": "a", "turn_id": "t1"}).decode()
    e2 = r.xadd(keys.inbox(U), {"text": "b", "turn_id": "t2"}).decode()
    lease = await _lease(store)
    r.set(keys.session(U), "garbage")
    done = await store.commit(lease, e1, "t1", Writes(turn_id="t1", reply=b"r"), 1)
    assert (done.result, done.released) == ("ok", False)
    assert done.next is not None and (done.next.entry, done.next.pulled) == (e2, None)
    from stores.turns import UserDataError
    with pytest.raises(UserDataError, match="session holds a string, not a list"):
        await store.pull(U, "t2", e2)


@pytest.mark.parametrize("role", ["session", "profile", "memory", "done"])
async def test_the_acquire_hands_a_turn_over_whose_context_has_a_wrong_type_key(
        r: redis.Redis, store: UserStore, role: str) -> None:
    entry = r.xadd(keys.inbox(U), {"text": "a", "turn_id": "t1"}).decode()
    r.set(WRONG_TYPE[role], "garbage")
    lease = await _lease(store)
    assert lease.next is not None and (lease.next.entry, lease.next.pulled) == (entry, None)


@pytest.mark.parametrize(("key", "found"), [(keys.fence(U), "hash"), (keys.lane(U), "hash"),
                                            (keys.state(U), "string"), (keys.inbox(U), "string")])
async def test_the_acquire_writes_nothing_when_a_key_it_needs_has_the_wrong_type(
        r: redis.Redis, store: UserStore, key: str, found: str) -> None:
    if key != keys.inbox(U):
        r.xadd(keys.inbox(U), {"text": "a", "turn_id": "t1"})
    if found == "hash":
        r.hset(key, "x", "y")
    else:
        r.set(key, "x")
    before = snapshot(r)
    with pytest.raises(ResponseError) as raised:
        await store.acquire(U)
    assert snapshot(r) == before
    assert f"WRONGTYPE {key} holds a {found}" in str(raised.value)


@pytest.mark.parametrize(("key", "value", "error"), [(keys.fence(U), "x", "BADFENCE"),
                                                     (keys.lane(U), "nobody", "BADLANE")])
async def test_the_acquire_writes_nothing_when_the_lane_or_fence_is_garbage(
        r: redis.Redis, store: UserStore, key: str, value: str, error: str) -> None:
    r.xadd(keys.inbox(U), {"text": "a", "turn_id": "t1"})
    r.set(key, value)
    before = snapshot(r)
    with pytest.raises(ResponseError, match=error):
        await store.acquire(U)
    assert snapshot(r) == before


def _ran(r: redis.Redis, before: dict[str, int]) -> dict[str, int]:
    """The commands run since ``before`` (a function's inner ones each), less the counters' reads
    and a connection's handshake."""
    ran = {k: n - before.get(k, 0) for k, n in _counts(r).items() if k not in ("info", "hello", "client")}
    return {k: n for k, n in sorted(ran.items()) if n}


def _counts(r: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


async def test_a_turn_s_acquire_and_commit_run_only_the_commands_they_need(
        r: redis.Redis, store: UserStore) -> None:
    """Each ``redis.call`` costs Redis a few microseconds beyond its command (scripts/bench_functions):
    the hot path's budget, for a turn with every write but deferrals. The acquire checks no
    type it reads anyway (the inbox by its read) and reads the attempt count and the cancel mark
    together; the commit reads its cursor and the cancel mark together and checks the reply's
    key by its own write, the first."""
    r.rpush(keys.session(U), b"s0")
    entry = r.xadd(keys.inbox(U), {"text": "a", "turn_id": "t1"}).decode()
    before = _counts(r)
    lease = await _lease(store)
    assert _ran(r, before) == {"fcall": 1, "get": 2, "hget": 1, "hgetall": 1, "hmget": 1, "hset": 1,
                               "incr": 1, "lrange": 1, "set": 1, "xrange": 1, "zrevrange": 1, "zscore": 1}
    before = _counts(r)
    writes = Writes(turn_id="t1", session_entry=b"s", reply=b"r", profile={"name": "A"},
                    memories=[new_member("m", 0.5, 1.0)], usage={"turns": 1})
    assert (await store.commit(lease, entry, "t1", writes, 1)).result == "ok"
    assert _ran(r, before) == {"del": 1, "fcall": 1, "get": 1, "hdel": 1, "hincrby": 1, "hmget": 1, "hset": 2,
                               "pexpire": 1, "pttl": 1, "rpush": 2, "type": 4, "xdel": 1, "xrange": 2,
                               "zadd": 2, "zscore": 1}
