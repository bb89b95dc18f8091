"""A relay's health (``fleet relay --check``): the freshness judgement, as a table."""

from __future__ import annotations

import pytest

from worker.rq.relay_health import gone, host_prefix, judge

NOW = 1_700_000_000.0
PRE = "relay-box1-"
BEATS = {"relay-box1-10": NOW - 45, "relay-box1-11": NOW - 2, "relay-box2-7": NOW - 1,
         "relay-a": NOW - 100, "relay-skew": NOW + 3}


@pytest.mark.parametrize(("relay_id", "max_age", "ok", "says"), [
    ("relay-box1-11", 30, True, "relay relay-box1-11: heartbeat 2.0s ago"),
    ("relay-box1-10", 30, False, "relay relay-box1-10: last heartbeat 45s ago, over --max-age 30s"),
    ("relay-box1-10", 60, True, "heartbeat 45.0s ago"),
    ("relay-a", 30, False, "100s ago"),
    ("relay-none", 30, False, "no heartbeat of relay relay-none"),
    ("relay-skew", 30, True, "heartbeat 0.0s ago"),  # a clock ahead by a little: fresh, not negative
    (None, 30, True, "relay relay-box1-11: heartbeat 2.0s ago"),  # this host's freshest, not box2's
])
def test_freshness(relay_id: str | None, max_age: float, ok: bool, says: str) -> None:
    got, line = judge(BEATS, NOW, max_age, relay_id, PRE)
    assert got is ok and says in line and "\n" not in line


def test_this_hosts_relays_stale_or_missing() -> None:
    assert judge({"relay-box1-10": NOW - 45}, NOW, 30, None, PRE) == (
        False, "relay relay-box1-10: last heartbeat 45s ago, over --max-age 30s: stopped, stuck, or "
               "unable to reach Redis")
    ok, line = judge({"relay-box2-7": NOW}, NOW, 30, None, PRE)
    assert not ok and line.startswith("no heartbeat of a relay of this host (relay-box1-*)")
    assert not judge({}, NOW, 30, None, PRE)[0]


def test_host_prefix_keeps_an_id_a_consumer_name_can_be() -> None:
    assert host_prefix("web-1.example.com") == "relay-web-1examplecom-"
    assert host_prefix("").startswith("relay-")


def test_relays_silent_for_a_day_are_forgotten() -> None:
    assert gone(BEATS, NOW, after_s=60) == ["relay-a"]
    assert gone(BEATS, NOW) == []
