"""The commander's loop on fakeredis with a recording runtime: what a pass does when its
leadership ends in the middle of it."""

from __future__ import annotations

import threading
import time

import fakeredis

from commander.commander import Commander
from commander.settings import CommanderSettings
from protocol import keys
from tests.unit.commander_helpers import RecordingRuntime, leading, ledger


def test_a_commander_deposed_in_the_middle_of_a_pass_acts_on_nothing_more() -> None:
    """Another commander takes the lease after this one renewed it at the start of its pass:
    the pass's first ledger append is fenced, and the pass ends there instead of raising out
    of the loop (which would end the commander)."""
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    r.set(keys.policy("chat"), b"{not json")  # the pass ledgers the rejected key: an append
    runtime = RecordingRuntime()
    commander = leading(r, runtime, always_tiers=("chat",))
    runtime.on_reap = lambda: r.set(keys.LEADER, "c2|99", px=30_000)  # reaped right after the renewal

    commander.pass_once(time.time())  # does not raise

    assert not commander.leading
    assert ledger(r, "policy-rejected") == [] and runtime.handles == {}  # fenced: nothing done


def test_a_leadership_lost_as_soon_as_won_leaves_a_standby_whose_loop_goes_on() -> None:
    """The lease goes to another commander between the campaign and its ``leader`` entry: the
    entry is fenced and the commander stays a standby until it is stopped."""
    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    runtime = RecordingRuntime()
    runtime.on_adopt = lambda: r.set(keys.LEADER, "c2|99", px=30_000)  # a new leader adopts first
    commander = Commander(r, runtime, CommanderSettings(commander_id="c1", metrics_port=None,
                                                        standby_poll_s=0.05, always_tiers=()))
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()

    assert commander.run(stop) == 0  # returns on stop, not with an exception

    assert ledger(r, "leader") == [] and not commander.leading


def test_a_pass_whose_tier_signals_cannot_be_read_still_judges_unobserved(monkeypatch) -> None:
    """The backlog and users cannot be read (Redis failing mid-pass): ``decide`` still runs on
    signals marked unobserved (it holds, and counts toward the fallback) and the pass ends."""
    import redis

    from commander import observe

    def failing(*_args: object, **_kwargs: object) -> None:
        raise redis.ConnectionError("Redis went away")

    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    commander = leading(r, RecordingRuntime(), always_tiers=("chat",))
    monkeypatch.setattr(observe, "read_tier_load", failing)

    commander.pass_once(time.time())  # does not raise

    seen = commander.board.seen
    assert seen is not None and seen.tiers["chat"].snapshot.observed is False
