"""The data-plane simulator itself: deterministic, replayable, and able to fail.

A simulator that cannot find a planted bug (planted in the Lua the simulated server runs, so
the worker's code is the real one, whatever its shape) proves nothing, and one whose seed does not fix
the run cannot hand over a bug report; both are tested here. The explorer's runs over many
seeds are in tests/unit/test_explore.py.
"""

from __future__ import annotations

import ast
import asyncio
import contextvars
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sim.clock import MODULES
from sim.explore import Schedule, run
from sim.loop import NODE, Fifo, SimLoop
from sim.store import PLANTED
from sim.world import Workload

ROOT = Path(__file__).resolve().parents[2]
SMALL = Workload(workers=2, users=3, turns=3, concurrency=2, ghosts=True)


def test_a_seed_fixes_the_run() -> None:
    a, b = run(Schedule(seed=5, workload=SMALL)), run(Schedule(seed=5, workload=SMALL))
    assert (a.steps, a.commands, a.waits, a.schedule.faults, a.schedule.choices) == \
           (b.steps, b.commands, b.waits, b.schedule.faults, b.schedule.choices)
    assert a.steps > 1000 and a.commands > 100  # a real run, not an empty one


def test_a_run_replays_exactly_from_its_schedule() -> None:
    first = run(Schedule(seed=8, workload=SMALL, max_faults=3, fault_rate=1 / 500))
    assert first.schedule.faults, "the schedule should have drawn faults"
    again = run(Schedule.from_json(first.schedule.to_json()))
    assert (again.steps, again.commands, again.waits) == (first.steps, first.commands, first.waits)


def test_a_replay_is_the_same_in_another_process_with_another_hash_seed() -> None:
    first = run(Schedule(seed=3, workload=SMALL))
    code = ("import sys; from sim.explore import run, Schedule; "
            "o = run(Schedule.from_json(sys.stdin.read())); print(o.steps, o.commands)")
    out = subprocess.run([sys.executable, "-c", code], input=first.schedule.to_json(), text=True,
                         capture_output=True, cwd=ROOT, env={"PYTHONHASHSEED": "12345", "PATH": ""},
                         check=True, timeout=120)
    assert out.stdout.split() == [str(first.steps), str(first.commands)]


def test_virtual_time_costs_no_wall_time_and_killed_nodes_never_run_again() -> None:
    loop = SimLoop(Fifo())
    ran: list[str] = []

    async def node_task(name: str) -> None:
        for _ in range(3):
            await asyncio.sleep(3600)  # an hour per iteration, virtually
            ran.append(name)

    async def main() -> None:
        tasks = []
        for name in ("a", "b"):
            ctx = contextvars.copy_context()
            ctx.run(NODE.set, name)
            tasks.append(loop.create_task(node_task(name), context=ctx))
        await asyncio.sleep(3600 * 1.5)
        loop.kill("a")
        loop.pause("b")
        await asyncio.sleep(3600 * 2)
        loop.resume("b")
        await tasks[1]
        loop.revive_all()
        tasks[0].cancel()

    loop.run_until_complete(main())
    loop.close()
    assert ran == ["a", "b", "b", "b"]  # a: once before its kill; b: all three, after its pause
    assert loop.time() >= 3600 * 3.5


def test_every_data_plane_module_that_reads_the_clock_gets_virtual_time() -> None:
    """A module that imports ``time`` but is not patched would read the wall clock: stream
    ids, lease expiry and waits would no longer follow the seed."""
    missing = []
    for folder in ("worker", "stores", "protocol"):
        for path in sorted((ROOT / folder).glob("*.py")):
            missing += _reads_time(path, f"{folder}.{path.stem}")
    missing += _reads_time(ROOT / "fleet" / "client.py", "fleet.client")
    assert missing == []


def _reads_time(path: Path, module: str) -> list[str]:
    tree = ast.parse(path.read_text())
    imports_time = any(isinstance(n, ast.Import) and any(a.name == "time" for a in n.names)
                       for n in ast.walk(tree))
    return [module] if imports_time and module not in MODULES and module not in NOT_SIMULATED else []


# modules of those folders that a simulation never runs, and need not import there
NOT_SIMULATED = {"worker.openai_chat": "a handler for model servers (the openai extra): the explorer "
                                        "runs its own"}


# --- the checks can fail: planted bugs are found --------------------------------------------------
def _kinds(seeds: range, **workload: int) -> set[str]:
    """The kinds of violation the first failing schedule among ``seeds`` shows."""
    for seed in seeds:
        got = run(Schedule(seed=seed, workload=replace(SMALL, ghosts=False, **workload), max_faults=0))
        if got.violations:
            return {v.kind for v in got.violations}
    return set()


def plant(monkeypatch: pytest.MonkeyPatch, script: str, *changes: tuple[str, str]) -> None:
    """Plant a bug in Lua script ``script`` as the simulated server runs it (``sim.store.PLANTED``):
    each ``(old, new)`` text replaced, every ``old`` found (the bug is where it is meant to be)."""

    def planted(text: str) -> str:
        for old, new in changes:
            assert old in text, f"{script}.lua no longer holds {old!r}"
            text = text.replace(old, new)
        return text

    monkeypatch.setitem(PLANTED, script, planted)


# the commit's reply, skipped for every user's second turn: its cursor moves on, and no reply
LOSES_THE_SECOND_REPLY = ("if ARGV[6] ~= '' then",
                          "if ARGV[6] ~= '' and not string.find(ARGV[3], '-t1', 1, true) then")


def test_a_lost_turn_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    plant(monkeypatch, "turn_commit", LOSES_THE_SECOND_REPLY)
    assert "I1" in _kinds(range(1, 4))


def test_two_workers_in_one_users_handler_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the lease (every acquire wins) and every guard of the commit: two workers then
    serve one user at once, and both commit."""
    plant(monkeypatch, "lane_acquire", ("local held, fence = try('GET', KEYS[1]),",
                                        "redis.call('DEL', KEYS[1])\nlocal held, fence = false,"))
    plant(monkeypatch, "turn_commit",  # no owner check, no cursor check, no dedupe
          *((check, "false") for check in ("redis.call('GET', KEYS[1]) ~= ARGV[1]",
                                           "#first == 0 or first[1][1] ~= ARGV[2]")),
          ("if answered then", "if false then"))
    found = set().union(*(_kinds(range(seed, seed + 1), users=1, turns=6) for seed in range(1, 5)))
    assert "I3" in found  # (some schedules show only the stalls the broken lease causes)


def test_a_stuck_user_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # the commit says released even when a turn waits, and keeps the lane: that turn waits for nothing
    plant(monkeypatch, "turn_commit", ("return {result, 0, nxt}", "return {result, 1, {}}"))
    monkeypatch.setattr("sim.explore.STARVE_BOUND_S", 1.0)
    assert _kinds(range(1, 6), turns=4) & {"liveness", "I1"}


def test_schedules_draw_varied_workloads() -> None:
    drawn = {Workload.draw(random.Random(s)) for s in range(50)}
    assert len(drawn) > 40


async def test_a_connection_broken_by_an_outage_reconnects_once_redis_is_back() -> None:
    """As a real client's does: redis-py's retry drops a broken connection and sends again on it,
    which connects it afresh. The simulated one still carried its old generation after the drop
    and failed each retry before connecting: a command drew the broken connection, spent its
    retries on it and failed with Redis up, and the user whose job kept drawing it starved
    (seed 68743)."""
    from sim.store import Network

    net = Network(asyncio.get_running_loop(), random.Random(1))
    r = net.client(retries=2)
    await r.set("k", "1")  # a pooled connection, from before the restart
    net.restart(0.0)  # it is broken; the server is back at once
    assert await r.get("k") == b"1"  # the retry reconnects
    await r.aclose()


def test_the_wind_down_leaves_no_task_pending_even_one_started_during_it() -> None:
    """Found by a 3,000-schedule run (seeds 4242-7241): three schedules left a worker's tasks
    pending at the loop's close ("Task was destroyed but it is pending!" at exit: its start,
    retrying). A respawn timer (RESPAWN_S after a kill or a SIGTERM) fired while the wind-down
    waited for a task slow to end, and the worker it started was not among those cancelled."""
    from sim.explore import _wind_down
    from sim.store import Network
    from sim.world import World

    loop = SimLoop(Fifo())
    world = World(loop, Network(loop, random.Random(1)), SMALL, random.Random(1))

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(100)
        except asyncio.CancelledError:
            await asyncio.sleep(1.0)  # (as a call whose cancellation was dropped ends later)
            raise

    slow = loop.create_task(slow_to_stop())
    loop.run_until_complete(asyncio.sleep(0))  # it waits in its sleep
    late: list[asyncio.Task[None]] = []
    loop.call_later(0.5, lambda: late.append(loop.create_task(asyncio.sleep(100))))  # a respawn
    try:
        _wind_down(loop, world.net, world)
        assert slow.done() and late, "the respawn never came"
        assert all(t.done() for t in late), "a task started during the wind-down was left pending"
    finally:
        for task in late:
            task.cancel()
        if late and not late[0].done():
            loop.run_until_complete(asyncio.wait(late))
        loop.close()


def test_a_sigterm_is_judged_by_the_workers_state_when_its_drain_runs() -> None:
    """Seed 484 (the checker's own hole): SIGTERM reached a worker stopped (SIGSTOP) while it
    was starting; after SIGCONT its loop finished the start before it ran the drain, and it
    drained as a serving worker does, but the check held it to the bound of a worker that
    never started. The stop bound is the one of the state the worker is in when its drain runs."""
    from sim.checks import STARTING_STOP_S, check
    from sim.explore import STOP_BOUND_S
    from sim.store import Network
    from sim.world import World

    loop = SimLoop(Fifo())
    net = Network(loop, random.Random(1))
    world = World(loop, net, SMALL, random.Random(1))
    late, early = world.start_worker(), world.start_worker()
    try:
        world.terminate(late)  # sent while it starts: its drain waits for the loop
        world.terminate(early)
        assert world.record.terminated_starting == {late, early}
        world.instances[late].state = "ready"  # its loop finished the start before the drain
        for wid in (late, early):
            world.instances[wid].drain("SIGTERM")  # (what the queued signal handler calls)
        assert world.record.terminated_starting == {early}
        took = STARTING_STOP_S + 1.0  # more than a worker that never started may take
        assert took < STOP_BOUND_S
        world.record.stopped = {late: took, early: took}
        got = check(net.sync_client(), world.record, bound_s=60, stop_bound_s=STOP_BOUND_S, zombie_bound_s=1,
                    starve_bound_s=60, end=60)
        assert [v.detail.split()[1] for v in got] == [early], [str(v) for v in got]
    finally:
        from sim.explore import _wind_down
        _wind_down(loop, net, world)
        loop.close()


def test_a_controlled_schedule_says_when_its_moment_never_came_and_raises_what_its_actions_raised() -> None:
    """A forcing test must not pass by missing its moment, nor hide a broken action."""
    from sim.scenario import Scenario, handler, script
    from sim.world import Planned

    scenario = Scenario([Planned("u0")])
    scenario.on(script("lease_renew", user="u9"), lambda world, e: None, label="never")
    scenario.on(handler("enter", user="u0"), lambda world, e: world.inject("no-such-fault", "w0"))
    with pytest.raises(ValueError, match="unknown fault"):
        scenario.run()
    assert scenario.unfired() == ["never (0 of 1)"]


# --- streamed turns ----------------------------------------------------------------------------
STREAMED = Workload(workers=2, users=3, turns=3, concurrency=2, ghosts=False, streamed=True)
# found by the planted bug below: a lane lost to a pause or an expiry mid-turn, its turn retried
STREAM_SEEDS = [31, 45, 83, 99]
UNFENCED_FLUSH = ("if redis.pcall('GET', lane) ~= owner then",
                  "if false then")


def streamed(seed: int) -> Schedule:
    return Schedule(seed=seed, workload=STREAMED, max_faults=3, fault_rate=0.003)


@pytest.mark.parametrize("seed", [*STREAM_SEEDS, *range(1, 9)])
def test_streamed_turns_hold_under_faults(seed: int) -> None:
    """Each stream's chunks are of the attempt its last restart began, it ends once with its
    reply, and its text after the last restart is the reply's (``checks._stream``)."""
    got = run(streamed(seed))
    assert got.ok, [str(v) for v in got.violations]


def test_a_flush_that_is_not_fenced_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush written without the lane: the worker that lost it adds its old attempt's text
    after the new attempt's restart."""
    plant(monkeypatch, "stream_append", UNFENCED_FLUSH)
    kinds = {v.kind for seed in STREAM_SEEDS for v in run(streamed(seed)).violations}
    assert "stream" in kinds


def test_a_schedule_whose_setup_fails_closes_its_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A schedule that fails before it runs (a planted bug that no longer applies, say) closes
    its loop: left open, the loop's finalizer warns in whichever test collects it."""
    closed: list[SimLoop] = []
    close = SimLoop.close

    def noting(self: SimLoop) -> None:
        closed.append(self)
        close(self)

    def broken(*_args: object) -> None:
        raise RuntimeError("the simulated Redis could not start")

    monkeypatch.setattr(SimLoop, "close", noting)
    monkeypatch.setattr("sim.explore.Network", broken)
    with pytest.raises(RuntimeError, match="could not start"):
        run(Schedule(seed=1, workload=SMALL, max_faults=0))
    assert len(closed) == 1 and closed[0].is_closed()
