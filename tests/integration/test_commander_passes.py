"""The commander's scenarios pass by pass on a virtual clock (tests/integration/commander_rig.py).

Each "nothing happened" is asserted after the clock moved and passes ran, not after a sleep;
the real-process scenarios are in test_commander.py.
"""

from __future__ import annotations

import pytest

from protocol import keys
from stores.policies import write_policy
from tests.integration.commander_rig import Rig
from tests.integration.test_commander import policy

pytestmark = pytest.mark.integration


@pytest.fixture
def rig(r) -> Rig:
    return Rig(r, concurrency=2)


def test_quiet_scales_in_idle_first_after_the_stabilization_window_and_stays(r, rig):
    write_policy(r, "chat", policy())
    assert rig.campaign()
    rig.step()
    assert len(rig.live()) == 1  # min_workers
    rig.park(40)
    rig.step()
    ups = rig.actions("scale-up")
    assert ups and max(e.to_count for e in ups) > 1
    for w in rig.runtime.workers.values():
        w.busy = 2
    rig.run_for(2.0)
    rig.serve_all(rig.live()[0])
    for w in rig.runtime.workers.values():
        w.busy = 0
    quiet = rig.clock.time()
    last_up = max(e.ts for e in rig.actions("scale-up"))
    while len(rig.live()) > 1 and rig.clock.time() - last_up < 30:
        rig.step()
    assert len(rig.live()) == 1
    downs = rig.actions("reclaim-idle", "consolidate")
    assert downs and all(e.to_count >= 1 for e in downs)
    assert all(e.action == "reclaim-idle" for e in downs)
    # not before scale_down_stabilization_s (3 s) of quiet, on the virtual clock: no slack needed
    assert min(e.ts for e in downs) - quiet >= 3 and min(e.ts for e in downs) - last_up >= 3
    before = len(rig.ledger())
    rig.run_for(10.0)
    assert len(rig.live()) == 1  # and it stays at the floor
    assert [e.action for e in rig.ledger()[before:]] == []


def test_scale_to_zero_stays_at_zero_until_a_turn_is_parked(r, rig):
    write_policy(r, "chat", policy(min_workers=0, handler_options={"sleep_ms": 10}))
    assert rig.campaign()
    rig.run_for(5.0)
    assert rig.live() == [] and rig.runtime.spawned == []
    assert not rig.actions("scale-up")
    rig.park(1)
    rig.step()
    wake = [e for e in rig.actions("scale-up") if e.from_count == 0]
    assert wake and wake[0].to_count == 1 and len(rig.live()) == 1
    rig.serve_all(rig.live()[0])
    quiet = rig.clock.time()
    while rig.live() and rig.clock.time() - quiet < 30:
        rig.step()
    assert rig.live() == []  # back to zero
    assert rig.clock.time() - quiet >= 3  # after the stabilization window


def test_invalid_raw_policy_is_rejected_and_the_last_good_kept(r, rig):
    write_policy(r, "chat", policy(min_workers=2))
    assert rig.campaign()
    rig.step()
    assert len(rig.live()) == 2
    r.set(keys.policy("chat"), '{"min_workers": 5, "max_workers": 2}')
    rig.step()
    rejected = rig.actions("policy-rejected")
    assert rejected and "min_workers (5) > max_workers (2)" in rejected[0].reason
    before = len(rig.ledger())
    rig.run_for(5.0)
    assert len(rig.live()) == 2  # the fleet runs on the last good policy, unchanged
    assert rig.commander.policies.in_force("chat") == policy(min_workers=2)
    assert [e.action for e in rig.ledger()[before:]] == []  # and the rejection is recorded once
    r.set(keys.policy("chat"), policy(min_workers=3).to_json())
    rig.step()
    assert len(rig.live()) == 3  # the next valid edit applies at the next pass
    assert [e.action for e in rig.ledger()[before:]] == ["policy-applied", "scale-up"]


def test_a_worker_started_separately_is_counted_not_doubled(r, rig):
    write_policy(r, "chat", policy(min_workers=1))
    rig.runtime.add("chat-outside", outside=True)  # `fleet worker`, not started by the commander
    assert rig.campaign()
    rig.run_for(10.0)  # fifty passes, past ADOPT_EVERY_S
    assert rig.live() == ["chat-outside"] and rig.runtime.spawned == []
    assert not rig.actions("scale-up")


def test_missing_reports_are_not_idleness(r, rig):
    write_policy(r, "chat", policy(min_workers=3, scale_down_stabilization_s=0))
    assert rig.campaign()
    rig.run_for(1.0)  # every worker has reported idle
    assert len(rig.live()) == 3
    frozen = rig.live()[1:]
    for wid in frozen:
        rig.runtime.workers[wid].frozen = True  # their reports stop: unknown, not idle
    rig.run_for(3.0)  # longer than stale_after (2 s here): their last reports are stale
    write_policy(r, "chat", policy(min_workers=1, scale_down_stabilization_s=0))
    rig.run_for(5.0)
    gone = {v for e in rig.actions("reclaim-idle", "consolidate") for v in e.victims}
    assert not gone & set(frozen), rig.ledger()
    assert set(frozen) <= set(rig.live())
    for wid in frozen:
        rig.runtime.workers[wid].frozen = False
    rig.run_for(1.0)  # with fresh reports again they are idle, and go
    assert len(rig.live()) == 1


def test_a_stall_causes_no_mass_scale_in_nor_spawn_storm(r):
    """Redis paused 3.5 s (longer than the lease): no pass and no report got through. The first
    reports after it show workers starved of turns by the pause: not idleness."""
    rig = Rig(r, concurrency=1)
    write_policy(r, "chat", policy(min_workers=1, max_workers=4, concurrency=1, target_backlog_per_worker=1,
                                   handler_options={"sleep_ms": 2000}, scale_down_stabilization_s=0))
    assert rig.campaign()
    rig.step()
    rig.park(4)
    rig.step()
    assert len(rig.live()) == 4
    rig.serve_all(rig.live()[0])
    for w in rig.runtime.workers.values():
        w.busy = 1  # four users keep the four one-slot workers busy, no backlog
    rig.run_for(1.0)
    before = len(rig.ledger())
    rig.clock.advance(3.5)  # the pause: no pass, no report
    for w in rig.runtime.workers.values():
        w.busy = 0  # their turns ended in the pause and no new one could reach them
    rig.step()
    for w in rig.runtime.workers.values():
        w.busy = 1  # the users' next turns arrive
    rig.run_for(1.5)
    during = rig.ledger()[before:]
    assert not [e for e in during if e.action in ("reclaim-idle", "consolidate")], during
    assert sum(e.to_count - e.from_count for e in during if e.action == "scale-up") <= 1, during
    assert len(rig.live()) == 4


def test_two_commanders_at_once_only_one_ever_acts(r, rig):
    write_policy(r, "chat", policy(min_workers=2))
    other = Rig(r, concurrency=2, name="cb", clock=rig.clock, group=False)
    won = [rig.campaign(), other.campaign()]
    assert won.count(True) == 1
    for _ in range(25):  # five seconds of passes by both, interleaved
        rig.step()
        other.commander.pass_once(rig.clock.time())
    leader, standby = (rig, other) if won[0] else (other, rig)
    assert len(leader.live()) == 2 and standby.runtime.spawned == []
    acts = [e for e in rig.ledger(tier=None) if e.action != "leader"]
    assert acts and len({(e.commander, e.epoch) for e in acts}) == 1
    assert len([e for e in rig.ledger(tier=None) if e.action == "leader"]) == 1
