"""The commander's scenarios (observe, evaluate, decide, act) on real processes and Redis.

A wait is for a condition, with a deadline, and "nothing happened" is asserted after the
commander ran a number of passes (``passes``); the one fixed sleep is the length of a fault
(Redis paused). The decision scenarios also run pass by pass on a virtual clock, with simulated
workers, in test_commander_passes.py; those that need no real process live only there (the
stabilization window measured exactly, stale reports of frozen workers).
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.codec import decode
from protocol.models import SessionEntry
from protocol.policy import TurnsPolicy, turns_policy
from stores.policies import write_policy
from tests.helpers import fleet_cli, leads, ledger, live_workers, passes, wait_until

pytestmark = pytest.mark.integration

FAST = dict(handler="sleep", handler_options={"sleep_ms": 300}, concurrency=2, min_workers=1,
            max_workers=4, target_backlog_per_worker=2, users_per_instance=None,
            report_interval_s=0.3, scale_down_stabilization_s=3, drain_timeout_s=15)


def policy(**over: object) -> TurnsPolicy:
    return turns_policy(**{**FAST, **over})


def served(load: Load, n: int, timeout: float = 60) -> None:
    """Wait until ``load`` got ``n`` more replies."""
    target = len(load.replies) + n
    wait_until(lambda: len(load.replies) >= target, timeout, f"{n} more replies")


class Load:
    """Users sending turns in a loop from a thread; every reply is kept for checks.

    By default the users go in lockstep (a batch waits for all its replies, so a worker
    whose turn ended early is idle until the slowest is done); ``lockstep=False`` gives each
    user its own loop, so each keeps its worker busy.
    """

    def __init__(self, url: str, users: int, pause_s: float = 0.0, prefix: str = "u",
                 lockstep: bool = True) -> None:
        self.fleet = Fleet(url)
        self.users = [f"{prefix}{i:03d}" for i in range(users)]
        self.pause_s = pause_s
        self.sent: dict[str, list[str]] = {u: [] for u in self.users}
        self.replies: list = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True)] if lockstep else [
            threading.Thread(target=self._run_user, args=(u,), daemon=True) for u in self.users]

    def _run_user(self, user: str) -> None:
        while not self.stop.is_set():
            text = f"{user} turn {len(self.sent[user])}"
            self.sent[user].append(text)
            self.replies.append(self.fleet.submit(user, text).result(timeout=90))
            self.stop.wait(self.pause_s)

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            batch = [(u, f"{u} turn {len(self.sent[u])}") for u in self.users]
            for u, text in batch:
                self.sent[u].append(text)
            handles = self.fleet.submit_many(batch)
            self.replies += self.fleet.results(handles, timeout=90)
            n += 1
            self.stop.wait(self.pause_s)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def check(self, r: redis.Redis) -> None:
        """Every turn answered ok exactly once, every session in submission order."""
        assert all(rep.ok for rep in self.replies)
        assert len(self.replies) == sum(len(v) for v in self.sent.values())
        for u in self.users:
            got = [decode(SessionEntry, raw).text for raw in r.lrange(keys.session(u), 0, -1)]
            assert got == self.sent[u], u


def test_burst_scales_up_then_quiet_scales_in_idle_first(r, redis_server, start_commander):
    # (the 3 s stabilization window is measured on the virtual clock: 1 s here is enough to
    # see the order of the scale-in)
    write_policy(r, "chat", policy(scale_down_stabilization_s=1))
    start_commander()
    first = wait_until(lambda: live_workers(r, "chat"), 20, "the first worker")[0].worker
    fleet = Fleet(redis_server.role_url("fleet-client"))

    replies = fleet.results(fleet.submit_many([(f"b{i:02d}", "burst") for i in range(40)]), timeout=90)

    assert all(rep.ok for rep in replies)
    ups = [e for e in ledger(r, "chat", "scale-up") if e.from_count >= 1]
    assert ups and max(e.to_count for e in ups) > 1, ledger(r, "chat")
    served_by = Counter(rep.worker for rep in replies)
    assert len(served_by) >= 2 and set(served_by) - {first}, served_by  # new workers served turns

    # load stops: back to min_workers only after the stabilization window, idle workers first
    wait_until(lambda: len(live_workers(r, "chat")) == 1, 40, "scale-in to min_workers")
    downs = ledger(r, "chat", "reclaim-idle", "consolidate")
    assert downs and all(e.to_count >= 1 for e in downs)
    assert all(e.action == "reclaim-idle" for e in downs)
    # (not before the stabilization window: on the virtual clock, test_commander_passes.py)
    passes(r, 8)
    assert len(live_workers(r, "chat")) == 1  # and it stays at the floor


def test_raising_users_per_instance_consolidates_without_losing_turns(r, redis_server, start_commander):
    light = dict(target_backlog_per_worker=None, concurrency=16, handler_options={"sleep_ms": 50},
                 min_workers=1, active_window_s=30, scale_down_stabilization_s=1)
    write_policy(r, "chat", policy(users_per_instance=4, **light))
    start_commander()
    with Load(redis_server.role_url("fleet-client"), users=12, pause_s=0.5) as load:
        wait_until(lambda: len(live_workers(r, "chat")) == 3, 30, "3 workers for 12 users at 4 per worker")
        write_policy(r, "chat", policy(users_per_instance=100, **light))
        wait_until(lambda: len(live_workers(r, "chat")) == 1, 40, "consolidation to one worker")
        served(load, 24)  # two more rounds of the twelve users, on the one worker
    load.check(r)
    downs = ledger(r, "chat", "reclaim-idle", "consolidate")
    assert downs
    exits = ledger(r, "chat", "worker-exited")
    assert not exits  # the drained workers exited on their own, none crashed or was killed


def test_scale_to_zero_serves_a_parked_turn(r, redis_server, start_commander):
    # a 1 s stabilization window: the window itself is measured on the virtual clock
    # (test_commander_passes.py); here only that the tier goes back to zero
    write_policy(r, "chat", policy(min_workers=0, handler_options={"sleep_ms": 10},
                                   scale_down_stabilization_s=1))
    start_commander()
    passes(r, 5)
    assert live_workers(r, "chat") == []
    reply = Fleet(redis_server.role_url("fleet-client")).submit("zoe", "anyone there?").result(30)
    assert reply.ok and reply.text == "slept: anyone there?"
    wake = [e for e in ledger(r, "chat", "scale-up") if e.from_count == 0]
    assert wake and wake[0].to_count == 1
    wait_until(lambda: live_workers(r, "chat") == [], 30, "the tier to go back to zero")


# a shorter lease (3 s by default) and standby poll (1 s): the standby takes over sooner
FAST_TAKEOVER_ENV = {"FLEET_COMMANDER_LEASE_TTL_MS": "1500", "FLEET_COMMANDER_STANDBY_POLL_S": "0.2"}


def test_commander_sigkill_standby_takes_over_and_adopts(r, redis_server, start_commander):
    write_policy(r, "chat", policy(min_workers=2, handler_options={"sleep_ms": 50}))
    leader = start_commander("c1", env=FAST_TAKEOVER_ENV).proc
    wait_until(lambda: len(live_workers(r, "chat")) == 2, 20, "two workers")
    standby = start_commander("c2", env=FAST_TAKEOVER_ENV, lead=False).proc
    with Load(redis_server.role_url("fleet-client"), users=10, pause_s=0.05) as load:
        served(load, 20)
        before = {w.worker for w in live_workers(r, "chat")}
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        wait_until(lambda: leads(r, "c2"), 15, "the standby to lead")
        passes(r, 10, "c2")
        served(load, 20)  # turns still answered under the new leader
    load.check(r)
    after = {w.worker for w in live_workers(r, "chat")}
    assert before <= after  # adopted: the old leader's workers all run on
    # not respawned (no double spawn): the new leader counted them before it spawned any; a
    # worker it added is a scale-up for load on a slow machine, with the two in its count
    grown = [e for e in ledger(r, "chat", "scale-up") if e.commander == "c2"]
    assert all(e.from_count >= len(before) for e in grown), [(e.from_count, e.reason) for e in grown]
    assert after - before <= {w for e in grown for w in e.spawned}, (after, before, grown)
    epochs = {e.epoch for e in ledger(r) if e.commander == "c2"}
    assert epochs and min(epochs) > max(e.epoch for e in ledger(r) if e.commander == "c1")
    assert standby.poll() is None


def test_invalid_raw_policy_is_rejected_and_the_last_good_kept(r, redis_server, start_commander, fleet_env,
                                                              tmp_path):
    write_policy(r, "chat", policy(min_workers=2))
    start_commander()
    wait_until(lambda: len(live_workers(r, "chat")) == 2, 20, "two workers")
    r.set(keys.policy("chat"), '{"min_workers": 5, "max_workers": 2}')
    wait_until(lambda: ledger(r, "chat", "policy-rejected"), 10, "the rejection")
    rejected = ledger(r, "chat", "policy-rejected")[0]
    assert "min_workers (5) > max_workers (2)" in rejected.reason
    out = fleet_cli(fleet_env, "policy", "get", "chat", cwd=tmp_path, timeout=30)
    assert "REJECTED" in out.stdout and "min_workers (5) > max_workers (2)" in out.stdout
    passes(r, 5)
    assert len(live_workers(r, "chat")) == 2  # the fleet runs on the last good policy, unchanged
    r.set(keys.policy("chat"), policy(min_workers=3).to_json())
    wait_until(lambda: len(live_workers(r, "chat")) == 3, 20, "the next valid edit to apply")


def test_two_commanders_at_once_only_one_ever_acts(r, redis_server, start_commander):
    write_policy(r, "chat", policy(min_workers=2))
    a = start_commander("ca", lead=False).proc
    b = start_commander("cb", lead=False).proc
    wait_until(lambda: len(live_workers(r, "chat")) == 2, 20, "two workers")
    fleet = Fleet(redis_server.role_url("fleet-client"))
    assert all(rep.ok for rep in fleet.results(fleet.submit_many([(f"t{i}", "x") for i in range(30)]), 60))
    passes(r, 5)
    acts = [e for e in ledger(r) if e.action not in ("leader",)]
    assert acts and len({(e.commander, e.epoch) for e in acts}) == 1
    assert len([e for e in ledger(r) if e.action == "leader"]) == 1
    assert a.poll() is None and b.poll() is None


def test_redis_pause_causes_no_mass_scale_in_nor_spawn_storm(r, redis_server, start_commander):
    # four users keep four one-slot workers busy with 2 s turns (each in its own loop: in
    # lockstep, workers done early would be truly idle, and the backlog no longer counts the
    # turns in progress); no stabilization window, so only the freshness rules stand between
    # a paused Redis and a mass scale-in
    write_policy(r, "chat", policy(min_workers=1, max_workers=4, concurrency=1, target_backlog_per_worker=1,
                                   handler_options={"sleep_ms": 2000}, scale_down_stabilization_s=0))
    start_commander()
    with Load(redis_server.role_url("fleet-client"), users=4, pause_s=0.0, lockstep=False) as load:
        wait_until(lambda: len(live_workers(r, "chat")) == 4, 30, "the load to scale the tier up")
        passes(r, 5)
        events = ledger(r, "chat")
        before = len(events)
        # with no hold, a worker fresh from a scale-up may be consolidated before the pause (its
        # window's occupancy is low): the tier then stands below the 4 users' demand, and a
        # scale-up back to it after the pause is recovery, not a storm
        at_pause = events[-1].to_count
        redis_server.proc.send_signal(signal.SIGSTOP)
        # the fault itself, not a wait for anything: Redis answers nobody for longer than the
        # leader lease, so the commander is deposed and re-elected
        time.sleep(3.5)
        redis_server.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: r.get(keys.LEADER), 15, "a leader again")
        passes(r, 8)
        during = ledger(r, "chat")[before:]
    load.check(r)
    # a pause must not retire a worker that served through it: its reports stopped with Redis,
    # and read stale they would call it idle. A worker the recovery started may go again (with no
    # hold, one that came up when the backlog was already taken is idle, and is reclaimed at once,
    # as the policy asks: on a busy machine, where the users' loops lag, that happens)
    started = {w for e in during for w in e.spawned}
    assert all(v in started for e in during if e.action in ("reclaim-idle", "consolidate")
               for v in e.victims), during
    ups = sum(e.to_count - e.from_count for e in during if e.action == "scale-up")
    assert ups <= 1 + (4 - at_pause), during


def test_a_worker_started_separately_is_counted_not_doubled(r, redis_server, start_commander, start_worker):
    write_policy(r, "chat", policy(min_workers=1))
    outside = start_worker(worker_id="chat-outside")  # `fleet worker`, not started by the commander
    start_commander()
    passes(r, 10)
    assert [w.worker for w in live_workers(r, "chat")] == ["chat-outside"]
    assert not ledger(r, "chat", "scale-up")
    reply = Fleet(redis_server.role_url("fleet-client")).submit("olga", "hi", meta={"sleep_ms": 1}).result(10)
    assert reply.ok and reply.worker == "chat-outside"
    assert outside.proc.poll() is None


def test_a_handler_no_worker_has_is_rejected_and_the_tier_keeps_its_policy(r, redis_server, start_commander):
    """A policy key naming a handler installed where the CLI runs but not where the workers do is
    rejected: the workers keep the last good policy, not the default one (echo, concurrency 8)."""
    write_policy(r, "chat", policy(min_workers=1, handler="sleep", concurrency=3,
                                   handler_options={"ms": 1}))
    start_commander()
    wait_until(lambda: len(live_workers(r, "chat")) == 1, 20, "a worker")
    fleet = Fleet(redis_server.role_url("fleet-client"))
    assert fleet.submit("alice", "hi").result(30).text.startswith("slept")
    write_policy(r, "chat", policy(min_workers=1, handler="answer", concurrency=16))
    wait_until(lambda: ledger(r, "chat", "policy-rejected"), 15, "the rejection")
    reason = ledger(r, "chat", "policy-rejected")[0].reason
    assert "no live worker of tier chat has handler 'answer'" in reason, reason
    wait_until(lambda: b"answer" in (r.hget(keys.policy_status("chat"), "error") or b""), 15,
               "the worker's own verdict")
    reply = fleet.submit("alice", "still there?").result(30)
    assert reply.ok and reply.text.startswith("slept"), reply  # the last good policy, not echo
