"""Leader lease and the fenced ledger (I4), on fakeredis' Lua."""

from __future__ import annotations

import time

import fakeredis
import pytest

from commander.leadership import Deposed, Leadership
from protocol import keys
from protocol.codec import decode
from protocol.models import LedgerEvent


@pytest.fixture
def r():
    return fakeredis.FakeRedis()


def event(epoch: int, who: str) -> LedgerEvent:
    return LedgerEvent(ts=time.time(), tier="chat", epoch=epoch, commander=who, action="scale-up")


def test_one_leader_at_a_time_with_growing_epochs(r):
    a, b = Leadership(r, "a", ttl_ms=1000), Leadership(r, "b", ttl_ms=1000)
    assert a.campaign() and not b.campaign()
    assert a.epoch == 1 and b.epoch is None
    assert a.campaign() and a.epoch == 1  # campaigning again while leading keeps the epoch
    a.step_down()
    assert b.campaign() and b.epoch == 2


def test_a_deposed_leader_cannot_append_and_so_never_acts(r):
    a, b = Leadership(r, "a", ttl_ms=1000), Leadership(r, "b", ttl_ms=1000)
    assert a.campaign()
    a.append(event(1, "a"))
    r.delete(keys.LEADER)  # a's lease expired while it was paused
    assert b.campaign()
    with pytest.raises(Deposed):
        a.append(event(1, "a"))
    assert not a.leading
    b.append(event(2, "b"))
    got = [decode(LedgerEvent, f[b"m"]) for _, f in r.xrange(keys.EVENTS)]
    assert [(e.commander, e.epoch) for e in got] == [("a", 1), ("b", 2)]


def test_renew_fails_after_takeover(r):
    a, b = Leadership(r, "a", ttl_ms=1000), Leadership(r, "b", ttl_ms=1000)
    assert a.campaign() and a.renew()
    r.delete(keys.LEADER)
    assert b.campaign()
    assert not a.renew() and not a.leading
