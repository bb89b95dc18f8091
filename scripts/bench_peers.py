"""Fleet side by side with its peers: the same turn, the same redis-server, one run.

A turn pulls the user's context pack (session, profile, top-K memories) in one round trip,
runs a no-op model call, writes back session, memory, profile and usage atomically and
pushes the reply the submitter BLPOPs. Fleet runs it in its own workers (``noop`` handler);
RQ (``SimpleWorker`` and the forking ``Worker``), Celery (prefork pool), Dramatiq (its Redis
broker, 1 and 8 threads per process), SAQ and arq (asyncio, 64 jobs at a time per process;
arq polls every 5 ms, not its default 500) run ``scripts/peers/turn.py``. Every system gets 2
worker processes (Celery: one consumer with 2 pool processes), a flushed Redis and users
seeded with a full context pack.

Costs per turn, from the counters before and after the saturation phase: Redis commands
(``INFO commandstats``: commands inside Lua scripts count, each), round trips (``INFO stats``
``total_reads_processed``: one read per request or pipeline a client sends, about), of which
the submitting client's (its redis-py sends, counted in this process: submit and reply wait),
the rest the workers'; CPU of the worker processes, redis-server and this process (the
client). ``--runs N`` runs every system N times in turn and reports the median run with the
spread; ``--profile`` samples a Fleet worker with py-spy during the first saturation phase.

Per system: saturation (each user keeps one turn in flight, turns/s and submit->reply
p50/p99), then Poisson arrivals at half of *Fleet's* saturation rate (p50/p99; a peer whose
capacity is below that rate is reported as overloaded, not run into an unbounded queue).
Then Celery ``--autoscale``: bursts of turns that the current pool processes cannot absorb;
the reaction is from the submit of the first turn that finds no free process to the start
of the first turn served by a pool process started for the burst.

The load generator is asyncio; RQ's ``enqueue`` and Celery's ``delay`` are blocking, so they
run on a small thread pool. Replies are read the same way for every system (BLPOP on the
reply key). Everything is on loopback and stops by itself; every process is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# the repository root: scripts.peers (the RQ and Celery side of the benchmark) is not an
# installed package, and its workers name the job functions scripts.peers.*
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import redis  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from benchlib import (  # noqa: E402
    ROOT,
    MachineWatch,
    OneLineParser,
    emit,
    percentile,
    redis_server,
    stop_processes,
    worker_processes,
)

from fleet.client import AsyncFleet  # noqa: E402
from protocol import keys  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402
from protocol.models import Reply, SessionEntry  # noqa: E402
from protocol.policy import TurnsPolicy  # noqa: E402
from stores.connection import connect_async  # noqa: E402
from stores.memory import new_member  # noqa: E402
from stores.policies import write_policy  # noqa: E402

SYSTEMS = ("fleet", "rq-simple", "rq-fork", "celery", "dramatiq-1", "dramatiq-8", "saq", "arq")
SEED_TURNS, SEED_MEMORIES = 20, 20  # a full context pack from the first turn on
MAX_IN_FLIGHT = 5_000  # open loop: stop submitting past this (each waiting reply holds a connection)
SUBMIT_THREADS = 8
MAX_DRAIN_S = 120.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(prog="scripts/bench_peers", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2, help="worker processes per system")
    p.add_argument("--concurrency", type=int, default=64, help="Fleet's slots per worker")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    p.add_argument("--bursts", type=int, default=10, help="Celery --autoscale bursts")
    p.add_argument("--autoscale", default="4,2", help="Celery --autoscale MAX,MIN")
    p.add_argument("--burst-model-ms", type=float, default=500.0, help="model call of a burst turn")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated; fleet is required")
    p.add_argument("--quick", action="store_true", help="100 users, 3 s phases, 3 bursts (smoke test)")
    p.add_argument("--runs", type=int, default=1,
                   help="run every system this many times, in turn; report each system's median run "
                        "(by turns/s) and the spread over the runs")
    p.add_argument("--peer-slots", type=int, default=64, help="SAQ's and arq's jobs at a time per process")
    p.add_argument("--arq-poll-ms", type=float, default=5.0, help="arq's queue poll (its default: 500)")
    p.add_argument("--fleet-loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="the event loop of Fleet's workers (auto: uvloop if installed)")
    p.add_argument("--profile", type=Path,
                   help="py-spy a Fleet worker during the saturation phase of the first run; write "
                        "its top functions here (needs py-spy)")
    p.add_argument("--gc-probe", type=Path, metavar="DIR",
                   help="Fleet's workers write each garbage collection's CPU time, by generation, to "
                        "DIR/gc-<pid>.json (scripts/gc_probe); a summary is printed")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.users, args.seconds = min(args.users, 100), min(args.seconds, 3.0)
        args.bursts = min(args.bursts, 3)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if "fleet" not in args.systems or any(s not in SYSTEMS for s in args.systems):
        p.error(f"--systems takes some of {', '.join(SYSTEMS)}, fleet included")
    args.systems.sort(key=SYSTEMS.index)
    try:
        args.scale_max, args.scale_min = (int(x) for x in args.autoscale.split(","))
    except ValueError:
        p.error("--autoscale takes MAX,MIN")
    if min(args.users, args.workers, args.concurrency, args.scale_min, args.runs, args.peer_slots) < 1 \
            or args.seconds <= 0:
        p.error("--users, --workers, --concurrency, --runs, --peer-slots, --seconds and the autoscale MIN "
                "must be positive")
    if args.scale_max <= args.scale_min or args.bursts < 0:
        p.error("--autoscale MAX must be above MIN, --bursts not negative")
    return args


# --- the systems under test ------------------------------------------------------------------


def loadgen_client(url: str) -> aioredis.Redis:
    """No read timeout: a reply may take longer than redis-py's default 5 s socket timeout (>= 6.0).

    And a long connect timeout: a thousand users connect at once on a busy machine.
    """
    return aioredis.Redis.from_url(url, max_connections=10_000, socket_timeout=None,
                                   socket_connect_timeout=60)


class Driver:
    """Submits a turn to one system; the reply is read the same way for all (BLPOP)."""

    name = ""

    def __init__(self, url: str) -> None:
        self.url = url
        self.r = loadgen_client(url)
        self.pool = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix=f"submit-{self.name}")

    async def submit(self, user: str, turn_id: str, text: str) -> None:
        raise NotImplementedError

    def clients(self) -> list[aioredis.Redis]:
        """The asyncio clients every user's turn goes through at once (the reply wait's, and the
        submit's where the system's client is asyncio): each pool grows to a connection per user
        in flight. (A blocking client submits from the small thread pool: a few connections.)"""
        return [self.r]

    async def ask(self, user: str, text: str, timeout: float) -> float:
        """Submit, wait for the reply; returns submit->reply seconds (TimeoutError if none)."""
        turn_id = uuid.uuid4().hex
        t0 = time.perf_counter()
        await self.submit(user, turn_id, text)
        got = await self.r.blpop([keys.reply(user, turn_id)], timeout=max(timeout, 0.01))
        if got is None:
            raise TimeoutError(f"{self.name}: no reply to {turn_id} of {user} within {timeout:g}s")
        reply = decode(Reply, got[1])
        if not reply.ok:
            raise RuntimeError(f"{self.name}: error reply: {reply.error}")
        return time.perf_counter() - t0

    async def close(self) -> None:
        self.pool.shutdown(wait=True)
        await self.r.aclose()


class FleetDriver(Driver):
    name = "fleet"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        # the client Fleet's users get (its connection, its retries), as each peer's library is
        # measured as it comes; the harness's BLPOP of the reply stays on its own
        self.fleet = AsyncFleet(client=connect_async(url, cluster="no"))

    async def submit(self, user: str, turn_id: str, text: str) -> None:
        await self.fleet.submit(user, text, turn_id=turn_id)

    def clients(self) -> list[aioredis.Redis]:
        return [self.r, self.fleet.r]

    async def close(self) -> None:
        await self.fleet.aclose()
        await super().close()


class RQDriver(Driver):
    name = "rq"

    def __init__(self, url: str) -> None:
        from scripts.peers import rq_app

        super().__init__(url)
        self.rq_app = rq_app
        self.queue = rq_app.queue(redis.Redis.from_url(url))

    async def submit(self, user: str, turn_id: str, text: str) -> None:
        await asyncio.get_running_loop().run_in_executor(
            self.pool, self.rq_app.enqueue, self.queue, user, turn_id, text)


class CeleryDriver(Driver):
    name = "celery"

    def __init__(self, url: str) -> None:
        from scripts.peers import celery_app

        super().__init__(url)
        celery_app.use_broker(url)
        self.task = celery_app.turn

    async def submit(self, user: str, turn_id: str, text: str, model_ms: float = 0.0) -> None:
        await asyncio.get_running_loop().run_in_executor(
            self.pool, lambda: self.task.delay(user, turn_id, text, model_ms=model_ms))


class DramatiqDriver(Driver):
    name = "dramatiq"

    def __init__(self, url: str) -> None:
        from scripts.peers import dramatiq_app

        super().__init__(url)
        dramatiq_app.use_broker(url)
        self.app = dramatiq_app

    async def submit(self, user: str, turn_id: str, text: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, self.app.enqueue, user, turn_id, text)


class SaqDriver(Driver):
    name = "saq"

    def __init__(self, url: str) -> None:
        from scripts.peers import saq_app

        super().__init__(url)
        self.app = saq_app
        self.queue = saq_app.queue(url)

    async def submit(self, user: str, turn_id: str, text: str) -> None:
        await self.app.enqueue(self.queue, user, turn_id, text)

    def clients(self) -> list[aioredis.Redis]:
        return [self.r, self.queue.redis]

    async def close(self) -> None:
        await self.queue.disconnect()
        await super().close()


class ArqDriver(Driver):
    name = "arq"

    def __init__(self, url: str) -> None:
        from scripts.peers import arq_app

        super().__init__(url)
        self.app = arq_app
        self.pool_: object | None = None
        self._made = asyncio.Lock()  # (one pool, not one per user racing to make it)

    async def submit(self, user: str, turn_id: str, text: str) -> None:
        if self.pool_ is None:
            async with self._made:
                if self.pool_ is None:
                    self.pool_ = await self.app.pool(self.url)
        await self.app.enqueue(self.pool_, user, turn_id, text)

    def clients(self) -> list[aioredis.Redis]:
        return [self.r] if self.pool_ is None else [self.r, self.pool_]  # type: ignore[list-item]

    async def close(self) -> None:
        if self.pool_ is not None:
            await self.pool_.aclose()  # type: ignore[attr-defined]
        await super().close()


def _env(url: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "REDIS_URL": url, "PYTHONPATH": path, **extra}


@contextmanager
def processes(cmds: list[list[str]], env: dict[str, str], logs: list[Path]) -> Iterator[list[int]]:
    """Start ``cmds``; stop them and every descendant by pid afterwards (SIGTERM, then SIGKILL)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for cmd, log in zip(cmds, logs, strict=True):
            with log.open("wb") as out:
                procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
        yield [p.pid for p in procs]
    finally:
        stop_processes(procs)


@contextmanager
def start_system(name: str, url: str, args: argparse.Namespace, log_dir: Path,
                 autoscale: bool = False) -> Iterator[list[int]]:
    """The worker processes of ``name``; yields their pids (Celery: the main process)."""
    n = args.workers
    if name == "fleet":
        write_policy(redis.Redis.from_url(url), "chat",
                     TurnsPolicy(handler="noop", concurrency=args.concurrency))
        env = {"FLEET_WORKER_EVENT_LOOP": args.fleet_loop}
        if args.gc_probe is not None:  # scripts/gc_probe: each collection's CPU, by generation
            args.gc_probe.mkdir(parents=True, exist_ok=True)
            for stale in args.gc_probe.glob("gc-*.json"):  # an earlier run's workers
                stale.unlink()
            env |= {"FLEET_GC_PROBE_DIR": str(args.gc_probe.resolve()),
                    "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'scripts' / 'gc_probe'}"}
        with worker_processes(url, n, log_dir=log_dir, extra_env=env) as procs:
            yield [p.pid for p in procs]
        return
    py = sys.executable
    peer = _peer_commands(name, url, args, py)
    if peer is not None:
        with processes(peer, _env(url), [log_dir / f"{name}-{i}.log" for i in range(len(peer))]) as pids:
            yield pids
        return
    if name.startswith("rq-"):
        kind = name.removeprefix("rq-")
        cmds = [[py, "-m", "scripts.peers.rq_app", "--url", url, "--kind", kind, "--name", f"{name}-{i}"]
                for i in range(n)]
        with processes(cmds, _env(url), [log_dir / f"{name}-{i}.log" for i in range(n)]) as pids:
            yield pids
        return
    pool = ["--autoscale", f"{args.scale_max},{args.scale_min}"] if autoscale else ["--concurrency", str(n)]
    cmd = [py, "-m", "celery", "-A", "scripts.peers.celery_app", "worker", "--pool", "prefork", *pool,
           "--loglevel", "WARNING", "-n", f"{name}@bench"]
    # the autoscaler's keepalive is how long the pool stays grown (default 30 s): short, so that
    # every burst starts from MIN processes. Growing is on the arrival of a task, not this timer.
    env = _env(url, AUTOSCALE_KEEPALIVE="1") if autoscale else _env(url)
    with processes([cmd], env, [log_dir / f"{name}{'-autoscale' if autoscale else ''}.log"]) as pids:
        yield pids


def _peer_commands(name: str, url: str, args: argparse.Namespace, py: str) -> list[list[str]] | None:
    """The worker commands of Dramatiq, SAQ and arq (None for the others)."""
    n = args.workers
    if name.startswith("dramatiq-"):  # one supervisor forks the n worker processes
        return [[py, "-m", "dramatiq", "scripts.peers.dramatiq_app", "--processes", str(n),
                 "--threads", name.removeprefix("dramatiq-")]]
    if name == "saq":
        return [[py, "-m", "scripts.peers.saq_app", "--url", url, "--concurrency", str(args.peer_slots)]
                for _ in range(n)]
    if name == "arq":
        return [[py, "-m", "scripts.peers.arq_app", "--url", url, "--max-jobs", str(args.peer_slots),
                 "--poll-ms", str(args.arq_poll_ms)] for _ in range(n)]
    return None


def make_driver(name: str, url: str) -> Driver:
    if name == "fleet":
        return FleetDriver(url)
    if name.startswith("dramatiq-"):
        return DramatiqDriver(url)
    if name in ("saq", "arq"):
        return SaqDriver(url) if name == "saq" else ArqDriver(url)
    return RQDriver(url) if name.startswith("rq-") else CeleryDriver(url)


# --- state and costs -----------------------------------------------------------------------


def reset_and_seed(r: redis.Redis, users: list[str]) -> None:
    """An empty Redis, then every user with a full session tail, memories and a profile."""
    r.flushall()
    now = time.time()
    for start in range(0, len(users), 100):
        pipe = r.pipeline(transaction=False)
        for user in users[start:start + 100]:
            pipe.rpush(keys.session(user), *[
                encode(SessionEntry(turn_id=f"seed{i}", entry=f"0-{i + 1}", text=f"earlier turn {i}",
                                    reply=f"earlier reply {i}", ts=now - 3600 + i))
                for i in range(SEED_TURNS)])
            members = dict(new_member(f"remembered fact {i}", 0.1 + 0.04 * i, now - 3600 + i)
                           for i in range(SEED_MEMORIES))
            pipe.zadd(keys.memory(user), members)
            pipe.hset(keys.profile(user), mapping={"name": user, "lang": "en"})
        pipe.execute()


CLIENT_SENDS = [0]  # round trips this process (the submitting client) made: sends of redis-py


def count_client_round_trips() -> None:
    """Count every send of redis-py in this process (a pipeline is one send): the submitter's
    round trips, whichever system's client library sends them (RQ, Celery's kombu, Dramatiq,
    SAQ and arq all speak through redis-py)."""
    import redis.asyncio.connection as aconn
    import redis.connection as sconn

    real_sync = sconn.AbstractConnection.send_packed_command
    real_async = aconn.AbstractConnection.send_packed_command

    def sync_send(self: object, *args: object, **kwargs: object) -> object:
        CLIENT_SENDS[0] += 1
        return real_sync(self, *args, **kwargs)  # type: ignore[arg-type]

    async def async_send(self: object, *args: object, **kwargs: object) -> object:
        CLIENT_SENDS[0] += 1
        return await real_async(self, *args, **kwargs)  # type: ignore[arg-type]

    sconn.AbstractConnection.send_packed_command = sync_send  # type: ignore[method-assign,assignment]
    aconn.AbstractConnection.send_packed_command = async_send  # type: ignore[method-assign,assignment]


@dataclass
class Costs:
    """Counters read before and after a phase: Redis commands and CPU, worker and load CPU."""

    redis_calls: dict[str, tuple[int, int]]  # command -> (calls, usec), INFO commandstats
    redis_reads: int  # INFO stats total_reads_processed: ~ one per round trip a client makes
    client_sends: int  # this process's round trips (CLIENT_SENDS)
    redis_cpu: float
    worker_cpu: float
    load_cpu: float

    @classmethod
    def read(cls, r: redis.Redis, pids: list[int]) -> Costs:
        sends = CLIENT_SENDS[0]  # (before the INFO calls below)
        stats = r.info("commandstats")
        cpu = r.info("cpu")
        reads = int(r.info("stats")["total_reads_processed"])
        me = psutil.Process().cpu_times()
        return cls({k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()},
                   reads, sends,
                   float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
                   sum(_tree_cpu(pid) for pid in pids), me.user + me.system)

    def per_turn(self, after: Costs, turns: int) -> dict[str, object]:
        if turns <= 0:
            return {}
        calls = {k: n - self.redis_calls.get(k, (0, 0))[0] for k, (n, _) in after.redis_calls.items()}
        usec = {k: u - self.redis_calls.get(k, (0, 0))[1] for k, (_, u) in after.redis_calls.items()}
        top = sorted(((n, k) for k, n in calls.items() if n > 0), reverse=True)[:24]
        trips = (after.redis_reads - self.redis_reads) / turns
        client = (after.client_sends - self.client_sends) / turns
        worker_cpu, redis_cpu = after.worker_cpu - self.worker_cpu, after.redis_cpu - self.redis_cpu
        return {"redis_commands": round(sum(calls.values()) / turns, 1),
                "round_trips": round(trips, 1),  # every client's, as Redis counts reads
                "client_round_trips": round(client, 2),  # the submitter's: submit and reply wait
                "worker_round_trips": round(trips - client, 2),  # the rest: the workers' (and a broker's)
                "total_cpu_us": round((worker_cpu + redis_cpu + after.load_cpu - self.load_cpu) / turns * 1e6,
                                      1),
                "top_commands": {k: round(n / turns, 2) for n, k in top},
                # Redis's time inside each command, µs a turn (a script's own counts the commands
                # it calls too: fcall's figure includes theirs)
                "command_usec": {k: round(usec[k] / turns, 2) for _, k in top},
                "redis_cpu_us": round((after.redis_cpu - self.redis_cpu) / turns * 1e6, 1),
                "worker_cpu_us": round((after.worker_cpu - self.worker_cpu) / turns * 1e6, 1),
                "loadgen_cpu_us": round((after.load_cpu - self.load_cpu) / turns * 1e6, 1)}


def _tree_cpu(pid: int) -> float:
    """CPU seconds of a process, its reaped children and its live descendants."""
    try:
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for child in proc.children(recursive=True):
            try:
                c = child.cpu_times()
                total += c.user + c.system
            except psutil.NoSuchProcess:
                pass
        return total
    except psutil.NoSuchProcess:
        return 0.0


# --- the load ------------------------------------------------------------------------------


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)
    in_window: int = 0  # replies that arrived before the phase's end
    unanswered: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self, seconds: float, rate: float | None = None) -> dict[str, object]:
        lat = self.latencies + [float("inf")] * self.unanswered
        out: dict[str, object] = {"turns": len(self.latencies), "unanswered": self.unanswered,
                                  "p50_ms": _ms(percentile(lat, 50)), "p99_ms": _ms(percentile(lat, 99))}
        if rate is None:
            out["turns_per_s"] = round(self.in_window / seconds, 1)
        else:
            out["rate_per_s"] = round(rate, 1)
        if self.errors:
            out["errors"] = self.errors[:3]
        return out


def _ms(seconds: float) -> float | None:
    return None if seconds != seconds or seconds == float("inf") else round(seconds * 1000, 2)


async def _bounded(aws: list[Awaitable[None]], deadline: float) -> int:
    """Await ``aws`` until ``deadline`` (monotonic); returns how many were still waiting (cancelled)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return 0
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return len(pending)


async def saturation(drv: Driver, users: list[str], seconds: float, drain_s: float) -> Phase:
    """Closed loop: every user keeps one turn in flight for ``seconds``; then the turns in flight drain.

    The drain may take as long as the queue needs at the rate seen (a slow system with many
    users has a long queue), up to ``MAX_DRAIN_S``; what is still waiting then is unanswered.
    """
    ph = Phase()
    stop = time.monotonic() + seconds

    async def user_loop(user: str) -> None:
        i = 0
        while time.monotonic() < stop:
            try:
                ph.latencies.append(await drv.ask(user, f"turn {i} of {user}", timeout=MAX_DRAIN_S + seconds))
            except (TimeoutError, RuntimeError, redis.RedisError) as exc:
                ph.errors.append(str(exc))
                return
            ph.in_window += time.monotonic() <= stop
            i += 1

    tasks = [asyncio.ensure_future(user_loop(u)) for u in users]
    await asyncio.sleep(max(0.0, stop - time.monotonic()))
    in_flight = sum(not t.done() for t in tasks)
    drain = min(MAX_DRAIN_S, max(drain_s, 1.5 * in_flight / max(ph.in_window / seconds, 1.0)))
    ph.unanswered = await _bounded(tasks, time.monotonic() + drain)
    return ph


async def open_loop(drv: Driver, users: list[str], rate: float, seconds: float, drain_s: float) -> Phase:
    """Poisson arrivals at ``rate``/s on random users for ``seconds``."""
    ph = Phase()
    rng = random.Random(7)

    async def one(user: str, i: int) -> None:
        try:
            ph.latencies.append(await drv.ask(user, f"open {i}", timeout=seconds + drain_s))
            ph.in_window += 1
        except (TimeoutError, RuntimeError, redis.RedisError) as exc:
            ph.errors.append(str(exc))

    tasks: list[asyncio.Future[None]] = []
    start = time.perf_counter()
    next_at, i = start, 0
    while next_at - start < seconds:
        if i - len(ph.latencies) - len(ph.errors) > MAX_IN_FLIGHT:
            ph.errors.append(f"over {MAX_IN_FLIGHT} turns in flight: stopped submitting")
            break
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(rng.choice(users), i)))
        i += 1
        next_at += rng.expovariate(rate)
    ph.unanswered = await _bounded(tasks, time.monotonic() + drain_s)
    return ph


# --- one system, end to end ----------------------------------------------------------------

PROCESSES = {
    "fleet": "{n} worker processes x {c} asyncio slots",
    "rq-simple": "{n} SimpleWorker processes, 1 job at a time each",
    "rq-fork": "{n} Worker processes, a work horse forked per job",
    "celery": "1 consumer + {n} prefork pool processes",
    "dramatiq-1": "{n} worker processes x 1 thread (Redis broker)",
    "dramatiq-8": "{n} worker processes x 8 threads (Redis broker)",
    "saq": "{n} worker processes x {s} asyncio jobs",
    "arq": "{n} worker processes x {s} asyncio jobs, {p:g} ms poll",
}


WARM_UP_AT_ONCE = 200  # users warmed up together


async def warm_up(drv: Driver, users: list[str], n: int) -> None:
    """A few turns answered (the system is up), then one turn of every user, a few hundred at a
    time; then every connection the load generator keeps per user is made (:func:`fill_pools`),
    for every system alike, before the measurement."""
    try:
        await asyncio.gather(*(drv.ask(u, "warm up", timeout=60) for u in users[: 2 * n]))
        for start in range(0, len(users), WARM_UP_AT_ONCE):
            await asyncio.gather(*(drv.ask(u, "warm up", timeout=120)
                                   for u in users[start:start + WARM_UP_AT_ONCE]))
        await fill_pools(drv, len(users))
    except (TimeoutError, RuntimeError, redis.RedisError) as exc:
        raise RuntimeError(f"{drv.name} did not come up: {exc}") from None


async def fill_pools(drv: Driver, n: int) -> None:
    """Make each of ``drv``'s asyncio clients hold ``n`` connections, idle in its pool. A phase
    in which every user has a turn in flight at once uses as many; the warm-up's turns, a few
    hundred at a time, left a few hundred, and the rest were made inside the saturation window,
    where their set-up (five commands each: HELLO, CLIENT SETINFO, ...) counted as its turns'
    client round trips and CPU. (A pool that holds fewer, as SAQ's, is filled to its limit.)"""
    for client in drv.clients():
        pool = client.connection_pool
        held = [await pool.get_connection() for _ in range(min(n, pool.max_connections))]
        for conn in held:
            await pool.release(conn)


async def measure(name: str, url: str, pids: list[int], users: list[str], args: argparse.Namespace,
                  half_rate: float | None, profile: Path | None = None) -> dict[str, object]:
    """Saturation, then the open loop at ``half_rate`` (Fleet: at half its own capacity)."""
    r = redis.Redis.from_url(url)
    drv = make_driver(name, url)
    drain_s = max(10.0, args.seconds)
    try:
        await warm_up(drv, users, args.workers)
        # the load generator's own heap (every user's connections, the driver's client) out of
        # its collector's sight while it measures: a full collection of it stopped this process
        # for 60-190 ms (wall time, on the shared cores) every second or two, and every turn in
        # flight, whatever the system, waited
        gc.collect()
        gc.freeze()
        spy = start_profile(pids[0], args.seconds, profile) if profile is not None else None
        before = Costs.read(r, pids)
        sat = await saturation(drv, users, args.seconds, drain_s)
        costs = before.per_turn(Costs.read(r, pids), len(sat.latencies))
        if spy is not None:
            await asyncio.to_thread(finish_profile, spy, profile)  # type: ignore[arg-type]
        out: dict[str, object] = {"processes": PROCESSES[name].format(n=args.workers, c=args.concurrency,
                                                                      s=args.peer_slots, p=args.arq_poll_ms),
                                  "saturation": sat.summary(args.seconds), "cost_per_turn": costs}
        capacity = sat.in_window / args.seconds
        rate = capacity / 2 if half_rate is None else half_rate
        if capacity < rate or rate <= 0:  # (no turn in the window: more users than the window fits)
            out["half_load"] = {"rate_per_s": round(rate, 1), "overloaded": True,
                                "p50_ms": None, "p99_ms": None,
                                "note": f"capacity {capacity:,.0f}/s is below the rate: not run"}
        else:
            out["half_load"] = (await open_loop(drv, users, rate, args.seconds, drain_s)).summary(
                args.seconds, rate)
        return out
    finally:
        gc.unfreeze()  # (this system's objects collectable again once it is gone)
        await drv.close()
        r.close()


def start_profile(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """py-spy on a Fleet worker for the saturation phase: raw collapsed stacks."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", "250",
                             "--nonblocking", "--format", "raw", "--output", str(out.with_suffix(".raw"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def finish_profile(spy: subprocess.Popen[bytes], out: Path) -> None:
    """Wait for py-spy; write the worker's self time by package and its top functions to ``out``."""
    spy.wait(timeout=120)
    raw = out.with_suffix(".raw")
    if not raw.exists():
        out.write_text("py-spy wrote nothing (is it installed, may it trace the worker?)\n")
        return
    out.write_text(profile_summary(raw.read_text(errors="replace")))


PACKAGES = (("redis/", "redis-py"), ("hiredis", "redis-py"), ("asyncio/", "asyncio"),
            ("pydantic", "pydantic"),
            ("msgpack", "msgpack"), ("/stores/", "Fleet stores"), ("/worker/", "Fleet worker"),
            ("/protocol/", "Fleet protocol"), ("uvloop", "uvloop"))


def profile_summary(collapsed: str, top: int = 15) -> str:
    """Self time of py-spy's collapsed stacks: by package, then the top functions."""
    by_fn: dict[str, int] = {}
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = re.sub(r":\d+\)$", ")", stack.split(";")[-1])  # the function, whatever its line
        by_fn[leaf] = by_fn.get(leaf, 0) + int(count)
        total += int(count)
    if not total:
        return "no samples\n"
    by_pkg: dict[str, int] = {}
    for fn, n in by_fn.items():
        pkg = next((name for needle, name in PACKAGES if needle in fn), "other (idle, stdlib, C)")
        by_pkg[pkg] = by_pkg.get(pkg, 0) + n
    lines = [f"{total} samples; self time by package:"]
    lines += [f"  {100 * n / total:5.1f} %  {pkg}" for pkg, n in sorted(by_pkg.items(), key=lambda x: -x[1])]
    lines.append("top functions (self time):")
    ranked = sorted(by_fn.items(), key=lambda x: -x[1])[:top]
    lines += [f"  {100 * n / total:5.1f} %  {fn[:140]}" for fn, n in ranked]
    return "\n".join(lines) + "\n"


def pool_pids(main_pid: int, size: int, timeout: float) -> set[int]:
    """The pool processes of a Celery worker once there are exactly ``size`` of them."""
    deadline = time.monotonic() + timeout
    while True:
        pids = {c.pid for c in psutil.Process(main_pid).children()}
        if len(pids) == size:
            return pids
        if time.monotonic() > deadline:
            raise RuntimeError(f"celery pool has {len(pids)} processes, not {size}, after {timeout:g}s")
        time.sleep(0.05)


async def one_burst(drv: CeleryDriver, main_pid: int, args: argparse.Namespace, b: int) -> float | None:
    """Seconds from the first turn no current process can take to the first start in a new one."""
    before = await asyncio.to_thread(pool_pids, main_pid, args.scale_min, 60)
    turns = [(f"burst{b}-{i}", uuid.uuid4().hex) for i in range(2 * args.scale_max)]
    submitted = []
    for user, turn_id in turns:
        submitted.append(time.time())
        await drv.submit(user, turn_id, f"burst {b}", model_ms=args.burst_model_ms)
    replies = []
    for user, turn_id in turns:
        got = await drv.r.blpop([keys.reply(user, turn_id)], timeout=60)
        if got is None:
            raise RuntimeError(f"celery: burst {b}: no reply to {turn_id}")
        replies.append(decode(Reply, got[1]))
    first_unabsorbed = submitted[len(before)]
    starts = [rep.context["started"] for rep in replies if int(rep.worker.removeprefix("pid")) not in before]
    return min(starts) - first_unabsorbed if starts else None


async def celery_bursts(url: str, main_pid: int, users: list[str],
                        args: argparse.Namespace) -> dict[str, object]:
    drv = CeleryDriver(url)
    try:
        await warm_up(drv, users[: 2 * args.scale_min], args.scale_min)
        reactions, missed = [], 0
        for b in range(args.bursts):
            got = await one_burst(drv, main_pid, args, b)
            if got is None:
                missed += 1
            else:
                reactions.append(got)
            print(f"  autoscale burst {b + 1}/{args.bursts}: "
                  f"{'no new process served' if got is None else f'{got * 1000:.0f} ms'}", file=sys.stderr)
    finally:
        await drv.close()
    return {"autoscale": f"{args.scale_max},{args.scale_min}", "bursts": args.bursts,
            "burst_turns": 2 * args.scale_max, "burst_model_ms": args.burst_model_ms,
            "median_ms": _ms(percentile(reactions, 50)), "p95_ms": _ms(percentile(reactions, 95)),
            "reactions_ms": [round(x * 1000, 1) for x in reactions], "missed": missed}


# --- report --------------------------------------------------------------------------------


def ratios(fleet: dict, peer: dict) -> dict[str, float | None]:
    """Fleet / peer for turns/s (above 1: Fleet serves more) and latencies (below 1: Fleet is faster)."""

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a is not None and b else None

    fs, ps, fh, ph = fleet["saturation"], peer["saturation"], fleet["half_load"], peer["half_load"]
    return {"turns_per_s": div(fs["turns_per_s"], ps["turns_per_s"]),
            "saturation_p50": div(fs["p50_ms"], ps["p50_ms"]),
            "saturation_p99": div(fs["p99_ms"], ps["p99_ms"]),
            "half_load_p50": div(fh["p50_ms"], ph["p50_ms"]),
            "half_load_p99": div(fh["p99_ms"], ph["p99_ms"])}


def table(result: dict) -> str:
    def f(v: object) -> str:
        return "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)

    head = (f"{'system':<10} {'turns/s':>9} {'sat p50':>9} {'sat p99':>9} {'half p50':>9} {'half p99':>9} "
            f"{'cmds/turn':>9} {'rt/turn':>7} {'cpu us/t':>9}   "
            "Fleet/peer: turns/s  p50  p99  half p50  half p99")
    lines = [f"half load = {result['half_rate_per_s']:,} turns/s for every system "
             "(half of Fleet's saturation); latencies in ms; rt/turn = round trips (Redis's reads) per turn; "
             "cpu us/t = worker + redis-server + client CPU per turn"
             + (f"; the median of {result['runs']} runs" if result.get("runs", 1) > 1 else ""),
             head]
    for name, s in result["systems"].items():
        if "failed" in s:
            lines.append(f"{name:<10} failed: {s['failed']}")
            continue
        sat, half, cost = s["saturation"], s["half_load"], s["cost_per_turn"]
        ratio = "" if name == "fleet" else "   " + "  ".join(f(v) for v in s["ratios"].values())
        half_p50 = "overload" if half.get("overloaded") else f(half["p50_ms"])
        lines.append(f"{name:<10} {f(sat['turns_per_s']):>9} {f(sat['p50_ms']):>9} {f(sat['p99_ms']):>9} "
                     f"{half_p50:>9} {f(half['p99_ms']):>9} {f(cost.get('redis_commands')):>9} "
                     f"{f(cost.get('round_trips')):>7} {f(cost.get('total_cpu_us')):>9}{ratio}")
    auto = result.get("celery_autoscale")
    if auto:
        lines.append(f"celery --autoscale {auto['autoscale']}: scale-up reaction "
                     f"median {f(auto['median_ms'])} ms, p95 {f(auto['p95_ms'])} ms "
                     f"over {len(auto['reactions_ms'])} bursts"
                     f" ({auto['missed']} without a new process serving)")
    return "\n".join(lines)


def run(args: argparse.Namespace, url: str, log_dir: Path, watch: MachineWatch) -> dict[str, object]:
    r = redis.Redis.from_url(url)
    users = [f"u{i:05d}" for i in range(args.users)]
    by_run: list[dict[str, dict]] = []
    invalid: dict[int, list[str]] = {}  # run -> why the machine was not quiet during it
    for i in range(args.runs):
        before = len(watch.phases)
        by_run.append(one_run(args, url, log_dir, r, users, watch, i,
                              profile=args.profile if i == 0 else None))
        why = watch.invalid_because(watch.phases[before:])
        if why:
            invalid[i] = why
            print(f"bench_peers: run {i} is INVALID, left out of the figures: {'; '.join(why)}",
                  file=sys.stderr, flush=True)
    # the figures and ratios are the valid runs' (all runs', said so, if none was valid)
    kept = [run_ for i, run_ in enumerate(by_run) if i not in invalid] or by_run
    systems = {name: summarized([run_[name] for run_ in kept if "failed" not in run_[name]])
               if any("failed" not in run_[name] for run_ in kept) else kept[0][name]
               for name in args.systems}
    result: dict[str, object] = {
        "users": args.users, "workers": args.workers, "fleet_concurrency": args.concurrency,
        "phase_seconds": args.seconds, "cpus": os.cpu_count(), "runs": args.runs,
        "half_rate_per_s": systems["fleet"]["half_load"].get("rate_per_s"),
        "seeded": {"session_turns": SEED_TURNS, "memories": SEED_MEMORIES}, "systems": systems,
        "invalid_runs": {str(i): why for i, why in invalid.items()},
        "figures_from": "every run: none was valid" if len(invalid) == args.runs
        else f"{args.runs - len(invalid)} valid runs of {args.runs}"}
    if args.profile is not None and args.profile.exists():
        result["fleet_profile"] = args.profile.read_text()
    if "celery" in args.systems and args.bursts:
        print("bench_peers: celery --autoscale", file=sys.stderr, flush=True)
        reset_and_seed(r, users[:10])
        with start_system("celery", url, args, log_dir, autoscale=True) as pids:
            result["celery_autoscale"] = _logged(log_dir, celery_bursts(url, pids[0], users, args))
    r.close()
    return result


def one_run(args: argparse.Namespace, url: str, log_dir: Path, r: redis.Redis, users: list[str],
            watch: MachineWatch, index: int, profile: Path | None) -> dict[str, dict]:
    """Every system once, in turn; the peers' ratios against this run's Fleet."""
    systems: dict[str, dict] = {}
    half_rate: float | None = None
    for name in args.systems:
        print(f"bench_peers: {name}", file=sys.stderr, flush=True)
        reset_and_seed(r, users)
        try:
            with start_system(name, url, args, log_dir) as pids, watch.phase(f"run {index}: {name}"):
                systems[name] = _logged(log_dir, measure(name, url, pids, users, args, half_rate,
                                                         profile if name == "fleet" else None))
        except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, the run goes on
            if name == "fleet":
                raise
            print(f"bench_peers: {name} failed: {exc}", file=sys.stderr, flush=True)
            systems[name] = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
        if name == "fleet":
            half_rate = systems["fleet"]["half_load"]["rate_per_s"]
            logs = sorted(log_dir.glob("worker-*.log"))  # each worker's batches, said on its exit
            systems["fleet"]["group_commit"] = [line.split(": ", 1)[1] for log in logs
                                                for line in log.read_text(errors="replace").splitlines()
                                                if "group commit:" in line]
    for name, sys_ in systems.items():
        if name != "fleet" and "failed" not in sys_:
            sys_["ratios"] = ratios(systems["fleet"], sys_)
    return systems


def summarized(runs: list[dict]) -> dict:
    """A system over its runs: the median run (by saturation turns/s) with each run's figures and
    the spread (min, max) of the main ones."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["saturation"]["turns_per_s"])
    out = dict(runs[order[len(order) // 2]])

    def spread(get: Callable[[dict], float | None]) -> list[float | None]:
        values = [v for v in (get(x) for x in runs) if v is not None]
        return [min(values), max(values)] if values else [None, None]

    out["spread"] = {
        "turns_per_s": spread(lambda x: x["saturation"]["turns_per_s"]),
        "half_load_p50_ms": spread(lambda x: x["half_load"].get("p50_ms")),
        "half_load_p99_ms": spread(lambda x: x["half_load"].get("p99_ms")),
        "total_cpu_us": spread(lambda x: x["cost_per_turn"].get("total_cpu_us")),
    }
    out["runs"] = [{"turns_per_s": x["saturation"]["turns_per_s"],
                    "half_load_p50_ms": x["half_load"].get("p50_ms"),
                    "half_load_p99_ms": x["half_load"].get("p99_ms"), "cost_per_turn": x["cost_per_turn"],
                    **({"ratios": x["ratios"]} if "ratios" in x else {})} for x in runs]
    return out


def _logged(log_dir: Path, coro: Coroutine[None, None, dict]) -> dict:
    """Run ``coro``; on failure show the tails of the worker logs first."""
    try:
        return asyncio.run(coro)
    except Exception:
        for log in sorted(log_dir.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}", file=sys.stderr)
        raise


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    count_client_round_trips()
    # SIGTERM unwinds like Ctrl-C: every context manager stops its processes by pid
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"bench_peers: {', '.join(args.systems)}; {args.workers} worker processes each, "
          f"{args.users} users, {args.seconds:g} s per phase, {os.cpu_count()} CPUs shared by everything",
          file=sys.stderr)
    watch = MachineWatch()
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp, redis_server() as url:
        result = run(args, url, Path(tmp), watch)
    if args.gc_probe is not None:
        result["fleet_gc"] = gc_summary(args.gc_probe)
        print(f"Fleet's workers' garbage collections (CPU ms): {result['fleet_gc']}", file=sys.stderr)
    print(table(result))
    emit(result, args.json, watch)
    return 0


def gc_summary(probe_dir: Path) -> dict[str, dict[str, float]]:
    """Each generation's collections over the workers that wrote ``probe_dir/gc-*.json``: how
    many a worker, and their CPU milliseconds (total a worker, median, max)."""
    files = sorted(probe_dir.glob("gc-*.json"))
    took: dict[str, list[float]] = {"0": [], "1": [], "2": []}
    for path in files:
        for gen, ms in json.loads(path.read_text()).items():
            took[gen] += ms
    out = {}
    for gen, ms in took.items():
        ms.sort()
        if ms:
            out[f"gen{gen}"] = {"per_worker": round(len(ms) / len(files), 1),
                                "ms_per_worker": round(sum(ms) / len(files), 1),
                                "median_ms": ms[len(ms) // 2], "max_ms": ms[-1]}
    return out


if __name__ == "__main__":
    sys.exit(main())
