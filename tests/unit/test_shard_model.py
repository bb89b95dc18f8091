"""scripts/shard_model.py: a turn's Redis cost per key, fitted and placed on M masters."""

from __future__ import annotations

import sys

import pytest
from redis.crc import key_slot

from tests.conftest import ROOT

if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import shard_model as sm  # noqa: E402  (after the path)

from protocol import keys  # noqa: E402


@pytest.mark.parametrize(("args", "key"), [
    (["XADD", "fleet:u:{alice}:inbox", "*", "t", "hi"], "fleet:u:{alice}:inbox"),
    (["FCALL", "fleet_acquire_v3", "2", "fleet:u:{bob}:lane", "fleet:u:{bob}:inbox", "w1"],
     "fleet:u:{bob}:lane"),
    (["FCALL_RO", "fleet_version", "0"], None),
    (["XREADGROUP", "GROUP", "g", "c", "COUNT", "64", "BLOCK", "200", "STREAMS", "fleet:{chat}:ready", ">"],
     "fleet:{chat}:ready"),
    (["XINFO", "GROUPS", "fleet:{chat}:ready"], "fleet:{chat}:ready"),
    (["CLUSTER", "SLOTS"], None),
    (["ping"], None),
    (["GET", "fleet:{chat}:starting"], "fleet:{chat}:starting"),
])
def test_first_key(args: list[str], key: str | None) -> None:
    assert sm.first_key(args) == key


@pytest.mark.parametrize(("key", "pattern"), [
    ("fleet:u:{alice}:inbox", "fleet:u:{*}:inbox"),
    ("fleet:u:{r0-u0001}:reply:0195-abc", "fleet:u:{*}:reply"),
    ("fleet:{chat}:ready", "fleet:{chat}:ready"),
    ("fleet:w:{chat-w1}:hb", "fleet:w:{chat-w1}:hb"),
    (None, ""),
])
def test_key_pattern(key: str | None, pattern: str) -> None:
    assert sm.key_pattern(key) == pattern


def test_the_model_restates_the_ready_keys_of_protocol() -> None:
    for shard in (0, 1, 2, 63):
        assert sm.ready_key("chat", shard) == keys.ready("chat", shard)
    assert sm.MAX_READY_SHARDS == keys.MAX_READY_SHARDS


MONITOR = """OK
1796586270.000001 [0 127.0.0.1:5000] "fcall" "fleet_acquire" "1" "fleet:u:{a}:lane" "w"
1796586270.000002 [0 lua] "get" "fleet:u:{a}:lane"
1796586270.000003 [0 lua] "set" "fleet:u:{a}:lane" "w"
1796586270.000004 [0 127.0.0.1:5001] "xadd" "fleet:{chat}:ready" "*" "user" "a \\"quoted\\""
1796586270.000005 [0 127.0.0.1:5000] "fcall" "fleet_acquire" "1" "fleet:u:{b}:lane" "w"
1796586270.000006 [0 lua] "get" "fleet:u:{b}:lane"
1796586270.000007 [0 127.0.0.1:5002] "ping"
"""


def test_attribute_counts_calls_by_key_and_gives_a_script_its_inner_calls() -> None:
    a = sm.attribute(MONITOR.splitlines(), turns=2)
    assert a.top == {("fcall", "fleet:u:{*}:lane"): 2, ("xadd", "fleet:{chat}:ready"): 1, ("ping", ""): 1}
    assert a.inner == {("fcall", "fleet:u:{*}:lane"): {"get": 2, "set": 1}}


def test_parse_monitor_line_unescapes_quotes_and_skips_what_is_no_command() -> None:
    assert sm.parse_monitor_line("OK") is None
    assert sm.parse_monitor_line('1.5 [0 lua] "get" "k"') == (False, ["get", "k"])
    assert sm.parse_monitor_line('1.5 [0 127.0.0.1:1] "echo" "a \\"b\\""') == (True, ["echo", 'a "b"'])


def test_fit_prices_a_script_by_its_inner_calls_and_deals_out_the_rest_per_call() -> None:
    a = sm.attribute(MONITOR.splitlines(), turns=2)
    # per turn: fcall 1 call, 30 µs (its 1.5 inner calls inside); get 1 call 4 µs, set 0.5 call 3 µs,
    # xadd 0.5 call 5 µs; ping 0.5 call 1 µs; cluster|slots never shown by MONITOR: 2 µs
    stats = {"fcall": (1.0, 30.0), "get": (1.0, 4.0), "set": (0.5, 3.0), "xadd": (0.5, 5.0),
             "ping": (0.5, 1.0), "cluster|slots": (0.1, 2.0)}
    costs = {c.pattern: c for c in sm.fit(a, stats, cpu_us_per_turn=58.0)}
    assert costs["fleet:u:{*}:lane"].commands_us == pytest.approx(30.0)  # inner 4 + 3, own 23
    assert costs["fleet:{chat}:ready"].commands_us == pytest.approx(5.0)
    assert costs[""].commands_us == pytest.approx(1.0 + 2.0)
    # 58 - 38 = 20 µs outside commands, over 4 top-level calls: 2 of them the lane's
    assert costs["fleet:u:{*}:lane"].other_us == pytest.approx(10.0)
    assert costs["fleet:{chat}:ready"].other_us == pytest.approx(5.0)
    assert sum(c.us for c in costs.values()) == pytest.approx(58.0)


@pytest.mark.parametrize("masters", [1, 2, 3, 7, 100])
def test_slot_ranges_cover_every_slot_once(masters: int) -> None:
    ranges = sm.slot_ranges(masters)
    assert len(ranges) == masters and ranges[0][0] == 0 and ranges[-1][1] == sm.SLOTS - 1
    assert all(b[0] == a[1] + 1 for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = {hi - lo + 1 for lo, hi in ranges}
    assert max(sizes) - min(sizes) <= 1


def _costs() -> list[sm.KeyCost]:
    return [sm.KeyCost("fleet:u:{*}:lane", 60.0, 30.0), sm.KeyCost("fleet:{chat}:ready", 20.0, 10.0),
            sm.KeyCost("fleet:{chat}:active", 6.0, 3.0), sm.KeyCost("", 1.0, 0.0)]


def test_predict_on_one_master_is_the_whole_cost() -> None:
    assert sm.predict(_costs(), sm.slot_ranges(1), shards=1) == [pytest.approx(130.0)]


def test_predict_spreads_users_and_shards_and_keeps_a_single_key_on_its_master() -> None:
    ranges = sm.slot_ranges(3)
    per_master = sm.predict(_costs(), ranges, shards=3)
    assert sum(per_master) == pytest.approx(90.0 + 30.0 + 9.0 + 3 * 1.0)  # keyless paid by each
    active = sm.master_of("fleet:{chat}:active", ranges)
    shard_masters = [sm.master_of(keys.ready("chat", k), ranges) for k in range(3)]
    assert sorted(shard_masters) == [0, 1, 2]  # the keys' doc: chat's 3 shards on 3 thirds
    for m in range(3):
        assert per_master[m] == pytest.approx(30.0 + 10.0 + 1.0 + (9.0 if m == active else 0.0))


def test_predict_takes_measured_shares() -> None:
    ranges = sm.slot_ranges(2)
    only_lane = [sm.KeyCost("fleet:u:{*}:lane", 100.0, 0.0)]
    assert sm.predict(only_lane, ranges, shards=1, user_share=[0.25, 0.75]) == [25.0, 75.0]
    with pytest.raises(ValueError, match="one share per master"):
        sm.predict(only_lane, ranges, shards=1, user_share=[1.0])


def test_master_of_follows_the_key_slot() -> None:
    ranges = sm.slot_ranges(4)
    slot = key_slot(b"fleet:{chat}:active")
    lo, hi = ranges[sm.master_of("fleet:{chat}:active", ranges)]
    assert lo <= slot <= hi


def test_ceiling_leaves_the_idle_cost_out() -> None:
    assert sm.ceiling([50.0, 100.0]) == pytest.approx(10_000.0)
    assert sm.ceiling([50.0, 100.0], idle_us_per_s=10_000.0) == pytest.approx(9_900.0)


def test_project_hits_the_tier_keys_that_do_not_spread() -> None:
    """Per-user work falls as 1/M; the tier's active set (one key) does not: past some size
    it is the hottest master's largest cost and the ceiling stops rising."""
    small, big = sm.project(_costs(), 3), sm.project(_costs(), 100)
    assert small.ready_shards == 3 and big.ready_shards == sm.MAX_READY_SHARDS
    assert big.ceiling_turns_per_s > small.ceiling_turns_per_s
    assert big.hottest_pattern == "fleet:{chat}:active"
    assert big.ceiling_turns_per_s < 1e6 / 9.0  # never past the one key's own cost
