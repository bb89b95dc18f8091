"""Chaos run: a fleet under steady load while workers, the commander and Redis fail at random.

Faults (loopback only, bounded in time, stops by itself): SIGKILL of a worker, a drain
racing a SIGKILL, SIGSTOP of a worker past its lane TTL then SIGCONT (its lanes expire and
other workers take its users over; its late writes must be fenced), SIGKILL of the commander
(a new one is started), SIGKILL + restart of redis-server (AOF with appendfsync always),
SIGSTOP/SIGCONT pauses of redis-server. Then the invariants (docs/internals/architecture.md) are checked from
Redis, from the clients' own records and from the workers' handler trace:

  I1 every accepted turn has exactly one reply      I2 per user, sessions in submission order
  I3 per user, no two leases inside a handler at    I4 one commander per epoch, epochs grow
     once unless one was fenced; and each turn      I5 nothing lost to scale-in (I1 under drains)
     saw every earlier turn of its user             I6 no orphan process after shutdown; live
                                                       workers never above max_workers

It also measures the wait (submit -> reply) over the faulty period, longest and p99, and the
takeover after each worker SIGKILL or pause: for every user the worker was inside a handler
for at that moment, the time to that user's next reply. Exit status 1 if any invariant
fails or a fault quota was not met.

``--cluster``: the same load, commander, workers and worker/commander faults on a Redis Cluster
of 3 masters + 3 replicas (scripts/cluster_rig.py), every process given the URL of one node
(FLEET_REDIS_CLUSTER=yes). The Redis faults become cluster faults: ``master-kill`` (SIGKILL of
a master by pid, its replica promoted by the cluster, the time to promotion measured, then the
killed node started again: it rejoins as a replica) and ``master-pause`` (SIGSTOP/SIGCONT of a
master, shorter than cluster-node-timeout: no failover). Replication is asynchronous, so a
failover may lose or double writes: every anomaly (lost, duplicated, out of order, context gap,
I3 violation, shared epoch) is attributed to a failover when its user's slot (or the tier's,
or the ledger's) was on the killed master and it was submitted from FAILOVER_BEFORE_S before
the kill to FAILOVER_AFTER_S after the promotion; those are reported as "across a failover
(expected without WAIT)" and do not fail the run. Everything else must hold as on one Redis,
and so must liveness: a turn whose inbox entry survived but that was never answered
("stranded") fails the run, failover or not. A lost turn whose inbox entry is gone lost its
submit to the failover (the master acknowledged it, then died before its replica had it).

``--hostile`` (with any mode): bad tier members and registry entries, users' keys of the wrong
type and poison notifications written during the load (scripts/chaos_hostile.py); each turn and
notification must be answered (an error reply or a dead letter) and no Fleet process may exit
on its own, while the load's users' invariants hold as without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import chaos_check
import chaos_hostile
import cluster_rig
import psutil
import redis
import redis.asyncio as aioredis
from benchlib import ROOT, OneLineParser, free_port
from chaos_check import Injected, MasterKill, TraceTail, UserLog

from fleet.client import AsyncFleet, Fleet
from protocol import keys
from protocol.acl import ROLE_NAMES, acl_file
from protocol.codec import CodecError, decode, encode
from protocol.models import Control, LedgerEvent, OccupancyReport, WorkerInfo
from protocol.policy import TurnsPolicy, turns_policy
from stores import functions
from stores.connection import connect_async, connect_sync
from stores.policies import write_policy
from stores.registry import read_registry
from stores.retry import TRANSIENT
from stores.roles import ADMIN, password_env, with_credentials

POLICY = turns_policy(handler="sleep", handler_options={"sleep_ms": 40}, concurrency=4, min_workers=2,
                      max_workers=6, target_backlog_per_worker=4, users_per_instance=None,
                      report_interval_s=0.5, scale_down_stabilization_s=5, drain_timeout_s=5, max_attempts=10)
# --streamed: users of a second tier whose turns stream (the handler emits each word, 15 ms
# apart) and are often stopped; its workers are among the faults' victims like chat's
STREAM_TIER = "stream"
STREAM_POLICY = turns_policy(handler="echo_stream", handler_options={"delay_ms": 15}, concurrency=4,
                             min_workers=1, max_workers=3, target_backlog_per_worker=4,
                             users_per_instance=None, report_interval_s=0.5, scale_down_stabilization_s=5,
                             drain_timeout_s=5, max_attempts=10)
CANCEL_SHARE = 0.3  # of the streamed turns, stopped 0-0.4 s after the submit (queued or running)
WORKER_ENV = {"FLEET_WORKER_LANE_TTL_MS": "2000", "FLEET_WORKER_RENEW_INTERVAL_S": "0.4",
              "FLEET_WORKER_RECLAIM_IDLE_MS": "2000", "FLEET_WORKER_RECLAIM_INTERVAL_S": "0.5",
              "FLEET_WORKER_HOUSEKEEPING_INTERVAL_S": "2"}
PAUSE_S = (3.0, 4.5)  # a worker pause: past the lane TTL (2 s), short of the heartbeat TTL (5 s)
VICTIM_WAIT_S = 10.0  # a worker fault waits this long for a live worker to hit
DRAIN_OBEYED_S = 15.0  # a worker told to drain shows it by then (past a pause, a Redis pause)
CLUSTER_NODE_TIMEOUT_MS = 2000  # --cluster: a master silent this long is failed over
MASTER_PAUSE_S = (0.4, 1.2)  # a master pause: well short of the node timeout (no failover)
REPLY_GRACE_S = 60.0  # --cluster: a client stops waiting for a reply this long after the load ends
HOSTILE_GRACE_S = 60.0  # --hostile: the injections still unanswered when the load ends get this long


def parse_args(argv: list[str] | None = None):
    p = OneLineParser(prog="scripts/chaos", description=__doc__)
    p.add_argument("--minutes", type=float, default=5.0, help="length of the faulty period")
    p.add_argument("--quick", action="store_true", help="60 s, for the test suite")
    p.add_argument("--users", type=int, default=30)
    p.add_argument("--streamed", type=int, default=0, metavar="USERS",
                   help=f"users on tier {STREAM_TIER!r} too: streamed turns, {CANCEL_SHARE:.0%}% of "
                        "them stopped")
    p.add_argument("--every", type=float, default=None, help="seconds between faults (default: fits quotas)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--keep", type=Path, help="copy the run's logs, handler trace and samples here")
    p.add_argument("--cluster", action="store_true",
                   help="on a 3-master + 3-replica Redis Cluster, with master kills (failovers) and pauses")
    p.add_argument("--lagging-replica", type=float, default=0.0, metavar="SECONDS",
                   help="--cluster: pause the killed master's replica this long before each master kill "
                        "(it falls behind: the failover can lose acknowledged writes)")
    p.add_argument("--replica-acks", type=int, default=None,
                   help="set the tier policy's replica_acks (WAIT after the submit, the lane acquire "
                        "and the commit)")
    p.add_argument("--hostile", action="store_true",
                   help="also inject bad tier members, bad registry entries, users' keys of the wrong type "
                        "and poison notifications during the load (scripts/chaos_hostile.py): each must be "
                        "answered, and no Fleet process may exit")
    p.add_argument("--pause-s", default=None, metavar="LOW,HIGH",
                   help=f"how long a worker pause lasts, drawn in [LOW, HIGH] (default {PAUSE_S[0]},"
                        f"{PAUSE_S[1]}: past the lane TTL, short of the heartbeat TTL; e.g. 15,18 for "
                        f"pauses past the heartbeat, which the commander's takeover answers too)")
    p.add_argument("--policy-json", default=None,
                   help='extra tier policy fields as JSON, by name, e.g. \'{"replica_acks": 1}\' (validated)')
    args = p.parse_args(argv)
    try:
        args.policy = chaos_policy(args.replica_acks, args.policy_json)
    except ValueError as exc:
        p.error(str(exc).replace("\n", " "))
    if args.quick:
        args.minutes = 1.0
    try:
        low, high = (float(x) for x in args.pause_s.split(",")) if args.pause_s else PAUSE_S
    except ValueError:
        p.error(f"--pause-s takes LOW,HIGH in seconds, not {args.pause_s!r}")
    if not 0 < low <= high:
        p.error("--pause-s: 0 < LOW <= HIGH")
    args.pause_s = (low, high)
    if args.minutes <= 0 or args.users < 1:
        p.error("--minutes and --users must be positive")
    if args.lagging_replica and not args.cluster:
        p.error("--lagging-replica needs --cluster")
    return args


def chaos_policy(replica_acks: int | None, policy_json: str | None) -> TurnsPolicy:
    """POLICY with the fields asked for (any name ``protocol.policy.resolve`` takes);
    ``--replica-acks`` sets the per-tier WAIT."""
    extra = json.loads(policy_json) if policy_json else {}
    if not isinstance(extra, dict):
        raise ValueError("--policy-json must be a JSON object")
    if replica_acks is not None:
        extra["replica_acks"] = replica_acks
    return turns_policy(POLICY, **extra) if extra else POLICY


# --- the processes ----------------------------------------------------------------------------
@dataclass
class Cluster:
    """redis-server and commanders owned by the run, every pid remembered for the orphan check.

    Redis runs Fleet's roles' ACL file (``protocol.acl``) with passwords made for the run; its
    default user is the admin, which installs the library and which the run's own reader (the
    faults, the sampler, the checks) uses. The commander, its workers and the load's clients
    connect as their roles."""

    home: Path
    port: int = field(default_factory=free_port)
    redis_proc: subprocess.Popen[bytes] | None = None
    cluster: bool = False  # a Redis Cluster (``rig``) instead of one redis-server
    rig: cluster_rig.RedisClusterRig | None = None
    spared: cluster_rig.ClusterNode | None = None  # the node of ``url``: never killed (see start_rig)
    commander: subprocess.Popen[bytes] | None = None
    commanders_started: int = 0
    commander_exits: list[str] = field(default_factory=list)  # exits of a commander chaos did not kill
    pids_seen: set[int] = field(default_factory=set)
    passwords: dict[str, str] = field(
        default_factory=lambda: {role: secrets.token_hex(16) for role in ROLE_NAMES})
    admin_password: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def url(self) -> str:
        """The run's Redis, without credentials."""
        if self.spared is not None:
            return f"redis://127.0.0.1:{self.spared.port}/0"
        return f"redis://127.0.0.1:{self.port}/0"

    def role_url(self, role: str) -> str:
        """``url`` as ACL role ``role`` (``ADMIN``: the admin)."""
        password = self.admin_password if role == ADMIN else self.passwords[role]
        return with_credentials(self.url, role, password)

    def client(self, socket_timeout: float = 30) -> redis.Redis:
        """The admin's blocking client of the run's Redis: a cluster client on a cluster."""
        if self.cluster:
            return connect_sync(self.role_url(ADMIN), retries=12, socket_timeout=socket_timeout,
                                cluster="yes")
        return redis.Redis.from_url(self.role_url(ADMIN), socket_timeout=socket_timeout)

    def acl_denials(self) -> list[str]:
        """The refusals of a Fleet role in the ``ACL LOG`` of every live node (since its last
        start: a restart empties it), each ``<port>: <user> <reason> <object>``."""
        if self.rig is not None:
            nodes = [(n.port, n.client(timeout=10)) for n in self.rig.nodes if n.alive]
        else:
            nodes = [(self.port, redis.Redis(port=self.port, password=self.admin_password,
                                             socket_timeout=10))]
        out = []
        for port, client in nodes:
            with client:
                out += [f"{port}: {e.get('username')} {e.get('reason')} {e.get('object')}"
                        for e in client.acl_log(count=1000) if e.get("username") in self.passwords]
        return out

    def start_rig(self) -> None:
        """3 masters + 3 replicas. Every process gets the URL of one master that no fault kills:
        a process (re)started while a killed master is down must find a node to learn the slots
        from (Fleet takes one URL; a deployment would point it at a stable name)."""
        self.rig = cluster_rig.start_cluster(self.home / "cluster", node_timeout_ms=CLUSTER_NODE_TIMEOUT_MS,
                                             passwords=self.passwords, admin_password=self.admin_password)
        self.spared = self.rig.masters()[0]

    @property
    def trace(self) -> Path:
        """The handler trace of every worker. One file for all: the commander gives each
        worker its own environment, so a worker's id cannot be in the path; each worker opens
        it in append mode, line-buffered, and a line is one write(2) to an O_APPEND file,
        which Linux never interleaves with another process's."""
        return self.home / "handlers.jsonl"

    def start_redis(self) -> None:
        """Start (or restart) the one redis-server: the ACL file is written once and kept on
        disk; the library is installed (as the admin) when the server does not hold it (a
        restart finds it in the AOF)."""
        data = self.home / "redis"
        data.mkdir(parents=True, exist_ok=True)
        aclfile = self.home / "users.acl"
        if not aclfile.exists():
            aclfile.write_text(acl_file(self.passwords, default=self.admin_password))
        self.redis_proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data), "--aclfile", str(aclfile)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, password=self.admin_password)
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    if functions.library_state(client)[0] != "ok":
                        functions.install(client)  # FUNCTION LOAD REPLACE
                    return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    if time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not come back") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def kill_redis(self) -> None:
        assert self.redis_proc is not None
        self.redis_proc.kill()
        self.redis_proc.wait()

    def start_commander(self) -> None:
        self.commanders_started += 1
        env = {**os.environ, **WORKER_ENV, "FLEET_WORKER_HANDLER_TRACE": str(self.trace),
               "REDIS_URL": self.url, "PYTHONPATH": str(ROOT),
               # the commander connects as its role, and gives its workers their role's password
               **{password_env(role): pw for role, pw in self.passwords.items()}}
        if self.cluster:
            env["FLEET_REDIS_CLUSTER"] = "yes"  # never taken for a single node if its node is away
        log = open(self.home / f"commander-{self.commanders_started}.log", "ab")  # noqa: SIM115
        self.commander = subprocess.Popen(
            [sys.executable, "-m", "commander", "--commander-id", f"chaos-{self.commanders_started}",
             "--no-metrics", "--log-dir", str(self.home / "logs"), "--stop-workers-on-exit"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.pids_seen.add(self.commander.pid)

    def note_commander_exit(self) -> None:
        """Record the commander's exit if it exited (called just before chaos kills or stops it)."""
        if self.commander is not None and self.commander.poll() is not None:
            self.commander_exits.append(f"commander chaos-{self.commanders_started} exited "
                                        f"(code {self.commander.returncode})")

    def stop(self) -> None:
        if self.commander and self.commander.poll() is None:
            self.commander.terminate()
            try:
                self.commander.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.commander.kill()
                self.commander.wait()
        if self.redis_proc and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            self.redis_proc.wait(timeout=20)
        if self.rig is not None:
            self.rig.stop()


def live_workers(r: redis.Redis) -> list[WorkerInfo]:
    return read_registry(r).live()


# --- faults -------------------------------------------------------------------------------------
class Faults:
    """Injects one fault at a time from a schedule that meets the quotas, then random ones."""

    QUOTA = {"worker-kill": 20, "drain-kill": 4, "worker-pause": 5, "commander-kill": 3, "redis-restart": 2,
             "redis-pause": 3}
    WEIGHTS = {"worker-kill": 6, "drain-kill": 2, "worker-pause": 2, "commander-kill": 1, "redis-restart": 1,
               "redis-pause": 1}
    TAKES_S = {"worker-kill": 0.0, "drain-kill": 0.15, "worker-pause": sum(PAUSE_S) / 2,
               "commander-kill": 1.0, "redis-restart": 1.5, "redis-pause": 3.0,  # how long each lasts, about
               "master-kill": 12.0, "master-pause": sum(MASTER_PAUSE_S) / 2}
    CLUSTER = {"redis-restart": "master-kill", "redis-pause": "master-pause"}  # --cluster's Redis faults
    CLUSTER_QUOTA = {"master-kill": 4, "master-pause": 3}  # per 5 minutes, as QUOTA

    def __init__(self, cluster: Cluster, seconds: float, every: float | None, rng: random.Random,
                 trace: TraceTail, pause_s: tuple[float, float] = PAUSE_S) -> None:
        self.cluster, self.rng, self.trace = cluster, rng, trace
        self.pause_s = pause_s
        self.TAKES_S = {**self.TAKES_S, "worker-pause": sum(pause_s) / 2}
        if cluster.cluster:
            self.QUOTA = {self.CLUSTER.get(k, k): n for k, n in self.QUOTA.items()} | self.CLUSTER_QUOTA
            self.WEIGHTS = {self.CLUSTER.get(k, k): n for k, n in self.WEIGHTS.items()}
        self.master_kills: list[MasterKill] = []  # --cluster: every failover, with its promotion time
        self.failovers_in_pauses = 0  # --cluster: a master pause that was failed over all the same
        self.lag_s = 0.0  # --cluster: how long a master's replicas are paused before its kill
        self.count: Counter[str] = Counter()
        self.errors: list[str] = []
        self.injected: list[Injected] = []  # worker kills and pauses, for the takeover figures
        self.killed: dict[str, float] = {}  # worker id -> when we SIGKILLed it
        self.drained: set[str] = set()  # workers sent a drain (not capacity from then on)
        self.timeline: list[tuple[float, str]] = []  # (when it started, kind) of every fault
        self.victims: dict[float, str] = {}  # when a worker fault started -> its worker
        self.first: float | None = None  # when the first fault started: the faulty period begins
        self.seconds = seconds
        scale = min(1.0, seconds / 300)
        self.quota = {k: max(1, round(n * scale)) for k, n in self.QUOTA.items()}
        plan = [k for k, n in self.quota.items() for _ in range(n)]
        rng.shuffle(plan)  # the quotas first, in random order, so a run always meets them
        # 5 s to settle, 5 s of load without faults at the end, the faults' own length, 25 % slack
        room = seconds - 10 - sum(self.TAKES_S[k] for k in plan)
        self.every = every or max(1.5, 0.75 * room / max(1, len(plan)))
        extra = max(0, int(room / (self.every + 1.0)) - len(plan))
        self.plan = plan + rng.choices(list(self.WEIGHTS), weights=list(self.WEIGHTS.values()), k=extra)

    def run(self, stop: threading.Event, r: redis.Redis) -> None:
        deadline = time.monotonic() + self.seconds - 5  # no fault starts in the last 5 s of load
        stop.wait(5.0)  # let the fleet settle first
        for kind in self.plan:
            if stop.is_set() or time.monotonic() > deadline:
                return
            self.first = self.first or time.time()
            self.timeline.append((time.time(), kind))
            try:
                getattr(self, kind.replace("-", "_"))(r)
                self.count[kind] += 1
            except Exception as exc:  # a fault that could not be injected is reported, not fatal
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            stop.wait(self.every * self.rng.uniform(0.6, 1.4))

    def before(self, when: float, window_s: float = 30.0) -> list[str]:
        """The faults that started in the ``window_s`` before ``when``, with their victims."""
        return [" ".join(filter(None, (kind, self.victims.get(t)))) + f" {when - t:.1f} s before"
                for t, kind in self.timeline if 0 <= when - t <= window_s]

    def missed(self) -> list[str]:
        return [f"{k} {self.count[k]}/{n}" for k, n in self.quota.items() if self.count[k] < n]

    def _victim(self, r: redis.Redis, wait_s: float = VICTIM_WAIT_S) -> WorkerInfo:
        """A live worker, preferably one inside a handler now (its users measure the takeover).
        Right after a kill there may be none until the commander's replacement registers (a
        tier of 2 that just lost both): wait for one, ``wait_s`` at most."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                workers = [w for w in live_workers(r) if w.worker not in self.killed and _running(w.pid)]
            except TRANSIENT:  # a master failing over: ask again
                workers = []
            self.cluster.pids_seen.update(w.pid for w in workers)
            if workers or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if not workers:
            raise RuntimeError(f"no live worker within {wait_s:g} s")
        busy = self.trace.busy_workers()
        return self.rng.choice([w for w in workers if w.worker in busy] or workers)

    def _kill(self, kind: str, victim: WorkerInfo) -> None:
        os.kill(victim.pid, signal.SIGKILL)
        now = time.time()
        self.victims[self.timeline[-1][0]] = victim.worker
        self.killed[victim.worker] = now
        self.injected.append(Injected(kind, now, now, victim.worker))

    def worker_kill(self, r: redis.Redis) -> None:
        self._kill("worker-kill", self._victim(r))

    def drain_kill(self, r: redis.Redis) -> None:
        victim = self._victim(r)
        self.drained.add(victim.worker)
        body = encode(Control(kind="drain", ts=time.time(), reason="chaos"))
        r.xadd(keys.control(victim.worker), {"m": body})
        time.sleep(self.rng.uniform(0.0, 0.3))
        try:
            self._kill("drain-kill", victim)
        except ProcessLookupError:  # the drain won the race: it is an outcome, not a failure
            self.count["drain finished before the kill"] += 1

    def worker_pause(self, r: redis.Redis) -> None:
        """SIGSTOP past the lane TTL: the worker's lanes expire while it sits inside handlers."""
        victim = self._victim(r)
        os.kill(victim.pid, signal.SIGSTOP)
        stopped = time.time()
        self.victims[self.timeline[-1][0]] = victim.worker
        try:
            time.sleep(self.rng.uniform(*self.pause_s))
        finally:
            with contextlib.suppress(ProcessLookupError):  # (killed meanwhile by its commander)
                os.kill(victim.pid, signal.SIGCONT)
        self.injected.append(Injected("worker-pause", stopped, time.time(), victim.worker))

    def commander_kill(self, r: redis.Redis) -> None:
        assert self.cluster.commander is not None
        self.cluster.note_commander_exit()
        self.cluster.commander.kill()
        self.cluster.commander.wait()
        time.sleep(self.rng.uniform(0.2, 1.5))
        self.cluster.start_commander()

    def redis_restart(self, r: redis.Redis) -> None:
        self.cluster.kill_redis()
        time.sleep(self.rng.uniform(0.3, 1.5))
        self.cluster.start_redis()

    def master_kill(self, r: redis.Redis) -> None:
        """SIGKILL of a master (not the spared URL node) mid-load; the cluster promotes its
        replica (timed); a little later the killed node is started again and rejoins as a
        replica of the promoted one."""
        rig = self.cluster.rig
        assert rig is not None and self.cluster.spared is not None
        victim = self.rng.choice([m for m in rig.masters() if m.port != self.cluster.spared.port])
        slots = served_slots(victim)
        rig.kill_master(victim, lag_s=self.lag_s)
        killed_at = time.time()
        try:
            promoted = rig.wait_promoted(victim, timeout=60)
            promoted_at = time.time()
            lost = rig.stream_lost(victim, promoted)
            self.master_kills.append(MasterKill(killed_at, promoted_at, victim.port, promoted.port, slots,
                                                lag_s=self.lag_s, stream_lost=lost))
        except TimeoutError:
            self.master_kills.append(MasterKill(killed_at, None, victim.port, None, slots, lag_s=self.lag_s))
            raise
        finally:
            time.sleep(self.rng.uniform(1.0, 3.0))
            rig.heal(timeout=60)
        self.master_kills[-1] = self.master_kills[-1]._replace(healed=time.time())

    def master_pause(self, r: redis.Redis) -> None:
        """SIGSTOP/SIGCONT of a master, shorter than cluster-node-timeout (no failover expected;
        one all the same is counted)."""
        rig = self.cluster.rig
        assert rig is not None
        victim = self.rng.choice(rig.masters())
        victim.pause()
        try:
            time.sleep(self.rng.uniform(*MASTER_PAUSE_S))
        finally:
            victim.resume()
        time.sleep(0.2)
        if victim.role != "master":
            self.failovers_in_pauses += 1
            rig.heal(timeout=60)

    def redis_pause(self, r: redis.Redis) -> None:
        assert self.cluster.redis_proc is not None
        self.cluster.redis_proc.send_signal(signal.SIGSTOP)
        time.sleep(self.rng.uniform(2.0, 4.0))
        self.cluster.redis_proc.send_signal(signal.SIGCONT)


def served_slots(node: cluster_rig.ClusterNode) -> list[tuple[int, int]]:
    """The slot ranges ``node`` serves now (asked of the node itself)."""
    with node.client() as c:
        return [(int(lo), int(hi)) for lo, hi, master, *_ in c.execute_command("CLUSTER", "SLOTS")
                if int(master[1]) == node.port]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


# --- the load and its records ----------------------------------------------------------------
async def user_loop(fleet: AsyncFleet, reader: aioredis.Redis, user: str, log: UserLog, stop: asyncio.Event,
                    rng: random.Random, grace_s: float = 300.0) -> None:
    """One user's turns, submitted by ``fleet`` (the client's role); their replies are watched
    by ``reader`` (the admin: the client role may only take a reply, not look at it)."""
    n = 0
    while not stop.is_set():
        batch = []
        for _ in range(rng.choice((1, 1, 2, 3))):  # several turns of one user in flight at once
            turn_id = f"{user}-{n}"
            n += 1
            log.sent.append(turn_id)
            log.sent_at[turn_id] = time.time()
            t0 = time.monotonic()
            if await _submit(fleet, user, turn_id, f"turn {turn_id}", log,
                             meta={"sleep_ms": rng.choice((10, 40, 120))}):
                batch.append((turn_id, t0))
            else:
                log.uncertain.add(turn_id)
        # each reply polled on its own: one after the other, a turn behind one that a failover
        # lost was timed only once the lost one's poll gave up (tests/unit/test_chaos_waits.py)
        await asyncio.gather(*(_await_reply(reader, user, turn_id, t0, log, stop, grace_s)
                               for turn_id, t0 in batch))
        await asyncio.sleep(rng.uniform(0.0, 0.3))


async def stream_user_loop(fleet: AsyncFleet, reader: aioredis.Redis, user: str, log: UserLog,
                           stop: asyncio.Event, rng: random.Random, grace_s: float = 300.0) -> None:
    """One user of the streamed tier: one or two streamed turns at once, of 3-12 words, each
    stopped with probability ``CANCEL_SHARE`` 0-0.4 s after it was submitted (queued, or
    running: its text half streamed). The replies are watched as ``user_loop``'s are; the
    streams are checked afterwards (``chaos_check.check_streams``)."""
    n = 0
    while not stop.is_set():
        batch = []
        for _ in range(rng.choice((1, 1, 2))):
            turn_id = f"{user}-{n}"
            n += 1
            text = " ".join(f"{turn_id}.{i}" for i in range(rng.randint(3, 12)))
            log.sent.append(turn_id)
            log.sent_at[turn_id] = time.time()
            log.texts[turn_id] = text
            t0 = time.monotonic()
            if await _submit(fleet, user, turn_id, text, log, tier=STREAM_TIER, stream=True):
                batch.append((turn_id, t0))
            else:
                log.uncertain.add(turn_id)
        stops = [asyncio.create_task(_cancel(fleet, user, turn_id, rng.uniform(0.0, 0.4), log))
                 for turn_id, _ in batch if rng.random() < CANCEL_SHARE]
        await asyncio.gather(*stops, *(_await_reply(reader, user, turn_id, t0, log, stop, grace_s)
                                       for turn_id, t0 in batch))
        await asyncio.sleep(rng.uniform(0.0, 0.3))


async def _cancel(fleet: AsyncFleet, user: str, turn_id: str, after_s: float, log: UserLog) -> None:
    """Stop the turn ``after_s`` from now (sent again on an error: a cancel is idempotent); what
    the cancel answered is kept for the checks."""
    await asyncio.sleep(after_s)
    for attempt in range(40):
        try:
            log.cancels[turn_id] = (await fleet.cancel(user, turn_id)).outcome
            return
        except TRANSIENT as exc:
            log.errors[f"cancel {type(exc).__name__}"] += 1
            await asyncio.sleep(min(2.0, 0.05 * 2 ** attempt) * random.random())
    log.cancels[turn_id] = "error"


async def _submit(fleet: AsyncFleet, user: str, turn_id: str, text: str, log: UserLog,
                  meta: dict[str, Any] | None = None, tier: str = "chat", stream: bool = False) -> bool:
    """Submit, and on an error submit the same turn id again: a resubmitted turn is deduplicated
    by the workers (answered once), so a client can retry without fear of doubles."""
    for attempt in range(40):
        try:
            await fleet.submit(user, text, tier=tier, meta=meta, turn_id=turn_id, stream=stream)
            if turn_id in fleet.unreplicated:  # its WAIT (replica_acks) came back short
                log.unreplicated.add(turn_id)
            return True
        except TRANSIENT as exc:
            log.errors[type(exc).__name__] += 1
            await asyncio.sleep(min(2.0, 0.05 * 2 ** attempt) * random.random())
    return False


async def _await_reply(reader: aioredis.Redis, user: str, turn_id: str, t0: float, log: UserLog,
                       stop: asyncio.Event, grace_s: float = 300.0) -> None:
    """Poll for the reply without consuming it: the checker counts the replies afterwards.
    Gives up after 300 s, or ``grace_s`` after the load stopped (a turn a failover lost never
    gets one: the checker still finds a late reply, and its wait)."""
    key = keys.reply(user, turn_id)
    deadline = time.monotonic() + 300
    stopped_at: float | None = None
    while time.monotonic() < deadline:
        if stop.is_set():
            stopped_at = stopped_at or time.monotonic()
            if time.monotonic() - stopped_at > grace_s:
                return
        try:
            if await reader.llen(key):
                log.answered[turn_id] = time.monotonic() - t0
                return
        except TRANSIENT:
            pass
        await asyncio.sleep(0.05)


async def run_load(url: str, reader_url: str, users: int, seconds: float, seed: int,
                   grace_s: float = 300.0, streamed: int = 0) -> tuple[dict[str, UserLog], float]:
    """Every user's record, and when the load stopped submitting (unix time). The turns are
    submitted with ``url`` (the client's role), their replies watched with ``reader_url``;
    ``streamed`` users (``s000``...) stream theirs on tier ``STREAM_TIER``."""
    fleet = AsyncFleet(client=connect_async(url, retries=12))  # rides out a Redis restart
    reader = connect_async(reader_url, retries=12)
    logs = {f"c{i:03d}": UserLog() for i in range(users)}
    logs |= {f"s{i:03d}": UserLog(streamed=True) for i in range(streamed)}
    stop = asyncio.Event()
    rng = random.Random(seed)
    tasks = [asyncio.create_task((stream_user_loop if log.streamed else user_loop)(
        fleet, reader, u, log, stop, random.Random(rng.random()), grace_s)) for u, log in logs.items()]
    await asyncio.sleep(seconds)
    stop.set()
    ended = time.time()
    done, _pending = await asyncio.wait(tasks, timeout=240)
    await fleet.aclose()
    await reader.aclose()
    for task in done:
        task.result()  # a user's loop that failed (not a transient error) fails the run
    return logs, ended


# --- after the run ------------------------------------------------------------------------------
def orphans(cluster: Cluster) -> list[int]:
    mine = [p for p in psutil.process_iter(["pid", "cmdline"])
            if str(cluster.home) in " ".join(p.info["cmdline"] or [])
            or p.info["pid"] in cluster.pids_seen]
    return [p.pid for p in mine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


class Sampler(threading.Thread):
    """Samples the live workers, to check that those counted as capacity never exceed
    max_workers (no double spawn). A draining worker is not capacity: the commander starts its
    replacement while it finishes its turns (as a Deployment does while a pod terminates), so
    it is left out, whether its report says so, chaos sent it the drain, or its control stream
    holds one it has not acted on yet (a paused worker); the live count with it is kept too.
    The workers seen at the highest count are kept, to explain it, and every sample."""

    def __init__(self, cluster: Cluster, stop: threading.Event, drained: set[str]) -> None:
        super().__init__(daemon=True)
        self.cluster, self.stop, self.drained = cluster, stop, drained
        self.max_seen = self.max_running = 0
        self.max_at = 0.0  # when max_seen was first seen
        self.at_max: list[str] = []  # "worker:state" of every running worker at max_seen
        self.samples: list[tuple[float, int, list[str]]] = []  # (when, capacity, "worker:state")
        self.ordered_at: dict[str, float] = {}  # worker -> when a drain it did not show was first seen
        self.ignored: set[str] = set()  # told to drain, still not draining DRAIN_OBEYED_S later

    def run(self) -> None:
        r = self.cluster.client(socket_timeout=2)
        while not self.stop.wait(0.5):
            try:
                everyone = live_workers(r)
            except TRANSIENT:
                continue
            self.cluster.pids_seen.update(w.pid for w in everyone)
            live = [w for w in everyone if w.tier == "chat"]  # (max_workers is chat's, not --streamed's)
            running = [w for w in live if _running(w.pid)]
            try:
                capacity, labels = capacity_of(r, running, self.drained)
            except TRANSIENT:
                continue
            self.max_running = max(self.max_running, len(running))
            seen = [f"{w.worker}:{labels[w.worker]}" for w in running]
            self.note_orders(labels, time.time())
            self.samples.append((time.time(), len(capacity), seen))
            if len(capacity) > self.max_seen:
                self.max_seen, self.max_at, self.at_max = len(capacity), time.time(), seen

    def note_orders(self, labels: dict[str, str], now: float) -> None:
        """Leaving a worker told to drain out of the count is sound only if it does drain: one
        whose reports still do not say so ``DRAIN_OBEYED_S`` later (a pause and a Redis pause
        are over by then) is a surplus the commander kept."""
        for worker, state in labels.items():
            if state.startswith("drain ordered"):
                since = self.ordered_at.setdefault(worker, now)
                if now - since > DRAIN_OBEYED_S:
                    self.ignored.add(worker)


def capacity_of(r: redis.Redis, running: list[WorkerInfo],
                drained: set[str]) -> tuple[list[WorkerInfo], dict[str, str]]:
    """The running workers that count as capacity, and each one's state as the sampler sees it:
    its latest report's, "drain sent" (by chaos: ``drained``), or "drain ordered" when its
    control stream holds a drain its reports do not show yet: a worker paused by SIGSTOP
    cannot report one until its SIGCONT, yet the commander counts it out (and replaces it)
    from the moment it sent it (seed 1: 7 'ready' against max_workers 6)."""
    states = latest_states(r)
    ordered = drain_ordered(r, [w.worker for w in running])
    labels, capacity = {}, []
    for w in running:
        state = states.get(w.worker, "no report")
        if w.worker in drained:
            state = "drain sent"
        elif w.worker in ordered and state != "draining":
            state = f"drain ordered (report: {state})"
        elif state != "draining":
            capacity.append(w)
        labels[w.worker] = state
    return capacity, labels


def drain_ordered(r: redis.Redis, worker_ids: list[str]) -> set[str]:
    """The workers whose control stream holds a drain (one pipelined XRANGE per worker)."""
    pipe = r.pipeline(transaction=False)
    for wid in worker_ids:
        pipe.xrange(keys.control(wid))
    out = set()
    for wid, rows in zip(worker_ids, pipe.execute(), strict=True):
        for _id, fields in rows:
            try:
                if decode(Control, fields.get(b"m", b""), max_bytes=4096).kind == "drain":
                    out.add(wid)
                    break
            except CodecError:
                continue
    return out


def _ledger_near(r: redis.Redis, when: float, before_s: float = 15.0, after_s: float = 5.0,
                 count: int | None = 500) -> list[str]:
    """The ledger entries around ``when`` (what the commanders did), oldest first."""
    out = []
    for _id, fields in reversed(r.xrevrange(keys.EVENTS, count=count)):
        try:
            event = decode(LedgerEvent, fields[b"m"])
        except (CodecError, KeyError):
            continue
        if when - before_s <= event.ts <= when + after_s:
            victims = f" {','.join(event.victims)}" if event.victims else ""
            out.append(f"{event.ts - when:+.1f}s {event.action}{victims} {event.reason[:160]}")
    return out


def latest_states(r: redis.Redis, count: int = 200) -> dict[str, str]:
    """Each worker's state in its latest report among the last ``count``."""
    states: dict[str, str] = {}
    for _id, fields in r.xrevrange(keys.REPORTS, count=count):
        try:
            report = decode(OccupancyReport, fields[b"m"])
        except (CodecError, KeyError):
            continue
        states.setdefault(report.worker, report.state)
    return states


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seconds = args.minutes * 60
    rng = random.Random(args.seed)
    if args.cluster:
        os.environ["FLEET_REDIS_CLUSTER"] = "yes"  # this process's clients too
    policy: TurnsPolicy = args.policy
    with tempfile.TemporaryDirectory(prefix="fleet-chaos-") as tmp:
        cluster = Cluster(home=Path(tmp), cluster=args.cluster)
        try:
            return _run(args, cluster, policy, seconds, rng)
        finally:
            cluster.stop()  # (done already on the way out; here if the run failed on its way)


def _run(args: Any, cluster: Cluster, policy: TurnsPolicy, seconds: float, rng: random.Random) -> int:
    if cluster.cluster:
        cluster.start_rig()
    else:
        cluster.start_redis()
    r = cluster.client()
    write_policy(r, "chat", policy)
    if args.streamed:
        write_policy(r, STREAM_TIER, STREAM_POLICY)
    cluster.start_commander()
    stop = threading.Event()
    faults = Faults(cluster, seconds, args.every, rng, TraceTail(cluster.trace), args.pause_s)
    faults.lag_s = args.lagging_replica
    sampler = Sampler(cluster, stop, faults.drained)
    injector = threading.Thread(target=faults.run, args=(stop, r), daemon=True)
    where = f"a 6-node Redis Cluster ({cluster.url} spared)" if cluster.cluster else "one redis-server"
    streamed = f" (+{args.streamed} streaming on tier {STREAM_TIER!r})" if args.streamed else ""
    print(f"chaos: {args.users} users{streamed} for {seconds:.0f} s on {where}, {len(faults.plan)} faults "
          f"planned every ~{faults.every:.1f} s", file=sys.stderr, flush=True)
    sampler.start()
    injector.start()
    progress = threading.Thread(target=_progress, args=(faults, stop, seconds), daemon=True)
    progress.start()
    grace = REPLY_GRACE_S if cluster.cluster else 300.0
    hostile = start_hostile(cluster, args.seed, seconds, stop) if args.hostile else None
    logs, load_ended = asyncio.run(run_load(cluster.role_url("fleet-client"), cluster.role_url(ADMIN),
                                            args.users, seconds, args.seed, grace, args.streamed))
    stop.set()
    injector.join(timeout=120)
    sampler.join(timeout=5)
    r = cluster.client()
    hostile_result = finish_hostile(r, hostile, faults) if hostile is not None else None
    detail: dict[str, list[Any]] = {}
    result, answers = chaos_check.check(r, logs, detail)
    if args.streamed:
        result["streams"] = chaos_check.check_streams(r, logs, detail)
    epochs_ok, epochs = chaos_check.check_epochs(r)
    ledger_near_max = _ledger_near(r, sampler.max_at) if sampler.max_seen > policy.max_workers else []
    ledger = _ledger_near(r, 0.0, before_s=0.0, after_s=float("inf"), count=None) if args.keep else []
    cluster.pids_seen.update(info.pid for info in live_workers(r))
    # what is left in the inbox of each user with a lost turn (a committed turn's entry is deleted)
    inboxes = {user: chaos_check.inbox_turns(r, user) for user, _t in detail.get("lost", [])}
    r.close()
    denials = cluster.acl_denials()
    cluster.note_commander_exit()
    cluster.stop()  # the workers drain: every handler still open writes its exit
    time.sleep(0.5)
    left = orphans(cluster)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    intervals, trace = chaos_check.read_trace(cluster.trace, faults.killed, time.time()) \
        if cluster.trace.exists() else ([], {})
    if args.keep:
        keep(cluster, args.keep, ledger, sampler, faults)
    result.update(chaos_check.check_exclusivity(intervals, answers, detail))
    result.update(chaos_check.waits(logs, faults.first or load_ended, load_ended))
    result.update({"takeover": chaos_check.takeovers(faults.injected, intervals, answers), "trace": trace,
                   "faults": dict(faults.count), "quota": faults.quota, "quota_missed": faults.missed(),
                   "fault_errors": faults.errors, "epochs": epochs,
                   "max_live_workers": sampler.max_seen, "max_workers": policy.max_workers,
                   "max_running_workers": sampler.max_running, "workers_at_max": sampler.at_max,
                   "ledger_near_max": ledger_near_max, "drains_ignored": sorted(sampler.ignored),
                   "faults_before_max": faults.before(sampler.max_at),
                   "orphans": len(left), "acl_denials": denials, "seconds": seconds, "users": args.users})
    result["invariants_failed"] = chaos_check.failures(result, epochs_ok)
    if hostile_result is not None:
        hostile_result = chaos_hostile.with_exits(hostile_result, cluster.commander_exits)
        result["hostile"] = hostile_result
        result["invariants_failed"] += [f"hostile: {f}" for f in hostile_result["failed"]]
    if cluster.cluster:
        split = chaos_check.failover_split(inboxes, logs, faults.master_kills, detail, epochs_ok)
        result.update({"cluster": True, "seed": args.seed, "failover": split,
                       "lagging_replica_s": faults.lag_s,
                       "replica_acks": getattr(policy, "replica_acks", "n/a (no such policy field)"),
                       "master_kills": [k._asdict() | {"promotion_s": k.promotion_s,
                                                       "healed_s": None if k.healed is None
                                                       else round(k.healed - k.t, 3),
                                                       **chaos_check.on_master(k, list(logs))}
                                        for k in faults.master_kills],
                       "failovers_in_pauses": faults.failovers_in_pauses,
                       "all_invariants_as_on_one_redis": result["invariants_failed"]})
        result["invariants_failed"], result["expected_across_failover"] = chaos_check.cluster_failures(
            result, split, epochs_ok)
    chaos_check.table(result)
    if "hostile" in result:
        chaos_hostile.table(result["hostile"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if result["invariants_failed"] or result["quota_missed"] else 0


def start_hostile(cluster: Cluster, seed: int, seconds: float,
                  stop: threading.Event) -> tuple[chaos_hostile.Injector, threading.Thread]:
    """Start writing the hostile injections of ``seed`` (admin client; turns as the client's role)."""
    mode = "yes" if cluster.cluster else "no"
    fleet = Fleet(client=connect_sync(cluster.role_url("fleet-client"), retries=12, cluster=mode))
    injector = chaos_hostile.Injector(chaos_hostile.plan(seed, seconds), cluster.client(), fleet)
    thread = threading.Thread(target=injector.run, args=(stop, time.monotonic()), daemon=True)
    print(f"chaos: --hostile, {len(injector.injections)} injections planned", file=sys.stderr, flush=True)
    thread.start()
    return injector, thread


def finish_hostile(r: redis.Redis, hostile: tuple[chaos_hostile.Injector, threading.Thread],
                   faults: Faults) -> dict[str, Any]:
    """Wait (``HOSTILE_GRACE_S`` at most) for every injection's answer, remove the bad state
    entries, and read the hostile section (the commander's own exits are added at the end)."""
    injector, thread = hostile
    thread.join(timeout=120)
    answers = chaos_hostile.wait_answered(
        lambda: chaos_hostile.outcomes(r, injector.done, injector.turns), HOSTILE_GRACE_S)
    chaos_hostile.clean_up(r)
    exits = chaos_hostile.worker_exits(chaos_hostile.ledger_events(r))
    injector.r.close()
    injector.fleet.close()
    return chaos_hostile.section(injector.injections, injector.done, answers,
                                 chaos_hostile.unexpected_exits(exits, faults.killed), injector.errors,
                                 exits_read=len(exits))


def keep(cluster: Cluster, dest: Path, ledger: list[str], sampler: Sampler, faults: Faults) -> None:
    """Copy the logs and the handler trace to ``dest``, with every sample and fault (unix times)."""
    shutil.copytree(cluster.home, dest, ignore=shutil.ignore_patterns("redis"), dirs_exist_ok=True)
    (dest / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sampler.samples))
    (dest / "faults.jsonl").write_text("".join(json.dumps([t, k, faults.victims.get(t)]) + "\n"
                                               for t, k in faults.timeline))
    (dest / "ledger.txt").write_text("".join(line + "\n" for line in ledger))


def _progress(faults: Faults, stop: threading.Event, seconds: float) -> None:
    start = time.monotonic()
    while not stop.wait(10):
        done = ", ".join(f"{k} {n}" for k, n in sorted(faults.count.items())) or "none yet"
        elapsed = time.monotonic() - start
        print(f"  {elapsed:5.0f}/{seconds:.0f} s  faults: {done}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
