"""The same load on one Redis node, a 1-master cluster and a 3-master cluster: does Fleet's
Redis cost scale with the masters, and where does a cluster's extra go?

Each setup (``--setups``, default ``node,c1,c3``) is its own private deployment on loopback,
started once with its own worker processes: ``node`` is one plain redis-server; ``cM`` is a
Redis Cluster of M masters with one replica each (``cMr0``: none) and ``ready_shards`` M
(``cMsK``: K; ``c3s1`` is the old "1 shard on 3 masters" comparison). Every round runs every
setup once, in an order rotated each round (a drift of the machine hits them alike), with the
same load: ``--users`` fresh users (the same names on every setup, so the same slots), each
sending ``--turns`` echo turns one after another, all users at once.

Per setup and per master, from the master's own counters (``INFO`` deltas around each
round): CPU microseconds per turn (user + sys), commands per turn, the commands that cost
most, network and replication bytes per turn; and turns/s, p50/p99 submit->reply. On 2
cores the workers and clients, not Redis, limit turns/s, so what says how far a setup goes is
its **ceiling**: 1 / the hottest master's CPU per turn (a master is one thread). Also: each
master's CPU per second while the workers idle (polling, cluster bus), the per-command diff
between the setups (what a cluster adds, command by command), and the cost model of
scripts/shard_model.py fitted on the 1-master cluster (a ``MONITOR`` of one extra round says
which key each command touched), checked against the largest cluster and projected to 10, 30
and 100 masters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cluster_rig
import redis
import shard_model
from bench_wait import cluster_workers, one_round
from benchlib import MachineWatch, OneLineParser, emit, percentile
from redis.crc import key_slot

from fleet.client import AsyncFleet
from protocol.keys import ready_shard
from protocol.policy import TurnsPolicy
from stores.connection import connect_sync
from stores.policies import write_policy

PROJECT_MASTERS = (10, 30, 100)
Commands = dict[str, tuple[int, int]]  # command -> (calls, usec), from INFO commandstats


@dataclass(frozen=True)
class Setup:
    """One deployment to measure: a plain node, or a cluster of ``masters`` masters with
    ``replicas`` replicas each and a tier of ``shards`` ready streams."""

    name: str
    cluster: bool
    masters: int = 1
    replicas: int = 0
    shards: int = 1

    def describe(self) -> str:
        if not self.cluster:
            return "one redis-server"
        return (f"{self.masters} master{'s' * (self.masters > 1)} + {self.masters * self.replicas} "
                f"replica{'s' * (self.masters * self.replicas != 1)}, ready_shards {self.shards}")


_SETUP = re.compile(r"^c(?P<m>\d+)(?:r(?P<r>\d+))?(?:s(?P<s>\d+))?$")


def parse_setup(text: str) -> Setup:
    """``node``, or ``c<masters>[r<replicas per master>][s<ready shards>]`` (``c3``, ``c1r0``,
    ``c3s1``): replicas 1 and as many shards as masters unless said."""
    if text == "node":
        return Setup(name="node", cluster=False)
    m = _SETUP.match(text)
    if m is None:
        raise ValueError(f"{text!r} is no setup (node, or cM[rR][sS] as c3, c1r0, c3s1)")
    masters = int(m["m"])
    setup = Setup(name=text, cluster=True, masters=masters, replicas=int(m["r"] or 1),
                  shards=int(m["s"] or masters))
    if not (1 <= setup.masters <= 16 and 0 <= setup.replicas <= 2 and 1 <= setup.shards <= 64):
        raise ValueError(f"{text!r}: 1-16 masters, 0-2 replicas each, 1-64 shards")
    return setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="scripts/bench_shards", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", default="node,c1,c3",
                   help="comma-separated (default node,c1,c3; also e.g. c3s1, c1r0)")
    p.add_argument("--users", type=int, default=300)
    p.add_argument("--turns", type=int, default=5, help="turns per user per round")
    p.add_argument("--workers", type=int, default=2, help="worker processes per setup")
    p.add_argument("--concurrency", type=int, default=64, help="slots per worker")
    p.add_argument("--rounds", type=int, default=6,
                   help="measured rounds of every setup (after one warm-up each)")
    p.add_argument("--idle-seconds", type=float, default=3.0,
                   help="how long each master's CPU is read with the workers idle")
    p.add_argument("--quick", action="store_true", help="40 users x 3 turns, 1 round (smoke test)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--table", type=Path, help="also write the text tables (markdown) here")
    args = p.parse_args(argv)
    if args.quick:
        args.users, args.turns = min(args.users, 40), min(args.turns, 3)
        args.rounds, args.idle_seconds = 1, 1.0
    if min(args.users, args.turns, args.workers, args.concurrency, args.rounds) < 1 or args.idle_seconds <= 0:
        p.error("--users, --turns, --workers, --concurrency, --rounds and --idle-seconds must be positive")
    try:
        args.setups = [parse_setup(s.strip()) for s in args.setups.split(",")]
    except ValueError as e:
        p.error(str(e))
    if len({s.name for s in args.setups}) != len(args.setups):
        p.error("--setups names a setup twice")
    return args


# ---- one master's counters ----------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """A master's counters at one moment (one ``INFO`` call: it adds one ``info`` per sample)."""

    cpu_s: float
    cmds: Commands
    net_in: int
    net_out: int
    repl_out: int
    reads: int  # read events (a client's request or pipeline arriving): round trips, about
    writes: int  # write events (replies sent)
    connections: int  # connections accepted


def sample(c: redis.Redis) -> Sample:
    """A master's counters, read down ``c``: one connection kept for the whole run, so the
    bench's own connects are not counted as the setup's."""
    info = c.execute_command("INFO", "cpu", "stats", "commandstats")
    cmds = {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for k, v in info.items() if k.startswith("cmdstat_")}
    return Sample(cpu_s=float(info["used_cpu_user"]) + float(info["used_cpu_sys"]), cmds=cmds,
                  net_in=int(info["total_net_input_bytes"]), net_out=int(info["total_net_output_bytes"]),
                  repl_out=int(info.get("total_net_repl_output_bytes", 0)),
                  reads=int(info["total_reads_processed"]), writes=int(info["total_writes_processed"]),
                  connections=int(info["total_connections_received"]))


def commands_delta(before: Commands, after: Commands) -> Commands:
    return {name: (calls - before.get(name, (0, 0))[0], usec - before.get(name, (0, 0))[1])
            for name, (calls, usec) in after.items() if calls != before.get(name, (0, 0))[0]}


@dataclass
class Tally:
    """What one master did over the counted rounds."""

    cpu_s: float = 0.0
    cmds: Commands = field(default_factory=dict)
    net_in: int = 0
    net_out: int = 0
    repl_out: int = 0
    reads: int = 0
    writes: int = 0
    connections: int = 0

    def add(self, before: Sample, after: Sample) -> None:
        self.cpu_s += after.cpu_s - before.cpu_s
        self.net_in += after.net_in - before.net_in
        self.net_out += after.net_out - before.net_out
        self.repl_out += after.repl_out - before.repl_out
        self.reads += after.reads - before.reads
        self.writes += after.writes - before.writes
        self.connections += after.connections - before.connections
        for name, (calls, usec) in commands_delta(before.cmds, after.cmds).items():
            c0, u0 = self.cmds.get(name, (0, 0))
            self.cmds[name] = (c0 + calls, u0 + usec)


# ---- the deployments ----------------------------------------------------------------------

@dataclass
class Deployment:
    """A setup's running redis-servers and their masters (in slot order), with its results."""

    setup: Setup
    rig: cluster_rig.RedisClusterRig
    masters: list[cluster_rig.ClusterNode]
    ranges: list[tuple[int, int]]
    tallies: dict[int, Tally] = field(default_factory=dict)  # master port -> counted rounds
    idle_us_per_s: dict[int, float] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    clients: dict[int, redis.Redis] = field(default_factory=dict)  # master port -> the bench's own

    def net_us_per_turn(self, port: int) -> float:
        """A master's CPU per turn less what it would have spent idle over the rounds."""
        idle = self.idle_us_per_s.get(port, 0.0) * self.elapsed_s
        return (self.tallies[port].cpu_s * 1e6 - idle) / len(self.latencies)

    def samples(self) -> dict[int, Sample]:
        for n in self.masters:
            if n.port not in self.clients:
                self.clients[n.port] = n.client()
        return {port: sample(c) for port, c in self.clients.items()}


Ranges = list[tuple[int, int]]


def slot_order(rig: cluster_rig.RedisClusterRig) -> tuple[list[cluster_rig.ClusterNode], Ranges]:
    """The masters by the first slot they serve, with their (single) slot ranges."""
    with rig.masters()[0].client() as c:
        slots = c.execute_command("CLUSTER", "SLOTS")
    rows = sorted((int(lo), int(hi), int(master[1])) for lo, hi, master, *_ in slots)
    by_port = {n.port: n for n in rig.nodes}
    if len({port for *_r, port in rows}) != len(rows):
        raise RuntimeError("a master serves more than one slot range: the model wants one each")
    return [by_port[port] for *_r, port in rows], [(lo, hi) for lo, hi, _p in rows]


@contextlib.contextmanager
def deployed(setup: Setup, args: argparse.Namespace, workdir: Path) -> Iterator[Deployment]:
    """The setup's servers, the tier's policy and its worker processes; all stopped after."""
    with contextlib.ExitStack() as stack:
        if setup.cluster:
            rig = cluster_rig.start_cluster(workdir, masters=setup.masters,
                                            replicas_per_master=setup.replicas)
        else:
            rig = cluster_rig.start_single(workdir)
        stack.callback(rig.stop)
        masters, ranges = slot_order(rig) if setup.cluster else (rig.masters(), [(0, shard_model.SLOTS - 1)])
        r = connect_sync(rig.url)
        try:
            write_policy(r, "chat", TurnsPolicy(handler="echo", concurrency=args.concurrency,
                                                ready_shards=setup.shards))
        finally:
            r.close()
        logs = workdir / "logs"
        logs.mkdir()
        stack.enter_context(cluster_workers(rig.url, args.workers, logs, fast_refresh=False))
        d = Deployment(setup=setup, rig=rig, masters=masters, ranges=ranges)
        try:
            yield d
        finally:
            for c in d.clients.values():
                c.close()


def round_users(rnd: int | str, n: int) -> list[str]:
    return [f"r{rnd}-u{i:04d}" for i in range(n)]


async def measure_round(d: Deployment, fleet: AsyncFleet, users: list[str], turns: int,
                        counted: bool) -> None:
    before = d.samples()
    got, elapsed = await one_round(fleet, users, turns)
    after = d.samples()
    if not counted:
        return
    d.latencies += got
    d.elapsed_s += elapsed
    for port, s in after.items():
        d.tallies.setdefault(port, Tally()).add(before[port], s)


async def measure_idle(deployments: list[Deployment], seconds: float) -> None:
    """Each master's CPU per second with the workers idle (all setups at once)."""
    before = [d.samples() for d in deployments]
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    after = [d.samples() for d in deployments]
    took = time.monotonic() - t0
    for d, b, a in zip(deployments, before, after, strict=True):
        d.idle_us_per_s = {port: (a[port].cpu_s - b[port].cpu_s) / took * 1e6 for port in a}


# ---- MONITOR: which key each command touched ----------------------------------------------

MARK = "fleet-bench-shards-monitor-end"


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"redis-cli monitor never showed {text!r} (in {path})")
        time.sleep(0.05)


async def monitored_round(d: Deployment, fleet: AsyncFleet, users: list[str], turns: int,
                          out: Path) -> shard_model.Attribution:
    """One more round (not counted) under ``MONITOR`` on each of the setup's masters."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError("redis-cli is not installed (it comes with redis-server)")
    files = {node.port: out / f"monitor-{d.setup.name}-{node.port}.txt" for node in d.masters}
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for port, path in files.items():
            with path.open("wb") as sink:
                procs[port] = subprocess.Popen([cli, "-p", str(port), "monitor"], stdout=sink,
                                               stderr=subprocess.STDOUT)
        for port, path in files.items():
            _wait_for(path, "OK", procs[port])
        await one_round(fleet, users, turns)
        for node in d.masters:  # the marker comes after every command of the round
            with node.client() as c:
                c.echo(MARK)
            _wait_for(files[node.port], MARK, procs[node.port])
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(timeout=10)
    parts = []
    for path in files.values():
        lines = path.read_text(errors="replace").splitlines()
        end = next(i for i, x in enumerate(lines) if MARK in x)
        parts.append(shard_model.attribute(lines[:end], len(users) * turns))
    return shard_model.merge(parts)


# ---- the results --------------------------------------------------------------------------

def per_turn(x: float, turns: int, digits: int = 1) -> float:
    return round(x / turns, digits)


def setup_result(d: Deployment) -> dict[str, object]:
    turns = len(d.latencies)
    masters = {}
    for i, node in enumerate(d.masters):
        t = d.tallies[node.port]
        cmd_us = sum(u for _c, u in t.cmds.values())
        ranked = sorted(t.cmds.items(), key=lambda kv: -kv[1][1])[:8]
        masters[f"127.0.0.1:{node.port}"] = {
            "slots": f"{d.ranges[i][0]}-{d.ranges[i][1]}",
            "cpu_us_per_turn": per_turn(t.cpu_s * 1e6, turns),
            "cpu_net_of_idle_us_per_turn": round(d.net_us_per_turn(node.port), 1),
            "commands_per_turn": per_turn(sum(c for c, _u in t.cmds.values()), turns, 2),
            "in_commands_us_per_turn": per_turn(cmd_us, turns),
            "net_in_bytes_per_turn": per_turn(t.net_in, turns, 0),
            "net_out_bytes_per_turn": per_turn(t.net_out, turns, 0),
            "replication_bytes_per_turn": per_turn(t.repl_out, turns, 0),
            "read_events_per_turn": per_turn(t.reads, turns, 2),
            "write_events_per_turn": per_turn(t.writes, turns, 2),
            "connections_per_turn": per_turn(t.connections, turns, 3),
            "idle_cpu_us_per_s": round(d.idle_us_per_s.get(node.port, 0.0), 0),
            "top_commands": {name: {"calls_per_turn": per_turn(c, turns, 2),
                                    "us_per_turn": per_turn(u, turns)} for name, (c, u) in ranked}}
    cpu = [per_turn(d.tallies[n.port].cpu_s * 1e6, turns) for n in d.masters]
    total, hottest = sum(cpu), max(cpu)
    nets = [(1e6 - d.idle_us_per_s.get(n.port, 0.0), d.net_us_per_turn(n.port)) for n in d.masters]
    # (a master whose idle rate, times the rounds' time, exceeds what it spent has no net figure)
    net_ceiling = min(free / net for free, net in nets) if all(net > 0 for _f, net in nets) else None
    return {"setup": d.setup.name, "describe": d.setup.describe(), "masters": len(d.masters),
            "ready_shards": d.setup.shards, "turns": turns, "turns_per_s": round(turns / d.elapsed_s, 1),
            "p50_ms": round(percentile(d.latencies, 50) * 1000, 2),
            "p99_ms": round(percentile(d.latencies, 99) * 1000, 2),
            "per_master": masters, "total_cpu_us_per_turn": round(total, 1),
            "hottest_cpu_us_per_turn": hottest,
            "hottest_over_fair_share": round(hottest / (total / len(cpu)), 3) if total else None,
            "ceiling_turns_per_s": round(1e6 / hottest) if hottest else None,
            "total_cpu_net_of_idle_us_per_turn": round(sum(d.net_us_per_turn(n.port) for n in d.masters), 1),
            "ceiling_net_of_idle_turns_per_s": round(net_ceiling) if net_ceiling is not None else None}


def command_diff(ds: list[Deployment],
                 seen: dict[str, shard_model.Attribution]) -> dict[str, dict[str, float]]:
    """Command -> setup -> microseconds per turn, summed over the setup's masters, of the calls
    clients sent (a call from a function is in the function's time: the part of a command's
    calls that came from functions, as ``MONITOR`` saw them in ``seen``, is left out); with the
    CPU outside commands (reading requests, writing replies, replication, the cluster bus,
    timers) and the CPU itself, so that each column adds up."""
    out: dict[str, dict[str, float]] = {}
    for d in ds:
        turns = len(d.latencies)
        in_cmds = cpu = 0.0
        for t in d.tallies.values():
            cpu += t.cpu_s * 1e6
            for name, (_c, usec) in t.cmds.items():
                own = usec * shard_model.top_level_share(seen[d.setup.name], name)
                row = out.setdefault(name, {})
                row[d.setup.name] = row.get(d.setup.name, 0.0) + own / turns
                in_cmds += own
        out.setdefault("(outside commands)", {})[d.setup.name] = (cpu - in_cmds) / turns
        out.setdefault("(CPU)", {})[d.setup.name] = cpu / turns
    return {name: {s: round(v, 1) for s, v in row.items()} for name, row in out.items()}


def command_calls(ds: list[Deployment]) -> dict[str, dict[str, float]]:
    """Command -> setup -> calls per turn over the setup's masters (a function's calls too)."""
    out: dict[str, dict[str, float]] = {}
    for d in ds:
        for t in d.tallies.values():
            for name, (calls, _u) in t.cmds.items():
                row = out.setdefault(name, {})
                row[d.setup.name] = round(row.get(d.setup.name, 0.0) + calls / len(d.latencies), 2)
    return out


def scaling(results: dict[str, dict[str, object]]) -> dict[str, object]:
    """The largest cluster against the node: ceiling ratio, total CPU ratio, hottest share."""
    node = results.get("node")
    clusters = [r for r in results.values() if r["setup"] != "node"]
    if node is None or not clusters:
        return {}
    big = max(clusters, key=lambda r: (r["masters"], r["ready_shards"]))
    ceiling_ratio = big["ceiling_turns_per_s"] / node["ceiling_turns_per_s"]  # type: ignore[operator]
    total_ratio = big["total_cpu_us_per_turn"] / node["total_cpu_us_per_turn"]  # type: ignore[operator]
    share = big["hottest_over_fair_share"]
    net_big, net_node = big["ceiling_net_of_idle_turns_per_s"], node["ceiling_net_of_idle_turns_per_s"]
    net_ceiling = net_big / net_node if net_big and net_node else float("nan")  # type: ignore[operator]
    net_total = big["total_cpu_net_of_idle_us_per_turn"] / node["total_cpu_net_of_idle_us_per_turn"]  # type: ignore[operator]
    return {"compared": f"{big['setup']} : node", "ceiling_ratio": round(ceiling_ratio, 3),
            "total_cpu_ratio": round(total_ratio, 3), "hottest_over_fair_share": share,
            "net_of_idle": {"ceiling_ratio": round(net_ceiling, 3), "total_cpu_ratio": round(net_total, 3)},
            "goals_met": {"ceiling_ratio >= 2.5": ceiling_ratio >= 2.5,
                          "total_cpu_ratio <= 1.2": total_ratio <= 1.2,
                          "hottest_over_fair_share <= 1.25": share is not None and share <= 1.25}}  # type: ignore[operator]


def model_result(one: Deployment, attribution: shard_model.Attribution, big: Deployment | None,
                 users: list[str]) -> dict[str, object]:
    """The model fitted on the 1-master cluster ``one``, checked against ``big``, projected."""
    turns = len(one.latencies)
    ((port, tally),) = one.tallies.items()
    stats = {name: (c / turns, u / turns) for name, (c, u) in tally.cmds.items()}
    costs = shard_model.fit(attribution, stats, one.net_us_per_turn(port))
    idle = one.idle_us_per_s.get(port, 0.0)
    trips_one = tally.reads / turns
    per_trip = shard_model.us_per_trip(costs, trips_one)
    out: dict[str, object] = {
        "fitted_on": one.setup.name, "idle_us_per_s_per_master": round(idle),
        "round_trips_per_turn": round(trips_one, 2), "us_per_round_trip": round(per_trip, 1),
        "key_costs_us_per_turn": {c.pattern or "(no key)": round(c.us, 1)
                                  for c in sorted(costs, key=lambda c: -c.us) if round(c.us, 1)},
        "calls_per_turn_by_command_and_key": top_calls(attribution)}
    many, on = trips_one, 1
    if big is not None:
        out["check"] = model_check(costs, attribution, big, users, trips_one, per_trip)
        many = sum(t.reads for t in big.tallies.values()) / len(big.latencies)
        on = len(big.masters)
    out["projections"] = [
        projection(shard_model.project(costs, m, idle_us_per_s=idle, extra_us_per_master=per_trip
                                       * shard_model.trips_per_master(m, trips_one, many, on)))
        for m in PROJECT_MASTERS]
    out["assumptions"] = (
        "costs net of each master's idle CPU, which every master pays at the 1-master's rate; users spread "
        "evenly; ready_shards = masters (at most 64); keyless commands paid by every master at the 1-master "
        "rate per turn; a turn sends the same commands whatever the masters; its round trips grow as "
        f"a + b x masters, fitted on {one.setup.name} and {big.setup.name if big else '(none)'}, "
        f"each at {per_trip:.1f} µs (the 1-master's CPU outside commands per round trip)")
    return out


def top_calls(attribution: shard_model.Attribution, n: int = 25) -> dict[str, float]:
    """The ``n`` (command, key) pairs clients sent most in the ``MONITOR`` round, per turn."""
    ranked = sorted(attribution.top.items(), key=lambda kv: -kv[1])[:n]
    return {f"{name} {pattern or '(no key)'}": round(k / attribution.turns, 2)
            for (name, pattern), k in ranked}


def projection(p: shard_model.Projection) -> dict[str, object]:
    return vars(p) | {"hottest_us": round(p.hottest_us, 1), "total_us": round(p.total_us, 1),
                      "ceiling_turns_per_s": round(p.ceiling_turns_per_s)}


def model_check(costs: list[shard_model.KeyCost], attribution: shard_model.Attribution, big: Deployment,
                users: list[str], trips_one: float, per_trip: float) -> dict[str, object]:
    """The model's per-master prediction for ``big`` (its real slot ranges, the bench's users
    and their shards) against what its masters measured: from the 1-master figures alone, and
    with the round trips ``big``'s masters really had (what splitting batches added)."""
    n, shards = len(big.ranges), big.setup.shards
    user_share = [0.0] * n
    shard_share = [0.0] * shards
    for u in users:
        slot = key_slot(u.encode())  # a user's keys are tagged by the user id
        user_share[next(i for i, (lo, hi) in enumerate(big.ranges) if lo <= slot <= hi)] += 1 / len(users)
        shard_share[ready_shard(u, shards)] += 1 / len(users)

    def place(cs: list[shard_model.KeyCost], extra: list[float] | None = None) -> list[float]:
        return shard_model.predict(cs, big.ranges, shards, user_share=user_share, shard_share=shard_share,
                                   extra_us=extra)

    alone = place(costs)
    calls: dict[str, float] = {}
    for (_name, pattern), k in attribution.top.items():
        calls[pattern] = calls.get(pattern, 0.0) + k / attribution.turns
    per_call = trips_one / (sum(calls.values()) or 1.0)  # a master's round trips follow its calls
    trips_kept = place([shard_model.KeyCost(p, k * per_call, 0.0) for p, k in calls.items()])
    trips = [big.tallies[node.port].reads / len(big.latencies) for node in big.masters]
    with_trips = place(costs, [per_trip * (t - k) for t, k in zip(trips, trips_kept, strict=True)])
    measured = [big.net_us_per_turn(node.port) for node in big.masters]
    return {"setup": big.setup.name, "what": "CPU µs per turn net of idle",
            "round_trips_per_master": {"kept_from_1_master": [round(k, 2) for k in trips_kept],
                                       "measured": [round(t, 2) for t in trips]},
            "from_1_master_alone": compare(alone, measured),
            "with_measured_round_trips": compare(with_trips, measured)}


def compare(predicted: list[float], measured: list[float]) -> dict[str, object]:
    """Predicted against measured, per master, for the hottest and in all (error in %)."""
    def one(p: float, m: float) -> dict[str, float]:
        return {"predicted_us": round(p, 1), "measured_us": round(m, 1),
                "error_pct": round((p - m) / m * 100, 1) if m else float("nan")}

    return {"per_master": [one(p, m) for p, m in zip(predicted, measured, strict=True)],
            "hottest": one(max(predicted), max(measured)), "total": one(sum(predicted), sum(measured))}


# ---- text tables ---------------------------------------------------------------------------

def tables(result: dict[str, object]) -> str:
    """The shard table, the per-command diff and the model, as markdown."""
    setups: dict[str, dict[str, object]] = result["setups"]  # type: ignore[assignment]
    names = list(setups)
    lines = ["| setup | turns/s | p50 ms | p99 ms | CPU µs/turn per master | total | hottest "
             "| ceiling turns/s | net of idle: total µs/turn, ceiling | idle µs/s per master "
             "| round trips/turn per master |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|---|---|"]
    for r in setups.values():
        per = " / ".join(f"{m['cpu_us_per_turn']:g}" for m in r["per_master"].values())  # type: ignore[attr-defined]
        ms = r["per_master"].values()  # type: ignore[attr-defined]
        idle = " / ".join(f"{m['idle_cpu_us_per_s']:,.0f}" for m in ms)
        trips = " / ".join(f"{m['read_events_per_turn']:g}" for m in ms)
        lines.append(f"| {r['setup']} ({r['describe']}) | {r['turns_per_s']:,} | {r['p50_ms']} "
                     f"| {r['p99_ms']} | {per} | {r['total_cpu_us_per_turn']} "
                     f"| {r['hottest_cpu_us_per_turn']} | {r['ceiling_turns_per_s']:,} "
                     f"| {r['total_cpu_net_of_idle_us_per_turn']}, "
                     f"{r['ceiling_net_of_idle_turns_per_s']:,} | {idle} | {trips} |")
    sc = result.get("scaling")
    if sc:
        assert isinstance(sc, dict)
        net = sc["net_of_idle"]
        lines += ["", f"{sc['compared']}: ceiling x{sc['ceiling_ratio']} (goal >= 2.5), total CPU "
                      f"x{sc['total_cpu_ratio']} (goal <= 1.2), hottest / fair share "
                      f"{sc['hottest_over_fair_share']} (goal <= 1.25); net of idle: ceiling "
                      f"x{net['ceiling_ratio']}, total CPU x{net['total_cpu_ratio']}"]
    diff: dict[str, dict[str, float]] = result["command_diff"]  # type: ignore[assignment]
    base = names[0]
    ranked = sorted(diff, key=lambda c: -max(abs(v - diff[c].get(base, 0.0)) for v in diff[c].values()))
    lines += ["", f"| command (µs per turn, all masters) | {' | '.join(names)} | {names[-1]} - {base} |",
              "|---|" + "---:|" * (len(names) + 1)]
    for name in ranked:
        row = diff[name]
        if all(abs(v) < 0.05 for v in row.values()):
            continue
        cells = " | ".join(f"{row.get(s, 0.0):g}" for s in names)
        lines.append(f"| {name} | {cells} | {row.get(names[-1], 0.0) - row.get(base, 0.0):+.1f} |")
    lines += ["", "| setup (all masters) | round trips/turn | outside commands µs/turn | µs per round trip "
                  "| replication bytes/turn | connections/turn | idle µs/s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in setups.items():
        ms = list(r["per_master"].values())  # type: ignore[attr-defined]
        trips = sum(m["read_events_per_turn"] for m in ms)
        outside = diff["(outside commands)"][name]
        per_trip = outside / trips if trips else float("nan")
        lines.append(f"| {name} | {trips:.2f} | {outside:g} | {per_trip:.1f} "
                     f"| {sum(m['replication_bytes_per_turn'] for m in ms):,.0f} "
                     f"| {sum(m['connections_per_turn'] for m in ms):.3f} "
                     f"| {sum(m['idle_cpu_us_per_s'] for m in ms):,.0f} |")
    model = result.get("model")
    if isinstance(model, dict):
        lines += ["", f"Model fitted on {model['fitted_on']} ({model['assumptions']}):", "",
                  "| masters | ready_shards | hottest µs/turn | its costliest key | total µs/turn "
                  "| ceiling turns/s |",
                  "|---:|---:|---:|---|---:|---:|"]
        for p in model["projections"]:
            lines.append(f"| {p['masters']} | {p['ready_shards']} | {p['hottest_us']} "
                         f"| `{p['hottest_pattern'] or '(no key)'}` | {p['total_us']} "
                         f"| {p['ceiling_turns_per_s']:,} |")
        check = model.get("check")
        if check:
            lines += ["", f"Check on {check['setup']}, predicted vs measured CPU µs/turn per master, "
                          "net of idle:"]
            for label, key in (("from the 1-master alone", "from_1_master_alone"),
                               ("with its measured round trips", "with_measured_round_trips")):
                c = check[key]
                per = ", ".join(f"{m['predicted_us']} vs {m['measured_us']} ({m['error_pct']:+}%)"
                                for m in c["per_master"])
                lines.append(f"- {label}: {per}; hottest {c['hottest']['error_pct']:+}%, "
                             f"total {c['total']['error_pct']:+}%")
    return "\n".join(lines) + "\n"


# ---- the run -------------------------------------------------------------------------------

def largest_cluster(ds: list[Deployment]) -> Deployment | None:
    """The cluster of most masters (then most shards): what the model is checked against."""
    clusters = [d for d in ds if d.setup.cluster and d.setup.masters > 1]
    return max(clusters, key=lambda d: (d.setup.masters, d.setup.shards)) if clusters else None


def model_source(ds: list[Deployment]) -> Deployment | None:
    """The 1-master cluster the model is fitted on: one with as many replicas per master as
    the largest cluster has, if there is one (``c1`` rather than ``c1r0`` beside ``c3``)."""
    ones = [d for d in ds if d.setup.cluster and d.setup.masters == 1]
    big = largest_cluster(ds)
    same = [d for d in ones if big is not None and d.setup.replicas == big.setup.replicas]
    return next(iter(same or ones), None)


async def run(args: argparse.Namespace, ds: list[Deployment], tmp: Path) -> dict[str, object]:
    fleets = {d.setup.name: AsyncFleet(d.rig.url) for d in ds}
    one = model_source(ds)
    seen: dict[str, shard_model.Attribution] = {}
    try:
        for d in ds:  # a warm-up each, not counted
            await measure_round(d, fleets[d.setup.name], round_users("w", args.users), args.turns,
                                counted=False)
        await measure_idle(ds, args.idle_seconds)
        for rnd in range(args.rounds):
            for d in ds[rnd % len(ds):] + ds[:rnd % len(ds)]:
                await measure_round(d, fleets[d.setup.name], round_users(rnd, args.users), args.turns,
                                    counted=True)
                print(f"  round {rnd + 1}/{args.rounds} {d.setup.name}: {args.users * args.turns} turns",
                      file=sys.stderr, flush=True)
        for d in ds:
            seen[d.setup.name] = await monitored_round(d, fleets[d.setup.name], round_users("m", args.users),
                                                       args.turns, tmp)
    finally:
        for f in fleets.values():
            await f.aclose()
    results = {d.setup.name: setup_result(d) | {"monitor_calls_per_turn": top_calls(seen[d.setup.name])}
               for d in ds}
    out: dict[str, object] = {"users": args.users, "turns_per_user": args.turns, "workers": args.workers,
                              "concurrency": args.concurrency, "rounds": args.rounds, "handler": "echo",
                              "setups": results, "scaling": scaling(results),
                              "command_diff": command_diff(ds, seen),
                              "command_calls_per_turn": command_calls(ds)}
    if one is not None:
        big = largest_cluster(ds)
        users = [u for rnd in range(args.rounds) for u in round_users(rnd, args.users)]
        out["model"] = model_result(one, seen[one.setup.name], big, users)
    else:
        out["model"] = "not fitted: it needs a 1-master cluster among the setups (c1)"
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = MachineWatch()  # (is the machine quiet? the verdict is in the output)
    with tempfile.TemporaryDirectory(prefix="fleet-bench-shards-") as tmp, contextlib.ExitStack() as stack:
        print(f"bench_shards: {', '.join(s.name for s in args.setups)}; {args.workers} workers each, "
              f"{args.users} users x {args.turns} turns, {args.rounds} rounds", file=sys.stderr, flush=True)
        ds = [stack.enter_context(deployed(s, args, Path(tmp) / s.name)) for s in args.setups]
        with watch.phase("rounds"):
            result = asyncio.run(run(args, ds, Path(tmp)))
    text = tables(result)
    print(text, file=sys.stderr)
    if args.table is not None:
        args.table.write_text(text)
    emit(result, args.json, watch)
    return 0


if __name__ == "__main__":
    os.environ.pop("FLEET_REDIS_CLUSTER", None)  # detected per setup
    sys.exit(main())
