"""The hot path: the group commit, the submit script and its pressure check, and the
inbox entries a worker still serves (old binary ones, plain ones) on fakeredis' Lua."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest
import redis.asyncio.client as aclient

from fleet.client import AsyncFleet
from protocol import keys
from protocol.codec import CodecError, encode
from protocol.models import Reply, Turn
from protocol.policy import TurnsPolicy
from stores import submit
from stores.batch import ScriptBatcher
from stores.functions import Functions
from stores.policies import write_policy
from stores.turns import Idle, Lease, UserStore
from worker.app import Worker
from worker.intake import decode_entry, entry_size
from worker.settings import WorkerSettings


@pytest.fixture
def pipelines(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The commands of every asyncio pipeline sent, in order."""
    sent: list[list[str]] = []
    real = aclient.Pipeline.execute

    async def execute(self: aclient.Pipeline, raise_on_error: bool = True) -> Any:
        sent.append([str(a[0]) for a, _o in self.command_stack])
        return await real(self, raise_on_error=raise_on_error)

    monkeypatch.setattr(aclient.Pipeline, "execute", execute)
    return sent


# --- the group commit ---------------------------------------------------------------------
async def test_the_acquires_of_one_loop_pass_go_in_one_pipeline(pipelines: list[list[str]]) -> None:
    r = fakeredis.FakeAsyncRedis()
    store = UserStore(r, "w1")
    for user in ("alice", "bob", "carol"):
        await r.xadd(keys.inbox(user), {"text": "hi"})
    pipelines.clear()
    got = await asyncio.gather(*(store.acquire(u) for u in ("alice", "bob", "carol", "dave")))
    assert [type(g) for g in got] == [Lease, Lease, Lease, Idle]
    assert pipelines == [["FCALL"] * 4]
    assert store.batcher.stats.sizes == {4: 1}
    await r.aclose()


async def test_acks_of_one_shard_merge_into_one_call() -> None:
    r = fakeredis.FakeAsyncRedis()
    scripts = Functions(r)
    batcher = ScriptBatcher(r)
    ready = keys.ready("chat")
    await r.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    ids = [(await r.xadd(ready, {"user": u})).decode() for u in ("alice", "bob", "carol")]
    await r.xreadgroup(keys.GROUP, "w1", {ready: ">"})
    calls = [batcher.call(scripts.notification_ack, [ready], [keys.GROUP, "w1", nid], merge_from=2)
             for nid in ids]
    assert await asyncio.gather(*calls) == [3, 3, 3]  # one call acked all three
    assert batcher.stats.calls == 1 and batcher.stats.requests == 3
    assert (await r.xpending(ready, keys.GROUP))["pending"] == 0
    await r.aclose()


async def test_a_call_whose_caller_is_gone_is_not_sent(pipelines: list[list[str]]) -> None:
    r = fakeredis.FakeAsyncRedis()
    store = UserStore(r, "w1")
    await r.xadd(keys.inbox("alice"), {"text": "hi"})
    pipelines.clear()
    task = asyncio.ensure_future(store.acquire("alice"))
    await asyncio.sleep(0)  # queued, not sent yet
    task.cancel()
    await asyncio.sleep(0.01)  # what is checked: nothing goes out in the time it would have taken
    assert pipelines == [] and await r.get(keys.lane("alice")) is None
    await r.aclose()


async def test_a_restarted_redis_reloads_the_scripts_and_sends_again() -> None:
    r = fakeredis.FakeAsyncRedis()
    store = UserStore(r, "w1")
    await r.xadd(keys.inbox("alice"), {"text": "hi"})
    await r.script_flush()
    assert isinstance(await store.acquire("alice"), Lease)


async def test_an_error_goes_to_its_own_caller_only() -> None:
    r = fakeredis.FakeAsyncRedis()
    store = UserStore(r, "w1")
    await r.xadd(keys.inbox("alice"), {"text": "hi"})
    await r.set(keys.inbox("bob"), "not a stream")
    alice, bob = await asyncio.gather(store.acquire("alice"), store.acquire("bob"), return_exceptions=True)
    assert isinstance(alice, Lease) and "WRONGTYPE" in str(bob)
    await r.aclose()


# --- the submit ---------------------------------------------------------------------------
def _turn(user: str, turn_id: str, tier: str = "chat") -> tuple[Turn, bytes]:
    t = Turn(turn_id=turn_id, user=user, tier=tier, text="hi", ts=1.0)
    return t, encode(t)


async def test_the_submit_script_writes_entries_notifications_and_active_marks() -> None:
    r = fakeredis.FakeAsyncRedis()
    built = [_turn("alice", "t1"), _turn("bob", "t2"), _turn("alice", "t3")]
    await submit.submit_turns(r, built, "chat", submit.SubmitOptions(shards=3), cluster=False)
    rows = await r.xrange(keys.inbox("alice"))
    assert [(f[b"turn_id"], f[b"tier"]) for _i, f in rows] == [(b"t1", b"chat"), (b"t3", b"chat")]
    assert rows[0][1][b"m"] == built[0][1]
    notes = {shard: [f[b"user"] for _i, f in await r.xrange(keys.ready("chat", shard))] for shard in range(3)}
    assert notes[keys.ready_shard("alice", 3)].count(b"alice") == 2
    assert notes[keys.ready_shard("bob", 3)].count(b"bob") == 1
    assert await r.zrange(keys.active("chat"), 0, -1) == [b"alice", b"bob"]
    await r.aclose()


async def test_a_tier_no_worker_ever_read_gets_a_pressure_event_and_a_served_one_none() -> None:
    r = fakeredis.FakeAsyncRedis()
    event = {"tier": "chat", "user": "alice", "ts": "1"}
    done = await submit.submit_turns(r, [_turn("alice", "t1")], "chat", pressure=event, cluster=False)
    assert done.posted and await r.xlen(keys.pressure("chat")) == 1  # no group: nobody serves it
    await r.xgroup_create(keys.ready("chat"), keys.GROUP, id="$")
    done = await submit.submit_turns(r, [_turn("alice", "t2")], "chat", pressure=event, cluster=False)
    assert done.posted  # nobody read it: the lag (1) is over the starting slots (0)
    await r.set(keys.starting("chat"), 4)
    done = await submit.submit_turns(r, [_turn("alice", "t3")], "chat", pressure=event, cluster=False)
    assert not done.posted and await r.xlen(keys.pressure("chat")) == 2  # starting workers absorb it
    await r.aclose()


async def test_a_client_checks_a_tier_for_pressure_at_most_every_10_ms(pipelines: list[list[str]],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import fleet.client

    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", TurnsPolicy())
    client = AsyncFleet(client=r)
    await client.submit("alice", "one")
    pipelines.clear()
    now = [fleet.client.time.monotonic() + 3600]
    monkeypatch.setattr(fleet.client.time, "monotonic", lambda: now[0])
    await client.submit("alice", "two")  # checked: the last check was long ago
    now[0] += submit.PRESSURE_CHECK_S / 2
    await client.submit("alice", "three")  # not checked: the script alone, on no pipeline
    now[0] += submit.PRESSURE_CHECK_S
    await client.submit("alice", "four")  # checked
    submits = [p for p in pipelines if p[0] == "FCALL"]  # (the tier's options are read again too)
    assert submits == [["FCALL", "FCALL"], ["FCALL", "FCALL"]]
    assert await r.xlen(keys.inbox("alice")) == 4
    await r.aclose()


# --- the entries a worker serves ----------------------------------------------------------
def test_a_binary_entrys_plain_fields_must_agree_with_its_turn() -> None:
    turn, payload = _turn("alice", "t1")
    fields = {b"m": payload, b"turn_id": b"t1", b"tier": b"chat"}
    assert decode_entry("alice", "chat", "1-0", fields, 1 << 16) == turn
    assert entry_size(fields) == len(payload)  # the plain copies are not the client's measure
    with pytest.raises(CodecError, match="turn_id field does not match"):
        decode_entry("alice", "chat", "1-0", {**fields, b"turn_id": b"t2"}, 1 << 16)
    with pytest.raises(CodecError, match="tier field does not match"):
        decode_entry("alice", "chat", "1-0", {**fields, b"tier": b"gpu"}, 1 << 16)


@pytest.mark.parametrize("form", ["binary-m-only", "plain", "binary"])
async def test_every_entry_form_is_served(form: str) -> None:
    """A new worker serves what was queued before it: binary entries written by an older
    client (``m`` alone), plain ones of any Redis client, and today's."""
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", TurnsPolicy(concurrency=2))
    turn, payload = _turn("alice", "t1")
    fields: dict[str, Any] = {
        "binary-m-only": {"m": payload}, "plain": {"text": "hi", "turn_id": "t1"},
        "binary": {"m": payload, "turn_id": "t1", "tier": "chat"}}[form]
    await r.xadd(keys.inbox("alice"), fields)
    await r.xadd(keys.ready("chat"), {"user": "alice"})
    worker = Worker(WorkerSettings(worker_id="w1", block_ms=50), r=r)
    run = asyncio.ensure_future(worker.run())
    try:
        got = await r.blpop([keys.reply("alice", "t1")], timeout=5)
        assert got is not None
        reply = Reply.model_validate_json(got[1]) if form == "plain" else None
        assert reply is None or (reply.ok and reply.text == "echo: hi")
    finally:
        worker.drain("test over")
        await asyncio.wait({run}, timeout=10)
        await r.aclose()
    stats = worker.tally.stats()
    assert stats.ok == 1 and stats.retries == 0
