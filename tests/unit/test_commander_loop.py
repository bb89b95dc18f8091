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


def test_a_pass_saves_its_tiers_decide_states_and_starting_slots_at_its_end_and_a_deposed_one_none(
        monkeypatch) -> None:
    """Each judged tier's decide state (for the next leader) and starting slots (for the request
    edge) are written at the end of the pass, all in one round trip each; a leader deposed in
    the middle of a pass writes none of them, not even the tiers judged before it was."""
    from protocol.policy import TurnsPolicy
    from stores.policies import write_policy

    r = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    write_policy(r, "alpha", TurnsPolicy(min_workers=1))
    write_policy(r, "beta", TurnsPolicy(min_workers=1))
    runtime = RecordingRuntime()
    commander = leading(r, runtime, always_tiers=())
    commander.pass_once(time.time())
    assert all(r.exists(keys.decide_state(t)) and r.exists(keys.starting(t)) for t in ("alpha", "beta"))

    r.delete(*(k(t) for k in (keys.decide_state, keys.starting) for t in ("alpha", "beta")))
    write_policy(r, "alpha", TurnsPolicy(min_workers=2))
    write_policy(r, "beta", TurnsPolicy(min_workers=2))
    real = commander.actor.apply

    def deposed_at_beta(plan, policy):  # alpha is judged first; beta's spawn is fenced
        if plan.tier == "beta":
            r.set(keys.LEADER, "c2|99", px=30_000)
        real(plan, policy)

    monkeypatch.setattr(commander.actor, "apply", deposed_at_beta)
    commander.pass_once(time.time())
    assert not commander.leading
    assert not any(r.exists(k(t)) for k in (keys.decide_state, keys.starting) for t in ("alpha", "beta"))
