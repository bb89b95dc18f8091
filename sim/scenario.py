"""Controlled schedules: a fault injected at an observable event, not at a drawn step.

An explorer seed replays one exact interleaving; once the code's awaits move, the same seed
no longer reaches the state it found. A controlled schedule names the moment instead ("when
w0's ``lane_acquire`` for u0 has run on the server, pause w0"), by what the network and the
handler see: a connection attempt, a command the server ran, a handler's entry and exit. The
same schedule then reaches the same state whatever the await structure of the code under it.

A ``Scenario`` holds the clients' plan (``Planned`` turns) and the triggers; ``run`` runs the
real workers and clients on the simulator (in asyncio's order unless told another, with no
drawn faults) and checks I1-I3, liveness, the stop and the zombie bounds, as the explorer does::

    scenario = Scenario([Planned("u0", sleep_ms=5000)], workers=2)
    scenario.on(script("lease_renew", user="u0"), lambda world, e: world.inject("expire", "u0"))
    outcome = scenario.run()
    assert outcome.ok and scenario.unfired() == []
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import keys
from protocol.codec import as_str
from sim.explore import Outcome, Schedule, run
from sim.store import Wire
from sim.world import Call, Planned, Workload, World


@dataclass(frozen=True)
class Event:
    """One observable event: ``connect``, ``applied`` and ``queued`` carry the network's ``wire``
    (``sim.store.Wire``: the node, the command's words, its reply); ``enter`` and ``exit`` (a
    handler) the user and turn."""

    kind: str
    node: str | None
    wire: Wire | None = None
    user: str = ""
    turn: str = ""

    @property
    def args(self) -> tuple[bytes, ...]:
        return self.wire.args if self.wire is not None else ()

    @property
    def command(self) -> str:
        return self.wire.command if self.wire is not None else ""

    def script(self) -> str | None:
        return self.wire.script() if self.wire is not None else None

    def script_keys(self) -> list[str]:
        return self.wire.script_keys() if self.wire is not None else []


Match = Callable[[Event], bool]
Act = Callable[[World, Event], None]


def script(name: str, *, node: str | None = None, user: str | None = None) -> Match:
    """The server ran Lua script ``name`` (from ``node``; on ``user``'s keys)."""
    prefix = keys.lane(user).rpartition(":")[0] + ":" if user is not None else ""

    def match(e: Event) -> bool:
        return (e.kind == "applied" and e.script() == name and (node is None or e.node == node)
                and (user is None or any(k.startswith(prefix) for k in e.script_keys())))
    return match


def command(name: str, *, kind: str = "applied", node: str | None = None, word: bytes | None = None) -> Match:
    """The server ran (``kind="queued"``: queued) command ``name`` (from ``node``; one of
    whose words contains ``word``)."""
    def match(e: Event) -> bool:
        return (e.kind == kind and e.command == name.upper() and (node is None or e.node == node)
                and (word is None or any(word in a for a in e.args)))
    return match


def connect(node: str) -> Match:
    """``node`` tries to connect (a new connection: Redis may be away)."""
    return lambda e: e.kind == "connect" and e.node == node


def handler(kind: str, *, user: str | None = None, turn: str | None = None) -> Match:
    """A handler's ``enter`` or ``exit`` (of ``user``'s turn ``turn``)."""
    return lambda e: (e.kind == kind and (user is None or e.user == user)
                      and (turn is None or e.turn == turn))


def lane_holder(world: World, user: str) -> str | None:
    """The worker holding ``user``'s lane now (None: free), read on the fault-free client."""
    held = world.net.sync_client().get(keys.lane(user))
    return as_str(held).rpartition("|")[0] if held is not None else None


def took_lane(user: str) -> Callable[[World, Event], bool]:
    """A ``lane_acquire`` for ``user`` that left the lane to its sender (see ``Scenario.on``'s ``when``)."""
    return lambda world, e: lane_holder(world, user) == e.node


def found_lane_busy(user: str) -> Callable[[World, Event], bool]:
    """A ``lane_acquire`` for ``user`` that found another worker holding the lane."""
    return lambda world, e: lane_holder(world, user) not in (None, e.node)


@dataclass
class Trigger:
    """Run ``act`` at the first ``times`` events that match (None: at every one), and, with
    ``when``, that hold then in the world as it is."""

    label: str
    match: Match
    act: Act
    when: Callable[[World, Event], bool] | None = None
    times: int | None = 1
    fired: int = 0


@dataclass
class Scenario:
    """A controlled schedule: the clients' plan, the fleet's size and the triggers."""

    plan: list[Planned]
    workers: int = 1
    concurrency: int = 1
    seed: int = 0  # the network's latencies and the backoff jitter (and the order, if drawn)
    strategy: str = "fifo"  # the order of ready callbacks: asyncio's own, or drawn ("random", "pct")
    triggers: list[Trigger] = field(default_factory=list)
    world: World | None = None  # the world of the last run
    errors: list[BaseException] = field(default_factory=list)

    def on(self, match: Match, act: Act, *, when: Callable[[World, Event], bool] | None = None,
           times: int | None = 1, label: str = "") -> Trigger:
        """Run ``act(world, event)`` at the matching events (see :class:`Trigger`)."""
        trigger = Trigger(label or getattr(act, "__name__", "trigger"), match, act, when, times)
        self.triggers.append(trigger)
        return trigger

    def unfired(self) -> list[str]:
        """The triggers that fired fewer times than asked: the schedule did not happen."""
        return [f"{t.label} ({t.fired} of {t.times})" for t in self.triggers
                if t.times is not None and t.fired < t.times]

    def workload(self) -> Workload:
        users = list(dict.fromkeys(p.user for p in self.plan))
        turns = max((sum(1 for p in self.plan if p.user == u) for u in users), default=1)
        return Workload(workers=self.workers, users=len(users), turns=turns,
                        concurrency=self.concurrency, ghosts=False)

    def run(self) -> Outcome:
        """Run the plan with the triggers; raise what an action raised."""
        self.errors.clear()
        for t in self.triggers:
            t.fired = 0
        got = run(Schedule(seed=self.seed, workload=self.workload(), strategy=self.strategy, faults=[]),
                  scenario=self)
        if self.errors:
            raise self.errors[0]
        return got

    # --- called by sim.explore.run ---------------------------------------------------------
    def install(self, world: World) -> None:
        self.world = world
        world.net.watchers.append(lambda w: self._see(Event(w.kind, w.node, w)))
        world.handler_watchers.append(self._see_call)

    def _see_call(self, kind: str, call: Call) -> None:
        self._see(Event(kind, call.worker, user=call.user, turn=call.turn))

    def _see(self, e: Event) -> None:
        for t in self.triggers:
            if (t.times is None or t.fired < t.times) and t.match(e):
                self._fire(t, e)

    def _fire(self, t: Trigger, e: Event) -> None:
        world = self.world
        assert world is not None
        try:
            if t.when is not None and not t.when(world, e):
                return
            t.fired += 1
            t.act(world, e)
        except Exception as exc:  # raised by run(), after the schedule: not into the code it watches
            self.errors.append(exc)
