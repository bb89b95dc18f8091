"""The lane and commit Lua scripts through stores.turns.UserStore, on fakeredis' Lua.

The scripts use plain Redis commands only (no cmsgpack), so they run on fakeredis' Lua as
on a real server; ``tests/integration/test_lua_real.py`` repeats the commit on a real one.
The acquire takes the lane only when a turn waits (else :class:`Idle`), and hands back that
turn with its context pack; the commit releases the lane when nothing waits after the new
cursor, else hands back the next turn.
"""

from __future__ import annotations

import asyncio
import gc
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import fakeredis
import pytest
from redis.exceptions import ResponseError

from protocol import keys
from stores.functions import NAMES, source
from stores.turns import Busy, Committed, Fenced, Idle, Lease, StoreConfig, UserStore, Writes

U = "alice"
TTL = 6_000


@dataclass
class Rig:
    r: fakeredis.FakeAsyncRedis
    w1: UserStore
    w2: UserStore

    async def submit(self, text: str = "x", user: str = U) -> str:
        entry = await self.r.xadd(keys.inbox(user), {"text": text})
        return entry.decode()

    async def lane(self, user: str = U) -> str | None:
        raw = await self.r.get(keys.lane(user))
        return raw.decode() if raw is not None else None

    async def cursor(self, user: str = U) -> str | None:
        raw = await self.r.hget(keys.state(user), "cursor")
        return raw.decode() if raw is not None else None

    async def expire_lane(self, user: str = U) -> None:
        await self.r.pexpire(keys.lane(user), 1)
        await asyncio.sleep(0.01)
        assert await self.lane(user) is None

    async def snapshot(self, user: str = U) -> dict[str, object]:
        """Every per-user key's content, to prove a call wrote nothing."""
        out: dict[str, object] = {}
        for key in sorted(k.decode() for k in await self.r.keys(f"fleet:u:{{{user}}}:*")):
            kind = (await self.r.type(key)).decode()
            if kind == "string":
                out[key] = await self.r.get(key)
            elif kind == "hash":
                out[key] = await self.r.hgetall(key)
            elif kind == "list":
                out[key] = await self.r.lrange(key, 0, -1)
            elif kind == "zset":
                out[key] = await self.r.zrange(key, 0, -1, withscores=True)
            elif kind == "stream":
                out[key] = await self.r.xrange(key)
        return out


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    server = fakeredis.FakeServer()
    r1 = fakeredis.FakeAsyncRedis(server=server)
    r2 = fakeredis.FakeAsyncRedis(server=server)
    cfg = StoreConfig(lane_ttl_ms=TTL, session_max=3, done_keep=2, reply_ttl_ms=60_000)
    yield Rig(r1, UserStore(r1, "w1", cfg), UserStore(r2, "w2", cfg))
    await r1.aclose()
    await r2.aclose()


def writes(turn_id: str, reply: bytes = b"reply", session: bytes = b"session") -> Writes:
    return Writes(turn_id=turn_id, session_entry=session, reply=reply)


async def take(rig: Rig, store: UserStore | None = None, user: str = U) -> Lease:
    """A lease on ``user``'s lane: a turn is submitted first if none waits (the acquire takes
    no lane for an empty inbox)."""
    store = store or rig.w1
    got = await store.acquire(user)
    if isinstance(got, Idle):
        await rig.submit(user=user)
        got = await store.acquire(user)
    assert isinstance(got, Lease), got
    return got


# --- scripts as files -------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_script_has_a_keys_argv_header_and_builds_no_key_names(name: str) -> None:
    text = source(name)
    header = [line for line in text.splitlines() if line.startswith("--")]
    assert any(re.match(r"-- KEYS\[1\]", line) for line in header)
    code = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    assert not any("fleet:" in line for line in code), "scripts take every key in KEYS (Cluster-safe)"


def test_unknown_script_name() -> None:
    with pytest.raises(KeyError):
        source("lane_steal")


# --- acquire ----------------------------------------------------------------------------

async def test_acquire_with_nothing_waiting_takes_no_lane(rig: Rig) -> None:
    assert await rig.w1.acquire(U) == Idle()
    assert await rig.lane() is None
    assert not await rig.r.exists(keys.fence(U))  # no token handed out


async def test_acquire_a_free_lane_with_the_first_turn(rig: Rig) -> None:
    e1 = await rig.submit("one")
    await rig.submit("two")
    got = await rig.w1.acquire(U)
    assert isinstance(got, Lease) and (got.user, got.owner, got.cursor) == (U, "w1|1", "")
    assert got.next is not None and got.next.entry == e1 and got.next.fields == {b"text": b"one"}
    assert await rig.lane() == "w1|1"
    assert 0 < await rig.r.pttl(keys.lane(U)) <= TTL


async def test_acquire_returns_the_cursor_and_the_turn_after_it(rig: Rig) -> None:
    e1, e2 = await rig.submit("one"), await rig.submit("two")
    await rig.r.hset(keys.state(U), "cursor", e1)
    got = await rig.w1.acquire(U)
    assert isinstance(got, Lease) and got.cursor == e1
    assert got.next is not None and got.next.entry == e2


async def test_acquire_reads_the_context_pack_of_the_first_turn(rig: Rig) -> None:
    from protocol.codec import encode
    from protocol.models import SessionEntry
    from stores.memory import new_member

    await rig.r.rpush(keys.session(U), encode(SessionEntry(turn_id="t0", entry="1-0", text="a", reply="b",
                                                           ts=1.0)), b"garbage")
    await rig.r.hset(keys.profile(U), "name", "Alice")
    member, score = new_member("likes tea", 0.5, 1.0)
    await rig.r.zadd(keys.memory(U), {member: score})
    e1 = (await rig.r.xadd(keys.inbox(U), {"text": "hi", "turn_id": "t1"})).decode()
    got = await rig.w1.acquire(U)
    assert isinstance(got, Lease) and got.next is not None and got.next.pulled is not None
    pulled = got.next.pulled
    assert got.next.turn_id == "t1"
    assert [e.turn_id for e in pulled.pack.session] == ["t0"]  # the corrupt entry is skipped
    assert pulled.pack.profile == {"name": "Alice"}
    assert [m.text for m in pulled.pack.memories] == ["likes tea"]
    assert (pulled.answered, pulled.attempts) == (False, 1)
    assert await rig.r.hget(keys.state(U), f"att:{e1}") == b"1|1"  # counted by the lease of token 1


async def test_acquire_sees_an_answered_turn_id(rig: Rig) -> None:
    await rig.r.zadd(keys.done(U), {"t1": 1})
    await rig.r.xadd(keys.inbox(U), {"text": "again", "turn_id": "t1"})
    got = await rig.w1.acquire(U)
    assert isinstance(got, Lease) and got.next is not None and got.next.pulled is not None
    assert got.next.pulled.answered is True


async def test_a_plain_turn_without_turn_id_is_read_for_its_entry_id(rig: Rig) -> None:
    e1 = await rig.submit()
    got = await rig.w1.acquire(U)
    assert isinstance(got, Lease) and got.next is not None
    assert got.next.turn_id == e1 and got.next.pulled is not None


async def test_a_binary_turn_from_before_the_plain_fields_gets_no_context(rig: Rig) -> None:
    """An entry written by an older client (``m`` alone) names no turn id the script can read:
    no context and no attempt counted; the worker pulls them itself."""
    e1 = (await rig.r.xadd(keys.inbox(U), {"m": b"\x80"})).decode()
    got = await rig.w1.acquire(U)
    assert isinstance(got, Lease) and got.next is not None
    assert (got.next.entry, got.next.pulled, got.next.turn_id) == (e1, None, "")
    assert await rig.r.hget(keys.state(U), f"att:{e1}") is None


async def test_a_turn_of_another_tier_gets_no_context_and_no_attempt(rig: Rig) -> None:
    e1 = (await rig.r.xadd(keys.inbox(U), {"text": "x", "tier": "gpu"})).decode()
    got = await rig.w1.acquire(U)
    assert isinstance(got, Lease) and got.next is not None and got.next.pulled is None
    assert await rig.r.hget(keys.state(U), f"att:{e1}") is None


async def test_reacquire_by_the_owner_keeps_the_token_and_extends(rig: Rig) -> None:
    first = await take(rig)
    await rig.r.pexpire(keys.lane(U), 100)
    again = await rig.w1.acquire(U)
    assert isinstance(again, Lease) and (again.owner, again.cursor) == (first.owner, first.cursor)
    assert await rig.r.pttl(keys.lane(U)) > 100


async def test_reacquire_by_the_owner_with_nothing_waiting_gives_the_lane_up(rig: Rig) -> None:
    lease = await take(rig)
    assert lease.next is not None
    assert (await rig.w1.commit(lease, lease.next.entry, "t1", Writes(), 1)).released
    await rig.r.set(keys.lane(U), lease.owner)  # as if the release had been lost
    assert await rig.w1.acquire(U) == Idle()
    assert await rig.lane() is None


async def test_acquire_a_held_lane_says_who_holds_it(rig: Rig) -> None:
    await take(rig)
    got = await rig.w2.acquire(U)
    assert isinstance(got, Busy)
    assert got.holder == "w1|1"
    assert 0 < got.ttl_ms <= TTL
    assert await rig.lane() == "w1|1"


async def test_an_expired_lane_goes_to_the_next_with_a_higher_token(rig: Rig) -> None:
    await take(rig)
    await rig.expire_lane()
    new = await rig.w2.acquire(U)
    assert isinstance(new, Lease)
    assert new.owner == "w2|2"
    again = await rig.w1.acquire(U)
    assert isinstance(again, Busy) and again.holder == "w2|2"


async def test_lanes_of_different_users_are_independent(rig: Rig) -> None:
    a = await take(rig, rig.w1, "alice")
    b = await take(rig, rig.w2, "bob")
    assert (a.owner, b.owner) == ("w1|1", "w2|1")  # fencing counters are per user


# --- renew ------------------------------------------------------------------------------

async def test_renew_script_extends_only_the_owner(rig: Rig) -> None:
    lease = await take(rig)
    await rig.r.pexpire(keys.lane(U), 100)
    assert await rig.w1.scripts.lease_renew(keys=[keys.lane(U)], args=[lease.owner, TTL]) == 1
    assert await rig.r.pttl(keys.lane(U)) > 100
    assert await rig.w1.scripts.lease_renew(keys=[keys.lane(U)], args=["w1|999", TTL]) == 0
    assert await rig.w1.scripts.lease_renew(keys=[keys.lane(U)], args=["w2|1", TTL]) == 0


async def test_renew_script_does_not_resurrect_an_expired_lane(rig: Rig) -> None:
    lease = await take(rig)
    await rig.expire_lane()
    assert await rig.w1.scripts.lease_renew(keys=[keys.lane(U)], args=[lease.owner, TTL]) == 0
    assert await rig.lane() is None


async def test_renew_nothing(rig: Rig) -> None:
    assert await rig.w1.renew([]) == []


async def test_renew_extends_held_leases_and_reports_lost_ones(rig: Rig) -> None:
    mine = await take(rig, rig.w1, "alice")
    lost = await take(rig, rig.w1, "bob")
    await rig.r.pexpire(keys.lane("alice"), 100)
    await rig.expire_lane("bob")
    try:
        result = await rig.w1.renew([mine, lost])
    finally:
        gc.collect()
    assert result == [True, False]
    assert await rig.r.pttl(keys.lane("alice")) > 100


# --- the commit's release ------------------------------------------------------------------

async def test_a_commit_with_nothing_after_it_releases_the_lane(rig: Rig) -> None:
    e1 = await rig.submit()
    lease = await take(rig)
    assert await rig.w1.commit(lease, e1, "t1", writes("t1"), 1) == Committed("ok", True)
    assert await rig.lane() is None


async def test_a_commit_keeps_the_lane_and_hands_back_the_next_turn(rig: Rig) -> None:
    e1, e2 = await rig.submit("one"), await rig.submit("two")
    lease = await take(rig)
    done = await rig.w1.commit(lease, e1, "t1", writes("t1"), 1)
    assert (done.result, done.released) == ("ok", False)
    assert done.next is not None and done.next.entry == e2 and done.next.pulled is not None
    assert [e.reply for e in done.next.pulled.pack.session] == []  # b"session" is no SessionEntry
    assert done.next.pulled.attempts == 1
    assert await rig.lane() == lease.owner


async def test_the_next_turns_context_holds_the_turn_just_committed(rig: Rig) -> None:
    from protocol.codec import encode
    from protocol.models import SessionEntry

    e1, _e2 = await rig.submit("one"), await rig.submit("two")
    lease = await take(rig)
    entry = encode(SessionEntry(turn_id="t1", entry=e1, text="one", reply="r", ts=1.0))
    done = await rig.w1.commit(lease, e1, "t1", writes("t1", session=entry), 1)
    assert done.next is not None and done.next.pulled is not None
    assert [e.turn_id for e in done.next.pulled.pack.session] == ["t1"]


async def test_a_turn_that_arrives_before_the_commit_keeps_the_lane(rig: Rig) -> None:
    e1 = await rig.submit("one")
    lease = await take(rig)
    e2 = await rig.submit("two")  # arrives while the worker is in the handler
    done = await rig.w1.commit(lease, e1, "t1", writes("t1"), 1)
    assert not done.released and done.next is not None and done.next.entry == e2
    assert (await rig.w1.commit(lease, e2, "t2", writes("t2"), 2)).released
    assert await rig.lane() is None


async def test_a_stale_commit_serves_on_from_the_cursor_redis_has(rig: Rig) -> None:
    """A failover can lose a commit the worker was told of: the next commit is stale, and the
    lost turn comes back as the next one (its cursor, not the worker's)."""
    e1, e2 = await rig.submit("one"), await rig.submit("two")
    lease = await take(rig)
    done = await rig.w1.commit(lease, e2, "t2", writes("t2"), 1)  # as if e1 were committed
    assert (done.result, done.released) == ("stale", False)
    assert done.next is not None and done.next.entry == e1


# --- drop -------------------------------------------------------------------------------

async def test_drop_gives_the_lane_up_even_with_turns_waiting(rig: Rig) -> None:
    lease = await take(rig)
    assert await rig.w1.drop(lease) is True
    assert await rig.lane() is None
    assert isinstance(await rig.w2.acquire(U), Lease)


async def test_drop_by_a_non_owner_changes_nothing(rig: Rig) -> None:
    lease = await take(rig)
    assert await rig.w2.drop(Lease(U, "w2|1", "")) is False
    assert await rig.w1.drop(Lease(U, "w1|7", "")) is False  # right worker, wrong token
    assert await rig.lane() == lease.owner


# --- commit -----------------------------------------------------------------------------

async def test_commit_writes_everything_with_the_cursor(rig: Rig) -> None:
    e1 = await rig.submit("one")
    await rig.submit("two")
    lease = await take(rig)
    pulled = await rig.w1.pull(U, "t1", e1)
    assert (pulled.answered, pulled.attempts) == (False, 2)  # the acquire counted the first
    assert (await rig.w1.commit(lease, e1, "t1", writes("t1"), 1234)).result == "ok"
    assert await rig.cursor() == e1
    assert await rig.r.hget(keys.state(U), f"att:{e1}") is None
    assert e1.encode() not in [e for e, _ in await rig.r.xrange(keys.inbox(U))]  # done entries go
    assert await rig.r.xlen(keys.inbox(U)) == 1
    assert await rig.r.lrange(keys.session(U), 0, -1) == [b"session"]
    assert await rig.r.zscore(keys.done(U), "t1") == 1234
    assert await rig.r.lrange(keys.reply(U, "t1"), 0, -1) == [b"reply"]
    assert 0 < await rig.r.pttl(keys.reply(U, "t1")) <= 60_000
    assert (await rig.w1.pull(U, "t1", e1)).answered is True


async def test_commit_with_nothing_to_write_only_advances(rig: Rig) -> None:
    e1 = await rig.submit()
    lease = await take(rig)
    assert (await rig.w1.commit(lease, e1, "t1", Writes(), 1)).result == "ok"
    assert await rig.cursor() == e1
    for key in (keys.session(U), keys.done(U), keys.reply(U, "t1")):
        assert not await rig.r.exists(key)


async def test_commit_by_a_stale_owner_is_fenced_and_writes_nothing(rig: Rig) -> None:
    e1 = await rig.submit()
    old = await take(rig)
    await rig.expire_lane()
    new = await take(rig, rig.w2)
    before = await rig.snapshot()
    with pytest.raises(Fenced):
        await rig.w1.commit(old, e1, "t1", writes("t1"), 1)
    assert await rig.snapshot() == before
    assert (await rig.w2.commit(new, e1, "t1", writes("t1"), 1)).result == "ok"


async def test_commit_after_the_lane_expired_is_fenced(rig: Rig) -> None:
    e1 = await rig.submit()
    lease = await take(rig)
    await rig.expire_lane()
    with pytest.raises(Fenced):
        await rig.w1.commit(lease, e1, "t1", writes("t1"), 1)
    assert await rig.cursor() is None


async def test_recommit_of_the_same_entry_is_stale_and_writes_nothing(rig: Rig) -> None:
    """(A pipeline resent after a lost reply runs the commit twice.) The second is stale and
    writes nothing: it hands the next turn back again, its attempt already counted by this lease."""
    e1, e2 = await rig.submit(), await rig.submit()
    lease = await take(rig)
    assert (await rig.w1.commit(lease, e1, "t1", writes("t1"), 1)).result == "ok"
    before = await rig.snapshot()
    again = await rig.w1.commit(lease, e1, "t1", writes("t1"), 2)
    assert (again.result, again.released) == ("stale", False)
    assert again.next is not None and again.next.entry == e2
    after = await rig.snapshot()
    assert again.next.pulled is not None and again.next.pulled.attempts == 1
    assert after == before
    assert await rig.r.llen(keys.session(U)) == 1
    assert await rig.r.llen(keys.reply(U, "t1")) == 1


async def test_a_recommit_after_the_release_is_fenced(rig: Rig) -> None:
    e1 = await rig.submit()
    lease = await take(rig)
    assert (await rig.w1.commit(lease, e1, "t1", writes("t1"), 1)).released
    with pytest.raises(Fenced):
        await rig.w1.commit(lease, e1, "t1", writes("t1"), 2)


async def test_a_resubmitted_turn_is_answered_once_even_on_the_reject_path(rig: Rig) -> None:
    """Found by the explorer (seed 11): a turn submitted twice (the first submit's reply was
    lost) and rejected both times got two error replies. The commit itself dedupes by turn id."""
    e1, e2 = await rig.submit("first copy"), await rig.submit("second copy")
    lease = await take(rig)
    assert (await rig.w1.commit(lease, e1, "t1", writes("t1", reply=b"error"), 1)).result == "ok"
    assert (await rig.w1.commit(lease, e2, "t1", writes("t1", reply=b"error again"), 2)).result == "dup"
    assert await rig.r.lrange(keys.reply(U, "t1"), 0, -1) == [b"error"]
    assert await rig.r.lrange(keys.session(U), 0, -1) == [b"session"]
    assert await rig.cursor() == e2
    assert await rig.r.xlen(keys.inbox(U)) == 0
    assert await rig.lane() is None  # nothing waits after the dup: released with it


async def test_commit_out_of_order_is_stale(rig: Rig) -> None:
    e1, e2 = await rig.submit("one"), await rig.submit("two")
    lease = await take(rig)
    before = await rig.snapshot()
    assert (await rig.w1.commit(lease, e2, "t2", writes("t2"), 1)).result == "stale"
    after = await rig.snapshot()
    after[keys.state(U)] = before[keys.state(U)]  # (only e1's attempt count: it is handed back)
    assert after == before
    assert (await rig.w1.commit(lease, e1, "t1", writes("t1"), 1)).result == "ok"
    assert (await rig.w1.commit(lease, e2, "t2", writes("t2"), 1)).result == "ok"


async def test_commit_of_an_unknown_entry_is_stale(rig: Rig) -> None:
    lease = await take(rig)  # (its own turn waits: the stale commit hands it back)
    assert (await rig.w1.commit(lease, "1-0", "t1", writes("t1"), 1)).result == "stale"


async def test_session_and_done_are_bounded(rig: Rig) -> None:
    entries = [await rig.submit(str(i)) for i in range(5)]
    lease = await take(rig)
    for i, entry in enumerate(entries):
        w = writes(f"t{i}", session=f"s{i}".encode())
        assert (await rig.w1.commit(lease, entry, f"t{i}", w, i)).result == "ok"
    # cut back to the bound once a push takes the session past it (the others trimmed with it)
    assert await rig.r.lrange(keys.session(U), 0, -1) == [b"s2", b"s3", b"s4"]  # session_max=3
    assert await rig.r.zrange(keys.done(U), 0, -1) == [b"t3", b"t4"]  # done_keep=2
    assert await rig.r.xlen(keys.inbox(U)) == 0


async def test_pull_counts_attempts_until_the_commit(rig: Rig) -> None:
    e1 = await rig.submit()
    lease = await take(rig)
    assert [(await rig.w1.pull(U, "t1", e1)).attempts for _ in range(3)] == [2, 3, 4]  # 1: the acquire
    await rig.w1.commit(lease, e1, "t1", Writes(), 1)
    assert await rig.r.hget(keys.state(U), f"att:{e1}") is None


async def test_a_takeover_resumes_from_the_cursor(rig: Rig) -> None:
    e1, e2 = await rig.submit("one"), await rig.submit("two")
    old = await take(rig)
    await rig.w1.commit(old, e1, "t1", writes("t1"), 1)
    await rig.expire_lane()  # w1 dies mid-way through e2
    new = await rig.w2.acquire(U)
    assert isinstance(new, Lease) and new.cursor == e1
    assert new.next is not None and new.next.entry == e2
    assert [e for e, _ in await rig.w2.read_inbox(U, new.cursor, 10)] == [e2]


async def test_an_undecodable_argument_leaves_no_partial_write(rig: Rig) -> None:
    # pair counts that do not match the arguments: the script fails before its first write
    e1 = await rig.submit()
    lease = await take(rig)
    before = await rig.snapshot()
    args = [lease.owner, e1, "t1", b"session", 3, b"reply", 60_000, 2, 1, 10, "chat", 20, 5, 2, 0, 0, 0,
            "only-one"]
    keys_ = [keys.lane(U), keys.state(U), keys.inbox(U), keys.session(U), keys.done(U),
             keys.reply(U, "t1"), keys.usage(U), keys.profile(U), keys.memory(U), keys.outbox(U)]
    with pytest.raises(ResponseError):
        await rig.w1.scripts.turn_commit(keys=keys_, args=args)
    assert await rig.snapshot() == before


# --- deferrals: the outbox is written with the turn, once --------------------------------------

async def test_a_commit_writes_its_deferrals_to_the_outbox_and_tells_the_relay(rig: Rig) -> None:
    e1 = await rig.submit()
    lease = await take(rig)
    w = Writes(turn_id="t1", reply=b"r", deferrals=[("job-0", b"p0"), ("job-1", b"p1")])
    assert (await rig.w1.commit(lease, e1, "t1", w, 1)).result == "ok"
    rows = await rig.r.xrange(keys.outbox(U))
    assert [(f[b"job"], f[b"d"]) for _, f in rows] == [(b"job-0", b"p0"), (b"job-1", b"p1")]
    hints = await rig.r.xrange(keys.OUTBOX_READY)
    assert [f for _, f in hints] == [{b"user": U.encode()}]


async def test_a_commit_without_deferrals_costs_no_outbox_and_no_notification(rig: Rig) -> None:
    e1 = await rig.submit()
    lease = await take(rig)
    assert (await rig.w1.commit(lease, e1, "t1", writes("t1"), 1)).result == "ok"
    assert not await rig.r.exists(keys.outbox(U))
    assert not await rig.r.exists(keys.OUTBOX_READY)


async def test_a_duplicate_turn_writes_no_deferral_twice(rig: Rig) -> None:
    """A turn submitted twice (the client retried): the second copy commits as 'dup' and adds
    nothing to the outbox, nor a second notification."""
    e1, e2 = await rig.submit("first copy"), await rig.submit("second copy")
    lease = await take(rig)
    w = Writes(turn_id="t1", reply=b"r", deferrals=[("job-0", b"p0")])
    assert (await rig.w1.commit(lease, e1, "t1", w, 1)).result == "ok"
    assert (await rig.w1.commit(lease, e2, "t1", w, 2)).result == "dup"
    assert await rig.r.xlen(keys.outbox(U)) == 1
    assert await rig.r.xlen(keys.OUTBOX_READY) == 1


async def test_a_stale_or_fenced_commit_writes_no_deferral(rig: Rig) -> None:
    e1, _ = await rig.submit(), await rig.submit()
    lease = await take(rig)
    w = Writes(turn_id="t1", reply=b"r", deferrals=[("job-0", b"p0")])
    assert (await rig.w1.commit(lease, e1, "t1", w, 1)).result == "ok"
    assert (await rig.w1.commit(lease, e1, "t1", w, 2)).result == "stale"
    await rig.expire_lane()
    with pytest.raises(Fenced):
        await rig.w1.commit(lease, e1, "t1", w, 3)
    assert await rig.r.xlen(keys.outbox(U)) == 1
    assert await rig.r.xlen(keys.OUTBOX_READY) == 1


async def test_a_lost_relay_notification_does_not_fail_the_committed_turn(
        rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def down(*args: object, **kwargs: object) -> None:
        raise RedisConnectionError("connection lost")

    e1 = await rig.submit()
    lease = await take(rig)
    monkeypatch.setattr(rig.w1.r, "xadd", down)
    w = Writes(turn_id="t1", reply=b"r", deferrals=[("job-0", b"p0")])
    assert (await rig.w1.commit(lease, e1, "t1", w, 1)).result == "ok"  # committed: not retried
    assert await rig.r.xlen(keys.outbox(U)) == 1  # its entry waits for the relay's sweep
    assert not await rig.r.exists(keys.OUTBOX_READY)
    assert "sweep will find the outbox" in caplog.text
