"""A turn's Redis cost per key, and what it predicts for a cluster of M masters.

The cost is fitted on a 1-master cluster (``scripts/bench_shards``): ``MONITOR`` counts each
command a turn sends to the master by its first key (``attribute``), ``INFO commandstats``
gives each command's microseconds per call, and the master's own CPU counters give the rest
(reading requests, writing replies, feeding the replica, the event loop), which is dealt out
per top-level call (``fit``). Each key's cost then lands where the key lives (``predict``):

- a per-user key (``fleet:u:{U}:...``) spreads with the users over every master;
- the tier's ready stream spreads over ``ready_shards`` streams (``fleet:{T#k}:ready``), each
  on the master of its own slot;
- any other key (the tier's active set, a worker's heartbeat, the registry) stays on the
  master of its slot, whatever the number of masters;
- a command without a key (``PING``, ``CLUSTER SLOTS``, ``INFO``) is paid by every master
  (a client polls each master it talks to), at the 1-master rate per turn.

Assumptions, stated where the projections are shown: a turn sends the same commands whatever
the number of masters (a worker reads each ready shard, so with more shards its reads return
fewer entries each: the model does not see that), and per-second costs (heartbeats, idle
reads) are counted per turn at the rate of the measured load, which overstates them at a
master's ceiling. Pure functions, no Redis.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from cluster_rig import slot_ranges  # how the rig deals slots, so a projection's masters are the rig's
from redis.crc import key_slot

SLOTS = 16384
SPLIT_TRIPS = "(round trips of split batches)"  # a projection's costliest part when no key is
MAX_READY_SHARDS = 64  # protocol.keys.MAX_READY_SHARDS: the policy's bound on ready_shards
KEYLESS = frozenset({
    "multi", "exec", "discard", "ping", "info", "cluster", "client", "command", "hello", "auth", "select",
    "readonly", "readwrite", "wait", "function", "script", "time", "config", "echo", "memory", "latency",
    "slowlog", "role", "dbsize", "acl", "lastsave", "quit", "reset"})
WITH_SUBCOMMAND = frozenset({"xinfo", "xgroup", "object"})  # the key after the subcommand
WITH_NUMKEYS = frozenset({"fcall", "fcall_ro", "eval", "evalsha", "eval_ro", "evalsha_ro"})
_USER_KEY = re.compile(r"^(?P<head>.*?):u:\{[^}]*\}:(?P<what>[^:]*)")
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
_LINE = re.compile(r"^\d+\.\d+ \[\d+ (?P<client>[^\]]*)\] (?P<args>.*)$")


def first_key(args: Sequence[str]) -> str | None:
    """The first key of a command (``args[0]`` is its name), None for a command without one."""
    name = args[0].lower() if args else ""
    if not args or name in KEYLESS:
        return None
    if name in WITH_NUMKEYS:
        return args[3] if len(args) > 3 and args[2].isdigit() and int(args[2]) > 0 else None
    if name in ("xreadgroup", "xread"):
        upper = [a.upper() for a in args]
        at = upper.index("STREAMS") if "STREAMS" in upper else -1
        return args[at + 1] if 0 <= at < len(args) - 1 else None
    if name in WITH_SUBCOMMAND:
        return args[2] if len(args) > 2 else None
    return args[1] if len(args) > 1 else None


def key_pattern(key: str | None) -> str:
    """What a key's cost is kept under: a per-user key with its user (and whatever follows its
    kind) replaced by ``*`` (``fleet:u:{*}:reply``), any other key as it is, ``""`` for none."""
    if key is None:
        return ""
    m = _USER_KEY.match(key)
    return f"{m['head']}:u:{{*}}:{m['what']}" if m else key


def parse_monitor_line(line: str) -> tuple[bool, list[str]] | None:
    """One line of ``redis-cli monitor``: (whether a client sent it, rather than a script or
    function; its arguments), or None for a line that is no command (``OK``)."""
    m = _LINE.match(line.strip())
    if m is None:
        return None
    args = [a.replace('\\"', '"') for a in _ARG.findall(m["args"])]
    return (m["client"] != "lua", args) if args else None


Call = tuple[str, str]  # (command, key pattern)


@dataclass(frozen=True)
class Attribution:
    """What ``MONITOR`` saw during a run of ``turns`` turns: top-level calls by (command, key
    pattern), and for each script or function call among them, the commands it called (a
    script's calls follow its own line: Redis runs one command at a time)."""

    turns: int
    top: Mapping[Call, int]
    inner: Mapping[Call, Mapping[str, int]]


def attribute(lines: Iterable[str], turns: int) -> Attribution:
    """Count a ``MONITOR`` capture's commands by (command, key pattern)."""
    top: Counter[Call] = Counter()
    inner: dict[Call, Counter[str]] = {}
    script: Call | None = None
    for line in lines:
        parsed = parse_monitor_line(line)
        if parsed is None:
            continue
        from_client, args = parsed
        name = args[0].lower()
        if from_client:
            call = (name, key_pattern(first_key(args)))
            top[call] += 1
            script = call if name in WITH_NUMKEYS else None
        elif script is not None:
            inner.setdefault(script, Counter())[name] += 1
    return Attribution(turns=turns, top=dict(top), inner={k: dict(v) for k, v in inner.items()})


def merge(parts: Sequence[Attribution]) -> Attribution:
    """One attribution of captures taken at once on several masters (of the same turns)."""
    top: Counter[Call] = Counter()
    inner: dict[Call, Counter[str]] = {}
    for part in parts:
        top.update(part.top)
        for call, cmds in part.inner.items():
            inner.setdefault(call, Counter()).update(cmds)
    return Attribution(turns=max((p.turns for p in parts), default=0), top=dict(top),
                       inner={k: dict(v) for k, v in inner.items()})


def top_level_share(attribution: Attribution, command: str) -> float:
    """Of a command's calls, the part clients sent (the rest came from scripts and functions,
    whose own time already holds them); 1 for a command never seen."""
    top = sum(n for (name, _p), n in attribution.top.items() if name == command)
    inner = sum(cmds.get(command, 0) for cmds in attribution.inner.values())
    return top / (top + inner) if top + inner else 1.0


@dataclass(frozen=True)
class KeyCost:
    """Microseconds of a master's CPU per turn spent on one key pattern: in its commands
    (``commands_us``, a function's inner calls included) and in the rest (``other_us``:
    network, replication, event loop), dealt out per top-level call."""

    pattern: str
    commands_us: float
    other_us: float

    @property
    def us(self) -> float:
        return self.commands_us + self.other_us


Stats = Mapping[str, tuple[float, float]]  # command -> (calls, microseconds) per turn


def command_costs(attribution: Attribution, commandstats: Stats) -> dict[str, float]:
    """Microseconds per turn in commands, by key pattern. ``commandstats``: command -> (calls,
    microseconds) per turn as ``INFO commandstats`` counts them: a call from a script counts
    under its own name and inside the script's time, so a script's call costs its inner calls
    (at their commands' mean cost per call) plus its share of what the script's time has
    beyond them. A command ``MONITOR`` never showed (it hides some admin commands) is keyless."""
    per_call = {name: us / calls for name, (calls, us) in commandstats.items() if calls > 0}
    turns = max(attribution.turns, 1)

    def inner_us(call: Call) -> float:
        return sum(n / turns * per_call.get(cmd, 0.0) for cmd, n in attribution.inner.get(call, {}).items())

    own: dict[str, float] = {}  # a script command's time per call beyond its inner calls
    for name in {c for c, _p in attribution.top if c in WITH_NUMKEYS}:
        calls, us = commandstats.get(name, (0.0, 0.0))
        inside = sum(inner_us(call) for call in attribution.top if call[0] == name)
        own[name] = max(0.0, us - inside) / calls if calls > 0 else 0.0
    out: dict[str, float] = defaultdict(float)
    for call, n in attribution.top.items():
        name, pattern = call
        rate = n / turns
        if name in WITH_NUMKEYS:
            out[pattern] += inner_us(call) + rate * own[name]
        else:
            out[pattern] += rate * per_call.get(name, 0.0)
    seen = {c for c, _p in attribution.top} | {cmd for inner in attribution.inner.values() for cmd in inner}
    out[""] += sum(us for name, (calls, us) in commandstats.items() if calls > 0 and name not in seen)
    return dict(out)


def fit(attribution: Attribution, commandstats: Stats, cpu_us_per_turn: float) -> list[KeyCost]:
    """The cost per key pattern of a turn on one master whose CPU per turn is
    ``cpu_us_per_turn``: its commands (``command_costs``), and the rest of its CPU dealt out
    per top-level call (each is a request read and a reply written)."""
    commands = command_costs(attribution, commandstats)
    calls: Counter[str] = Counter()
    for (_name, pattern), n in attribution.top.items():
        calls[pattern] += n
    other = cpu_us_per_turn - sum(commands.values())
    all_calls = sum(calls.values()) or 1
    return [KeyCost(p, commands.get(p, 0.0), other * calls[p] / all_calls)
            for p in sorted(set(commands) | set(calls))]


def master_of(key: str, ranges: Sequence[tuple[int, int]]) -> int:
    """The index in ``ranges`` of the master serving ``key``'s slot."""
    slot = key_slot(key.encode())
    return next(i for i, (lo, hi) in enumerate(ranges) if lo <= slot <= hi)


def ready_key(tier: str, shard: int) -> str:
    """protocol.keys.ready, restated so the model stays a pure module of the scripts."""
    return f"fleet:{{{tier}}}:ready" if shard == 0 else f"fleet:{{{tier}#{shard}}}:ready"


def predict(costs: Iterable[KeyCost], ranges: Sequence[tuple[int, int]], shards: int, tier: str = "chat",
            user_share: Sequence[float] | None = None, shard_share: Sequence[float] | None = None,
            extra_us: Sequence[float] | None = None) -> list[float]:
    """Each master's CPU microseconds per turn on a cluster whose masters serve ``ranges``,
    with ``shards`` ready streams of ``tier``. ``user_share[m]``: the part of the turns whose
    user lives on master m (default: even); ``shard_share[k]``: the part of the turns notified
    on ready shard k (default: even); ``extra_us[m]``: what master m pays besides its keys
    (the round trips a split batch adds: ``split_trips``)."""
    n = len(ranges)
    users = list(user_share) if user_share is not None else [1.0 / n] * n
    by_shard = list(shard_share) if shard_share is not None else [1.0 / shards] * shards
    if len(users) != n or len(by_shard) != shards:
        raise ValueError("user_share needs one share per master, shard_share one per shard")
    out = list(extra_us) if extra_us is not None else [0.0] * n
    if len(out) != n:
        raise ValueError("extra_us needs one figure per master")
    for cost in costs:
        if cost.pattern == "":
            out = [x + cost.us for x in out]
        elif "{*}" in cost.pattern:
            out = [x + cost.us * share for x, share in zip(out, users, strict=True)]
        elif cost.pattern == ready_key(tier, 0):
            for k, share in enumerate(by_shard):
                out[master_of(ready_key(tier, k), ranges)] += cost.us * share
        else:
            out[master_of(cost.pattern, ranges)] += cost.us
    return out


def us_per_trip(costs: Iterable[KeyCost], trips_per_turn: float) -> float:
    """What a round trip costs a master beyond its commands (reading the request, writing the
    reply, feeding the replica), from the costs fitted on one master and its read events."""
    return sum(c.other_us for c in costs) / trips_per_turn if trips_per_turn > 0 else 0.0


def trips_per_master(masters: int, one: float, many: float, measured_on: int) -> float:
    """The round trips per turn each of ``masters`` masters has beyond what one master had,
    dealt out: a batch a worker sends as one pipeline to one master goes as one pipeline per
    master on a cluster, so the turn's round trips grow with the masters, as ``a + b * M``
    fitted on a 1-master (``one`` per turn) and a ``measured_on``-master cluster (``many``
    per turn, all masters together); each master gets ``b * (M - 1) / M``."""
    if measured_on < 2:
        return 0.0
    b = max(0.0, (many - one) / (measured_on - 1))
    return b * (masters - 1) / masters


def ceiling(per_master_us: Sequence[float], idle_us_per_s: float = 0.0) -> float:
    """Turns/s at which the hottest master's one thread is busy all the time, when each master
    also spends ``idle_us_per_s`` of every second on what it does with no turns at all."""
    return (1e6 - idle_us_per_s) / max(per_master_us)


@dataclass(frozen=True)
class Projection:
    masters: int
    ready_shards: int
    hottest_us: float
    hottest_pattern: str  # the key pattern costing the hottest master most
    total_us: float
    ceiling_turns_per_s: float


def project(costs: Sequence[KeyCost], masters: int, tier: str = "chat", idle_us_per_s: float = 0.0,
            extra_us_per_master: float = 0.0) -> Projection:
    """The ceiling of one tier on ``masters`` even masters, with as many ready shards as
    masters (at most ``MAX_READY_SHARDS``) and users spread evenly; ``idle_us_per_s``: each
    master's CPU with no turns (the costs are then those net of it); ``extra_us_per_master``:
    what each pays per turn besides its keys (split batches' round trips)."""
    ranges = slot_ranges(masters)
    shards = min(masters, MAX_READY_SHARDS)
    per_master = predict(costs, ranges, shards, tier, extra_us=[extra_us_per_master] * masters)
    hot = max(range(masters), key=lambda m: per_master[m])
    parts = {c.pattern: predict([c], ranges, shards, tier)[hot] for c in costs}
    parts[SPLIT_TRIPS] = extra_us_per_master
    return Projection(masters=masters, ready_shards=shards, hottest_us=per_master[hot],
                      hottest_pattern=max(parts, key=lambda p: parts[p]), total_us=sum(per_master),
                      ceiling_turns_per_s=ceiling(per_master, idle_us_per_s))
