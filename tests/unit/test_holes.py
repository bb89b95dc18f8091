"""Each hole the explorer found, forced through the public entry points.

An explorer seed (``HOLES`` in tests/unit/test_explore.py) replays one exact schedule: once
the code's awaits move, it no longer reaches its bug and stays green. Each test here runs the
real workers and clients on the simulator with a *controlled schedule* (``sim.scenario``):
faults injected at observable events (a script the server ran on a user's keys, a handler's
entry, a connection attempt), so the state that exposed the hole is reached whatever the
code's await structure. Then the explorer's checks judge the run: I1-I3, liveness, the stop
bound of a SIGTERM and the zombie bound of a lost lane. Every test also checks that its
schedule happened (``Scenario.unfired``), so it cannot pass by missing its moment. Each runs
in asyncio's own order and in two drawn orders of the ready callbacks (``ORDERS``), as a
stand-in for the await structures a refactor may give the code.

Each test names the seed that found its hole; each was seen failing with its fix reverted.
"""

from __future__ import annotations

import pytest

from protocol import keys
from protocol.codec import as_str
from sim.scenario import Event, Scenario, command, connect, found_lane_busy, handler, script, took_lane
from sim.world import GHOST, Planned, World

ORDERS = [("fifo", 0), ("random", 1), ("random", 2)]  # (strategy, seed): the order of each step


@pytest.fixture(params=ORDERS, ids=[f"{s}{n}" for s, n in ORDERS])
def order(request: pytest.FixtureRequest) -> tuple[str, int]:
    return request.param  # type: ignore[no-any-return]


def plan(order: tuple[str, int], turns: list[Planned], workers: int = 1, concurrency: int = 1) -> Scenario:
    """A controlled schedule of ``turns`` run in ``order``."""
    strategy, seed = order
    return Scenario(turns, workers=workers, concurrency=concurrency, strategy=strategy, seed=seed)


def holds(scenario: Scenario) -> None:
    """Run the controlled schedule: it happened, and every invariant held."""
    outcome = scenario.run()
    assert scenario.unfired() == [], "the schedule did not happen"
    assert outcome.ok, [str(v) for v in outcome.violations]


def kill_later(world: World, worker: str) -> None:
    """SIGKILL ``worker`` 0.3 s from now: time for what the event's sender does next to land."""
    world.call_later(0.3, world.inject, "kill", worker)


def pending(world: World) -> dict[str, str]:
    """The tier's pending notifications: id -> the consumer they are pending under."""
    rows = world.net.sync_client().xpending_range(keys.ready("chat"), keys.GROUP, "-", "+", 100)
    return {as_str(row["message_id"]): as_str(row["consumer"]) for row in rows}


# --- what a worker meets in the inbox ------------------------------------------------------------
def test_a_turn_for_a_tier_no_policy_defines_does_not_wedge_its_user(order: tuple[str, int]) -> None:
    """Seed 6: a raw turn for a tier nobody serves, then one for the user's tier. The worker
    handed the lane to the unserved tier and the user waited for ever on every tier."""
    holds(plan(order, [Planned("u0", tier=GHOST), Planned("u0", at_s=0.1)]))


def test_a_rejected_turn_whose_submit_reply_was_lost_is_answered_once(order: tuple[str, int]) -> None:
    """Seed 11: the submit of a turn that is rejected (its tier runs nowhere) lands, its reply is
    lost, and the client submits it again with the same turn id: the inbox holds it twice, and
    each copy got an error reply."""
    scenario = plan(order, [Planned("u0", tier=GHOST), Planned("u0", at_s=0.1)])
    scenario.on(command("EXEC", node="c0"), lambda world, e: world.inject("drop", "c0"),
               label="the ghost turn's submit is applied: its reply is lost")
    writes = scenario.on(command("XADD", kind="queued", node="c0", word=b"u0-t0"), lambda world, e: None,
                         times=None)  # the client's (a dead letter names the turn too)
    holds(scenario)
    assert writes.fired == 2, "the turn was not written twice"


# --- lanes lost under their holder ---------------------------------------------------------------
def test_a_lane_lost_mid_turn_stops_its_handler_at_the_next_renewal(order: tuple[str, int]) -> None:
    """Seed 1053: the lease expired under its holder mid-turn; the renewal that found it gone
    only logged, and the handler ran on beside whoever took the user."""
    scenario = plan(order, [Planned("u0", sleep_ms=5000)], workers=2)
    scenario.on(script("lease_renew", user="u0"), lambda world, e: world.inject("expire", "u0"),
               label="u0's lane is renewed, then ends")
    holds(scenario)


def test_a_lease_not_renewable_in_an_outage_counts_as_lost_at_its_ttl(order: tuple[str, int]) -> None:
    """Seed 20217: the lane expired as Redis went away; no renewal could say it was lost, so
    the handler ran on past the lane's TTL until Redis was back."""
    scenario = plan(order, [Planned("u0", sleep_ms=8000)])

    def lost_in_an_outage(world: World, e: Event) -> None:
        world.inject("expire", "u0")
        world.inject("outage", "redis", 5.0)
    scenario.on(script("lease_renew", user="u0"), lost_in_an_outage,
               label="u0's lane is renewed, then ends as Redis goes away for 5 s")
    holds(scenario)


def test_a_renewal_pass_stuck_on_redis_does_not_hold_up_the_next(order: tuple[str, int]) -> None:
    """Seed 28924: a renewal pass waiting on Redis (there, in the client's reconnect retries
    after an outage) held up the renewal of a lane taken meanwhile, and with it the news that
    the lane was lost: its handler ran on past the bound. Here the pass's reply is stalled."""
    scenario = plan(order, [Planned("u1", sleep_ms=6000), Planned("u0", at_s=1.0, sleep_ms=3000)],
                      concurrency=2)
    scenario.on(script("lease_renew", user="u1"), lambda world, e: world.inject("stall", str(e.node), 5.0),
               label="a renewal pass's reply is held up 5 s")
    scenario.on(handler("enter", user="u0"), lambda world, e: world.inject("expire", "u0"),
               label="u0's lane, taken meanwhile, ends as its turn starts")
    holds(scenario)


# --- the ack rule: a notification is acked only when its duty is carried ------------------------
def _holder_paused_and_taken_over(scenario: Scenario) -> list[str]:
    """u0's lane holder X is paused (at its first renewal) until worker Y has reclaimed u0's
    notification and taken the lane over; then Y is paused holding it, and X resumed. Returns
    [X, Y] as they become known."""
    xy: list[str] = []

    def pause_x(world: World, e: Event) -> None:
        xy.append(str(e.node))
        world.inject("pause", xy[0], 10.0)

    def y_took_over(world: World, e: Event) -> None:
        xy.append(str(e.node))
        world.inject("pause", xy[1], 10.0)
        world.call_later(0.2, world.resume, xy[0])

    scenario.on(script("lease_renew", user="u0"), pause_x, label="X renews u0's lane: pause X")
    scenario.on(script("lane_acquire", user="u0"), y_took_over,
               when=lambda world, e: len(xy) == 1 and e.node != xy[0] and took_lane("u0")(world, e),
               label="Y takes u0's lane over: pause Y, resume X")
    return xy


def test_a_busy_acquire_never_acks_a_notification_another_worker_reclaimed(order: tuple[str, int]) -> None:
    """Seed 9260: X, paused past its lease, had u0's notification reclaimed by Y, which took
    the lane. X resumed, found the lane busy and acked the notification (XACK acks whoever holds
    it); Y's job then ended without serving u0, and nothing pending brought u0 back."""
    scenario = plan(order, [Planned("u0", sleep_ms=1000)], workers=2)
    xy = _holder_paused_and_taken_over(scenario)
    scenario.on(script("lane_acquire", user="u0"), lambda world, e: kill_later(world, xy[1]),
               when=lambda world, e: len(xy) == 2 and e.node == xy[0] and found_lane_busy("u0")(world, e),
               label="X finds u0's lane busy: Y dies 0.3 s later")
    holds(scenario)


def test_a_renewal_never_takes_back_a_notification_another_worker_reclaimed(order: tuple[str, int]) -> None:
    """Seed 20221: X, back from its pause, renewed (and failed to renew) u0's lane and touched
    u0's notification with XCLAIM, taking it back from Y, which had reclaimed it with the lane:
    Y's duty for u0 was X's again. The busy-ack rule (seed 1013) now keeps such a stolen
    notification from being acked, so the invariants hold either way: this test checks the
    rule itself, that no command of X moves a notification pending under live Y to X (before
    it is idle long enough to be reclaimed)."""
    scenario = plan(order, [Planned("u0", sleep_ms=1000)], workers=2)
    xy = _holder_paused_and_taken_over(scenario)
    ys: dict[str, float] = {}  # Y's pending notifications -> when Y took the lane
    stolen: dict[str, str] = {}  # ... that X took -> by which command

    def y_owns(world: World, e: Event) -> None:
        ys.update({nid: world.loop.time() for nid, owner in pending(world).items() if owner == xy[1]})

    def x_steals(world: World, e: Event) -> None:
        for nid, owner in pending(world).items():
            if owner == xy[0] and nid in ys:
                stolen.setdefault(nid, e.command)

    scenario.on(script("lane_acquire", user="u0"), y_owns,
               when=lambda world, e: len(xy) == 2 and e.node == xy[1], label="Y took over: its notifications")
    scenario.on(lambda e: e.kind == "applied", x_steals,
               when=lambda world, e: len(xy) == 2 and e.node == xy[0]
               and any(world.loop.time() < t + 1.5 for t in ys.values()),  # (under reclaim_idle_ms)
               times=None)
    holds(scenario)
    assert ys, "Y had no notification pending"
    assert stolen == {}


def test_a_busy_acquire_keeps_its_notification_when_the_holder_carries_none(order: tuple[str, int]) -> None:
    """Seed 1013: the commander took live X for dead (its heartbeat had expired in an outage):
    it posted a fresh notification for u0, acked X's, and cleared X's lane. X took the lane
    again, now with nothing pending; Y met the fresh notification on the busy lane and acked it,
    trusting the holder to carry u0. X then died, and nothing pending brought u0 back."""
    scenario = plan(order, [Planned("u0", sleep_ms=3000)], workers=2)
    xy: list[str] = []

    def taken_for_dead(world: World, e: Event) -> None:
        xy.extend([str(e.node), next(w for w in world.live_workers() if w != e.node)])
        world.inject("pause", xy[1], 10.0)  # (so that X takes the lane again first)
        world.take_over(xy[0])

    scenario.on(handler("enter", user="u0"), taken_for_dead,
               label="X is in u0's handler: Y paused, the commander takes X over")
    scenario.on(script("lane_acquire", user="u0"), lambda world, e: world.resume(xy[1]),
               when=lambda world, e: len(xy) == 2 and e.node == xy[0] and took_lane("u0")(world, e),
               label="X takes u0's lane again: resume Y")
    scenario.on(script("lane_acquire", user="u0"), lambda world, e: kill_later(world, xy[0]),
               when=lambda world, e: len(xy) == 2 and e.node == xy[1] and found_lane_busy("u0")(world, e),
               label="Y finds u0's lane busy: X dies 0.3 s later")
    holds(scenario)


# --- SIGTERM while starting ----------------------------------------------------------------------
def _starting_in_an_outage(order: tuple[str, int], lose_cancel: bool) -> Scenario:
    scenario = plan(order, [Planned("u0")])
    scenario.on(connect("w0"), lambda world, e: world.inject("outage", "redis", 30.0),
               label="Redis is away as w0 starts")

    def sigterm(world: World, e: Event) -> None:
        if lose_cancel:
            world.inject("lose-cancel", "w0")
        world.inject("term", "w0")
    scenario.on(connect("w0"), sigterm, when=lambda world, e: world.loop.time() > 0.5,
               label="SIGTERM while w0 retries its start")
    return scenario


def test_sigterm_stops_a_worker_retrying_its_start_in_an_outage(order: tuple[str, int]) -> None:
    """Seed 9153: a worker started during an outage retried its start through its SIGTERM
    until Redis was back."""
    holds(_starting_in_an_outage(order, lose_cancel=False))


def test_sigterm_stops_a_start_whose_redis_call_lost_the_cancellation(order: tuple[str, int]) -> None:
    """Seed 32878: the drain's cancellation of the start landed in redis-py's call and was
    dropped (CPython gh-86296); the call went on with its own retries for seconds, and the
    drain waited for it."""
    scenario = _starting_in_an_outage(order, lose_cancel=True)
    holds(scenario)
    assert scenario.world is not None and scenario.world.net.cancels_lost == 1, \
        "the start's cancellation did not land in a Redis call"
