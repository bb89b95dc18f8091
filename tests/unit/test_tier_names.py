"""The commander's tier names: ``fleet:tiers`` every pass, the keyspace ``SCAN`` for policy keys
set raw only now and then (it costs a round trip per 500 keys of the whole database)."""

from __future__ import annotations

from typing import Any

import fakeredis

from commander import tier_policies
from commander.tier_policies import SCAN_EVERY_S, TierNames
from protocol import keys
from protocol.policy import TurnsPolicy
from stores.policies import write_policy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_raw_policy_keys_are_found_by_a_scan_now_and_then_registered_tiers_every_pass(monkeypatch) -> None:
    r = fakeredis.FakeRedis()
    scans: list[float] = []
    clock = Clock()
    real = tier_policies.policy_key_tiers

    def counted(client: Any) -> set[str]:
        scans.append(clock.now)
        return real(client)

    monkeypatch.setattr(tier_policies, "policy_key_tiers", counted)
    write_policy(r, "chat", TurnsPolicy())
    r.set(keys.policy("raw"), TurnsPolicy().to_json())  # a raw SET: not in fleet:tiers
    names = TierNames(r, clock)
    assert names() == {"chat", "raw"} and scans == [100.0]  # the first pass scans

    write_policy(r, "added", TurnsPolicy())
    r.set(keys.policy("late"), TurnsPolicy().to_json())
    clock.now += 1
    assert names() == {"chat", "raw", "added"}  # fleet:tiers at once, no scan
    assert scans == [100.0]
    clock.now = 100.0 + SCAN_EVERY_S
    assert names() == {"chat", "raw", "added", "late"} and scans == [100.0, 100.0 + SCAN_EVERY_S]


def test_a_bad_member_of_fleet_tiers_is_told_and_left_out() -> None:
    from stores.bad_state import BadState

    r = fakeredis.FakeRedis()
    r.sadd(keys.TIERS, "chat", "no such tier!")
    bad = BadState()
    assert TierNames(r, Clock(), bad)() == {"chat"}
    assert [(e.kind, e.key) for e in bad.entries] == [("tier", keys.TIERS)]
