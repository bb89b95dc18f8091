"""protocol.keys: hash tags keep every per-user (and per-tier) operation in one Cluster slot."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import keys
from protocol.ids import USER_ID_MAX, InvalidId


def crc16_xmodem(data: bytes) -> int:
    """CRC16-CCITT (XMODEM), the checksum Redis Cluster uses for key slots."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def key_slot(key: str) -> int:
    """Redis Cluster's HASH_SLOT: CRC16 of the first non-empty ``{...}`` tag, else of the key."""
    raw = key.encode()
    start = raw.find(b"{")
    if start != -1:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return crc16_xmodem(raw) % 16384


PER_USER: dict[str, Callable[[str], str]] = {
    "inbox": keys.inbox,
    "lane": keys.lane,
    "fence": keys.fence,
    "state": keys.state,
    "session": keys.session,
    "profile": keys.profile,
    "memory": keys.memory,
    "done": keys.done,
    "usage": keys.usage,
    "reply": lambda u: keys.reply(u, "turn-1"),
    "stream": lambda u: keys.stream(u, "turn-1"),
}
PER_TIER_TAGGED: dict[str, Callable[[str], str]] = {
    "ready": keys.ready,
    "active": keys.active,
    "dead": keys.dead,
    "pressure": keys.pressure,
}
PER_TIER_POLICY: dict[str, Callable[[str], str]] = {
    "policy": keys.policy,
    "policy_good": keys.policy_good,
    "policy_status": keys.policy_status,
}
PER_WORKER: dict[str, Callable[[str], str]] = {"heartbeat": keys.heartbeat, "control": keys.control}

user_ids = st.text(alphabet="abcXYZ019_.@+-", min_size=1, max_size=USER_ID_MAX)
tiers = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,31}", fullmatch=True)


def test_crc16_matches_the_reference_vectors() -> None:
    # the check value of CRC-16/XMODEM, and slots quoted in the Redis Cluster spec
    assert crc16_xmodem(b"123456789") == 0x31C3
    assert key_slot("123456789") == 0x31C3 % 16384
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
    assert key_slot("foo{}{bar}") == crc16_xmodem(b"foo{}{bar}") % 16384


def test_own_keyslot_agrees_with_redis_py() -> None:
    from redis.crc import key_slot as redis_key_slot

    for key in ("fleet:u:{alice}:inbox", "fleet:{chat}:ready", "fleet:policy:chat", "plain"):
        assert key_slot(key) == redis_key_slot(key.encode())


@pytest.mark.parametrize("name", sorted(PER_USER))
def test_per_user_key_carries_the_user_hash_tag(name: str) -> None:
    key = PER_USER[name]("alice")
    assert key.startswith(f"{keys.PREFIX}:u:{{alice}}:")
    assert key.count("{") == 1 and key.count("}") == 1


@settings(database=None, deadline=None, max_examples=200)
@given(user=user_ids)
def test_all_per_user_keys_of_one_user_share_a_slot(user: str) -> None:
    slots = {key_slot(build(user)) for build in PER_USER.values()}
    assert slots == {key_slot(user)}


def test_per_user_keys_are_distinct() -> None:
    built = [build("alice") for build in PER_USER.values()]
    assert len(set(built)) == len(built)


def test_stream_key_names_the_turn_in_the_users_slot() -> None:
    assert keys.stream("alice", "t-1") == "fleet:u:{alice}:stream:t-1"
    assert keys.user_keys("alice").stream("t-1") == keys.stream("alice", "t-1")
    assert key_slot(keys.stream("alice", "t-1")) == key_slot(keys.inbox("alice"))


def test_reply_key_names_the_turn() -> None:
    assert keys.reply("alice", "t-1") == "fleet:u:{alice}:reply:t-1"
    assert keys.reply("alice", "t-1") != keys.reply("alice", "t-2")


@settings(database=None, deadline=None, max_examples=200)
@given(tier=tiers)
def test_tagged_tier_keys_share_the_tier_slot(tier: str) -> None:
    slots = {key_slot(build(tier)) for build in PER_TIER_TAGGED.values()}
    assert slots == {key_slot(tier)}
    for build in PER_TIER_TAGGED.values():
        assert f"{{{tier}}}" in build(tier)


@pytest.mark.parametrize("tier", ["chat", "gpu"])
def test_policy_keys_share_the_tier_slot(tier: str) -> None:
    slots = {key_slot(build(tier)) for build in PER_TIER_POLICY.values()}
    assert slots == {key_slot(keys.ready(tier))}


def test_policy_keys_are_distinct_per_tier() -> None:
    built = [build(t) for t in ("chat", "gpu") for build in PER_TIER_POLICY.values()]
    assert len(set(built)) == len(built)


def test_user_and_tier_namespaces_do_not_collide() -> None:
    # a user named like a tier must not reach tier keys, nor the reverse
    user_keys = {build("chat") for build in PER_USER.values()}
    tier_keys = {build("chat") for build in (PER_TIER_TAGGED | PER_TIER_POLICY).values()}
    assert not user_keys & tier_keys


BAD_IDS = [
    pytest.param("a{b", id="open-brace"),
    pytest.param("a}b", id="close-brace"),
    pytest.param("{}", id="empty-tag"),
    pytest.param("a:b", id="colon"),
    pytest.param("a b", id="space"),
    pytest.param("a\nb", id="newline"),
    pytest.param("alice\n", id="trailing-newline"),
    pytest.param("", id="empty"),
    pytest.param("x" * 65, id="over-long"),
    pytest.param(None, id="none"),
    pytest.param(7, id="int"),
    pytest.param(["a"], id="list"),
]


@pytest.mark.parametrize("bad", BAD_IDS)
@pytest.mark.parametrize("name", sorted(PER_USER))
def test_per_user_builders_reject_bad_user_ids(name: str, bad: object) -> None:
    with pytest.raises(InvalidId):
        PER_USER[name](bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_reply_rejects_bad_turn_ids(bad: object) -> None:
    with pytest.raises(InvalidId):
        keys.reply("alice", bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [*BAD_IDS, pytest.param("Chat", id="uppercase"),
                                 pytest.param("x" * 33, id="33-chars")])
@pytest.mark.parametrize("name", sorted(PER_TIER_TAGGED | PER_TIER_POLICY))
def test_tier_builders_reject_bad_tiers(name: str, bad: object) -> None:
    with pytest.raises(InvalidId):
        (PER_TIER_TAGGED | PER_TIER_POLICY)[name](bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", BAD_IDS)
@pytest.mark.parametrize("name", sorted(PER_WORKER))
def test_worker_builders_reject_bad_worker_ids(name: str, bad: object) -> None:
    with pytest.raises(InvalidId):
        PER_WORKER[name](bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("worker", ["w-1", "chat-host-4-1a2b"])
def test_per_worker_keys_carry_the_worker_hash_tag(worker: str) -> None:
    assert {key_slot(build(worker)) for build in PER_WORKER.values()} == {key_slot(worker)}
    assert keys.heartbeat(worker) == f"fleet:w:{{{worker}}}:hb"
    assert keys.control(worker) == f"fleet:w:{{{worker}}}:control"


def test_global_keys_share_the_prefix() -> None:
    for key in (keys.REPORTS, keys.EVENTS, keys.WORKERS, keys.TIERS):
        assert key.startswith(f"{keys.PREFIX}:")
