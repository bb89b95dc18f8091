"""stores.memory: the time-independent rank key orders memories exactly as their decayed weight."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from protocol.codec import decode, encode
from protocol.models import MemoryItem
from stores.memory import DEFAULT_HALF_LIFE_S, new_member, parse_members, rank_key, weight

DAY = 86_400.0
NOW0 = 1_700_000_000.0

importances = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False, allow_infinity=False,
                        exclude_min=False)
ages = st.floats(min_value=0.0, max_value=30 * DAY, allow_nan=False, allow_infinity=False)
half_lives = st.sampled_from([60.0, 3_600.0, DAY, 7 * DAY])


def _item(i: int, importance: float, ts: float) -> MemoryItem:
    return MemoryItem(id=f"m{i}", text=f"t{i}", importance=importance, ts=ts)


def _clearly_ordered(a: float, b: float, key_scale: float) -> bool:
    """Two weights far enough apart that float rounding cannot swap them: their logs differ
    by more than a few units in the last place of the rank keys (``key_scale``: the largest
    key's magnitude; a key near 2e7, ts=1.7e9 over a 60 s half-life, resolves weight ratios
    only to ~4e-9, so two memories 0.1 us apart can share a key)."""
    if min(a, b) <= 0.0:  # a weight that underflowed: ordered unless both did
        return a != b
    return abs(math.log(a) - math.log(b)) > max(1e-9, 8 * math.ulp(key_scale))


@settings(database=None, deadline=None, max_examples=300)
@given(
    memories=st.lists(st.tuples(importances, ages), min_size=2, max_size=25),
    later=st.lists(st.floats(min_value=0.0, max_value=60 * DAY), min_size=1, max_size=4),
    half_life=half_lives,
)
def test_rank_key_order_is_weight_order_at_any_now(memories: list[tuple[float, float]], later: list[float],
                                                   half_life: float) -> None:
    items = [_item(i, imp, NOW0 - age) for i, (imp, age) in enumerate(memories)]
    keys_ = [rank_key(it.importance, it.ts, half_life) for it in items]
    key_scale = max(abs(k) for k in keys_)
    for now in [NOW0, *(NOW0 + d for d in later)]:
        weights = [weight(it, now, half_life) for it in items]
        for i in range(len(items)):
            for j in range(len(items)):
                if _clearly_ordered(weights[i], weights[j], key_scale):
                    assert (weights[i] > weights[j]) == (keys_[i] > keys_[j]), (i, j, now)


@settings(database=None, deadline=None, max_examples=200)
@given(memories=st.lists(st.tuples(importances, ages), min_size=1, max_size=25, unique=True),
       k=st.integers(min_value=1, max_value=10))
def test_top_k_by_rank_key_is_top_k_by_weight(memories: list[tuple[float, float]], k: int) -> None:
    items = [_item(i, imp, NOW0 - age) for i, (imp, age) in enumerate(memories)]
    by_key = sorted(items, key=lambda it: rank_key(it.importance, it.ts), reverse=True)[:k]
    by_weight = sorted(items, key=lambda it: weight(it, NOW0 + DAY), reverse=True)[:k]
    w_key = [weight(it, NOW0 + DAY) for it in by_key]
    w_weight = [weight(it, NOW0 + DAY) for it in by_weight]
    assert w_key == pytest.approx(w_weight, rel=1e-9)


@settings(database=None, deadline=None)
@given(importance=importances, age=ages, half_life=half_lives)
def test_rank_key_is_the_log_of_the_weight_plus_a_constant(importance: float, age: float,
                                                            half_life: float) -> None:
    now = NOW0
    item = _item(0, importance, now - age)
    w = weight(item, now, half_life)
    assume(w > 1e-300)
    expected = math.log(w) + now * math.log(2) / half_life
    assert rank_key(importance, now - age, half_life) == pytest.approx(expected, rel=1e-9, abs=1e-6)


@pytest.mark.parametrize(
    ("importance", "ts", "now", "expected"),
    [
        (1.0, 0.0, 0.0, 1.0),
        (0.5, 0.0, 0.0, 0.5),
        (1.0, 0.0, DEFAULT_HALF_LIFE_S, 0.5),
        (0.8, 0.0, 2 * DEFAULT_HALF_LIFE_S, 0.2),
    ],
)
def test_weight_halves_every_half_life(importance: float, ts: float, now: float, expected: float) -> None:
    assert weight(_item(0, importance, ts), now) == pytest.approx(expected)


def test_an_older_but_more_important_memory_can_win() -> None:
    # one half-life of age costs half the weight: 1.0 a day old beats 0.4 now, loses to 0.6
    old = rank_key(1.0, NOW0 - DAY)
    assert old > rank_key(0.4, NOW0)
    assert old < rank_key(0.6, NOW0)


@pytest.mark.parametrize("importance", [1.0, 0.5, 1e-12], ids=["one", "half", "tiny"])
def test_importance_in_bounds(importance: float) -> None:
    assert math.isfinite(rank_key(importance, NOW0))


@pytest.mark.parametrize("importance", [0.0, -0.1, 1.0000001, 2.0, float("nan"), float("inf")],
                         ids=["zero", "negative", "just-over-one", "two", "nan", "inf"])
def test_importance_out_of_bounds(importance: float) -> None:
    with pytest.raises(ValueError, match="importance"):
        rank_key(importance, NOW0)
    with pytest.raises(ValueError):
        new_member("x", importance, NOW0)


def test_new_member_decodes_and_scores() -> None:
    member, score = new_member("likes tea", 0.7, NOW0)
    item = decode(MemoryItem, member)
    assert (item.text, item.importance, item.ts) == ("likes tea", 0.7, NOW0)
    assert score == rank_key(0.7, NOW0)


def test_new_members_get_distinct_ids() -> None:
    ids = {decode(MemoryItem, new_member("same", 0.5, NOW0)[0]).id for _ in range(50)}
    assert len(ids) == 50


GOOD = encode(MemoryItem(id="a", text="good", importance=0.5, ts=1.0))
GOOD2 = encode(MemoryItem(id="b", text="also good", importance=1.0, ts=2.0))


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1garbage", id="not-msgpack"),
        pytest.param(msgpack.packb([1, 2]), id="not-a-map"),
        pytest.param(msgpack.packb({"id": "a", "text": "t", "importance": 0.5, "ts": 1.0}), id="no-version"),
        pytest.param(msgpack.packb({"v": 2, "id": "a", "text": "t", "importance": 0.5, "ts": 1.0}),
                     id="wrong-version"),
        pytest.param(msgpack.packb({"v": 1, "id": "a", "text": "t", "importance": 0.0, "ts": 1.0}),
                     id="importance-0"),
        pytest.param(msgpack.packb({"v": 1, "id": "a", "text": "t"}), id="missing-fields"),
        pytest.param(msgpack.packb({"v": 1, "id": "a", "text": "t", "importance": 0.5, "ts": 1.0, "x": 1}),
                     id="extra-field"),
        pytest.param(msgpack.packb({"v": 1, b"id": "a", "text": "t", "importance": 0.5, "ts": 1.0},
                                   use_bin_type=True), id="bytes-key"),
    ],
)
def test_parse_members_skips_corrupt_members(corrupt: bytes) -> None:
    assert [m.text for m in parse_members([GOOD, corrupt, GOOD2])] == ["good", "also good"]


def test_parse_members_keeps_order_and_handles_empty() -> None:
    assert parse_members([]) == []
    assert [m.id for m in parse_members([GOOD2, GOOD])] == ["b", "a"]
