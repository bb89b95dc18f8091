"""Ready shards ("a tier spread over shards"): the shard function, the keys, the
policy field, the names of notifications, and the readers that sum or walk every shard."""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter

import fakeredis
import pytest
from redis.crc import key_slot

from protocol import keys
from protocol.policy import PolicyError, parse_policy
from stores import takeover, worker_ops
from stores.backlog import existing_shards, read_backlog
from stores.functions import Functions
from stores.submit_options import ready_shards_of


def test_the_shard_of_a_user_is_crc32_mod_n_and_never_pythons_hash() -> None:
    assert keys.ready_shard("alice", 1) == 0
    assert keys.ready_shard("alice", 3) == zlib.crc32(b"alice") % 3
    # fixed values: the same in every process and version (PYTHONHASHSEED plays no part)
    assert [keys.ready_shard(u, 3) for u in ("alice", "bob", "carol", "dave")] == \
        [zlib.crc32(u.encode()) % 3 for u in ("alice", "bob", "carol", "dave")]
    assert keys.ready_shard("user042", 64) == zlib.crc32(b"user042") % 64


@pytest.mark.parametrize("n", [2, 3, 8])
def test_users_spread_evenly_over_the_shards(n: int) -> None:
    counts = Counter(keys.ready_shard(f"user{i}", n) for i in range(3000))
    assert set(counts) == set(range(n))
    assert max(counts.values()) < 1.2 * 3000 / n


def test_shard_zero_is_todays_key_and_the_others_have_their_own_tag() -> None:
    assert keys.ready("chat") == keys.ready("chat", 0) == "fleet:{chat}:ready"
    assert keys.ready("chat", 1) == "fleet:{chat#1}:ready"
    assert keys.ready("chat", 63) == "fleet:{chat#63}:ready"
    for bad in (-1, 64):
        with pytest.raises(ValueError):
            keys.ready("chat", bad)
    for k in range(keys.MAX_READY_SHARDS):
        assert keys.shard_of_ready("chat", keys.ready("chat", k).encode()) == k
    with pytest.raises(ValueError):
        keys.shard_of_ready("chat", keys.ready("gpu", 1))


def test_three_shards_of_chat_sit_in_three_different_thirds_of_the_slot_space() -> None:
    # a 3-master cluster with the default even split gives each master one third
    thirds = {key_slot(keys.ready("chat", k).encode()) * 3 // 16384 for k in range(3)}
    assert thirds == {0, 1, 2}
    # and the shards of a tier never share a slot with each other
    assert len({key_slot(keys.ready("chat", k).encode()) for k in range(8)}) == 8


def test_ready_shards_is_a_bounded_policy_field_defaulting_to_one() -> None:
    assert parse_policy("{}").ready_shards == 1
    assert parse_policy('{"ready_shards": 3}').ready_shards == 3
    assert parse_policy('{"ready_shards": 64}').ready_shards == 64
    for bad in ("0", "65", "-1", '"x"'):
        with pytest.raises(PolicyError, match="ready_shards"):
            parse_policy(f'{{"ready_shards": {bad}}}')


def test_the_client_reads_the_count_leniently() -> None:
    assert ready_shards_of(b'{"ready_shards": 3}', None) == 3
    assert ready_shards_of(b"{not json", b'{"ready_shards": 2}') == 2  # the last good one
    assert ready_shards_of(None, None) == 1
    assert ready_shards_of(b'{"ready_shards": 999}', None) == 1
    assert ready_shards_of(b'{"ready_shards": true}', None) == 1
    assert ready_shards_of(b"[1]", None) == 1


def test_a_notification_name_carries_its_shard() -> None:
    assert worker_ops.nid_of(0, "5-1") == "5-1"  # shard 0: the stream id as it always was
    assert worker_ops.nid_of(2, "5-1") == "2/5-1"
    assert worker_ops.split_nid("5-1") == (0, "5-1")
    assert worker_ops.split_nid("12/7-0") == (12, "7-0")
    assert worker_ops.by_shard(["1-0", "2/3-0", "4-0", "2/5-0"]) == {0: ["1-0", "4-0"], 2: ["3-0", "5-0"]}


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def test_backlog_and_status_sum_every_shard_that_exists(r: fakeredis.FakeRedis) -> None:
    r.xadd(keys.ready("chat"), {"user": "a"})
    for u in ("b", "c", "d"):
        r.xadd(keys.ready("chat", 2), {"user": u})  # shard 2 exists, shard 1 does not
    assert existing_shards(r, ["chat", "gpu"]) == {"chat": [0, 2], "gpu": [0]}
    r.xgroup_create(keys.ready("chat", 2), keys.GROUP, id="0")
    r.xreadgroup(keys.GROUP, "w1", {keys.ready("chat", 2): ">"}, count=1)
    b = read_backlog(r, ["chat"], live={"w1"})["chat"]
    assert (b.undelivered, b.pending, b.in_progress) == (3, 1, 1)  # 1 on shard 0 (no group), 2 on 2
    assert b.backlog == 3 and dict(b.held) == {"w1": 1}


def test_takeover_walks_every_shard(r: fakeredis.FakeRedis) -> None:
    for k, user in ((0, "a"), (1, "b"), (3, "c")):
        r.xgroup_create(keys.ready("chat", k), keys.GROUP, id="0", mkstream=True)
        r.xadd(keys.ready("chat", k), {"user": user})
        r.xreadgroup(keys.GROUP, "w-dead", {keys.ready("chat", k): ">"})
    assert takeover.consumers(r, "chat") == {"w-dead": 3}
    done = takeover.take_over(r, "chat", "w-dead")
    assert sorted(done.users) == ["a", "b", "c"] and done.acked == 3 and done.consumer_removed
    assert takeover.consumers(r, "chat") == {}
    # each fresh notification on the shard of the one it replaced
    assert [r.xlen(keys.ready("chat", k)) for k in (0, 1, 3)] == [2, 2, 2]


def test_a_worker_reads_a_shard_beyond_the_policy_count_while_it_exists() -> None:
    async def go() -> None:
        ar = fakeredis.FakeAsyncRedis()
        assert await worker_ops.shards_in_use(ar, "chat", 1) == 1
        await ar.xadd(keys.ready("chat", 4), {"user": "late"})  # a client on an old count of 5
        assert await worker_ops.shards_in_use(ar, "chat", 1) == 5
        assert await worker_ops.shards_in_use(ar, "chat", 8) == 8
        assert await worker_ops.more_shards(ar, "chat", 1, 1) == 5  # joined the group on each
        for k in range(5):
            assert await ar.xinfo_groups(keys.ready("chat", k))
        assert await worker_ops.more_shards(ar, "chat", 1, 7) == 7  # never fewer
        got = await worker_ops.read_ready(ar, "chat", "w1", 10, 0, 5)
        assert [(nid.split("/")[0], f[b"user"]) for nid, f in got] == [("4", b"late")]
        await worker_ops.ack_notifications(Functions(ar), "chat", "w1", [got[0][0]])
        assert (await ar.xpending(keys.ready("chat", 4), keys.GROUP))["pending"] == 0
    asyncio.run(go())



def test_ack_covered_needs_the_holders_notification_on_the_same_shard() -> None:
    """After a change of ready_shards the holder's pending notification may sit on the old
    shard and ours on the new one: then ours stay pending (reclaimed once idle), never acked on
    a check that is not atomic with the ack."""
    async def go() -> None:
        ar = fakeredis.FakeAsyncRedis()
        await worker_ops.join_ready_group(ar, "chat", 3)
        await ar.xadd(keys.ready("chat", 0), {"user": "u"})
        await ar.xadd(keys.ready("chat", 2), {"user": "u"})
        await ar.xreadgroup(keys.GROUP, "holder", {keys.ready("chat", 0): ">"})
        ours = [nid for nid, _f in await worker_ops.read_ready(ar, "chat", "me", 10, 0, 3)]
        assert ours[0].startswith("2/")
        assert await worker_ops.ack_covered(Functions(ar), "chat", "me", "holder", "u", ours) == -1
        assert (await ar.xpending(keys.ready("chat", 2), keys.GROUP))["pending"] == 1
        await ar.xadd(keys.ready("chat", 2), {"user": "u"})
        await ar.xreadgroup(keys.GROUP, "holder", {keys.ready("chat", 2): ">"})
        assert await worker_ops.ack_covered(Functions(ar), "chat", "me", "holder", "u", ours) == 1
    asyncio.run(go())


def test_on_one_node_a_tier_without_higher_shards_costs_one_exists(r: fakeredis.FakeRedis,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A commander counts 50 tiers' shards every pass: one EXISTS over a tier's 63 possible
    higher shards, and shard by shard only for a tier that has some."""
    import redis

    sent: list[int] = []
    execute = redis.client.Pipeline.execute

    def counting(self: redis.client.Pipeline, *args: object, **kwargs: object) -> object:
        sent.append(len(self.command_stack))
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counting)
    r.xadd(keys.ready("chat", 5), {"user": "a"})
    tiers = [f"t{i}" for i in range(50)]
    assert existing_shards(r, [*tiers, "chat"]) == {**{t: [0] for t in tiers}, "chat": [0, 5]}
    assert sent == [51, keys.MAX_READY_SHARDS - 1]
    sent.clear()
    assert existing_shards(r, tiers) == {t: [0] for t in tiers}
    assert sent == [50]
