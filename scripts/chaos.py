"""Chaos run: a fleet under steady load while workers, the commander and Redis fail at random.

Faults (loopback only, bounded in time, stops by itself): SIGKILL of a worker, a drain
racing a SIGKILL, SIGKILL of the commander (a new one is started), SIGKILL + restart of
redis-server (AOF with appendfsync always), SIGSTOP/SIGCONT pauses of redis-server. Then the
invariants of DESIGN §3 are checked from Redis and from the clients' own records:

  I1 every accepted turn has exactly one reply      I2 per user, sessions in submission order
  I3 each turn saw every earlier turn of its user   I4 one commander per epoch, epochs grow
  I5 nothing lost to scale-in (I1 under drains)     I6 no orphan process after shutdown; live
                                                       workers never above max_workers

Exit status 1 if any invariant fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import redis  # noqa: E402
from benchlib import ROOT, OneLineParser, free_port  # noqa: E402

from fleet.client import AsyncFleet  # noqa: E402
from protocol import keys  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402
from protocol.models import Control, LedgerEvent, Reply, SessionEntry, WorkerInfo  # noqa: E402
from protocol.policy import Policy  # noqa: E402
from stores.connection import connect_async  # noqa: E402
from stores.policies import write_policy  # noqa: E402
from stores.registry import read_registry  # noqa: E402

POLICY = Policy(handler="sleep", handler_options={"sleep_ms": 40}, concurrency=4, min_workers=2,
                max_workers=6, target_backlog_per_worker=4, users_per_instance=None, report_interval_s=0.5,
                scale_down_stabilization_s=5, drain_timeout_s=5, max_attempts=10)
WORKER_ENV = {"FLEET_WORKER_LANE_TTL_MS": "2000", "FLEET_WORKER_RENEW_INTERVAL_S": "0.4",
              "FLEET_WORKER_RECLAIM_IDLE_MS": "2000", "FLEET_WORKER_RECLAIM_INTERVAL_S": "0.5",
              "FLEET_WORKER_HOUSEKEEPING_INTERVAL_S": "2"}
SESSION_MAX, CONTEXT_TURNS = 200, 20  # the worker's defaults (WorkerSettings)
KINDS = ("worker-kill", "drain-kill", "commander-kill", "redis-restart", "redis-pause")


def parse_args(argv: list[str] | None = None):
    p = OneLineParser(prog="scripts/chaos", description=__doc__)
    p.add_argument("--minutes", type=float, default=5.0, help="length of the faulty period")
    p.add_argument("--quick", action="store_true", help="60 s, for the test suite")
    p.add_argument("--users", type=int, default=30)
    p.add_argument("--every", type=float, default=None, help="seconds between faults (default: fits quotas)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes = 1.0
    if args.minutes <= 0 or args.users < 1:
        p.error("--minutes and --users must be positive")
    return args


# --- the processes ----------------------------------------------------------------------------
@dataclass
class Cluster:
    """redis-server and commanders owned by the run, every pid remembered for the orphan check."""

    home: Path
    port: int = field(default_factory=free_port)
    redis_proc: subprocess.Popen[bytes] | None = None
    commander: subprocess.Popen[bytes] | None = None
    commanders_started: int = 0
    pids_seen: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start_redis(self) -> None:
        data = self.home / "redis"
        data.mkdir(parents=True, exist_ok=True)
        self.redis_proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not come back") from None
                time.sleep(0.05)

    def kill_redis(self) -> None:
        assert self.redis_proc is not None
        self.redis_proc.kill()
        self.redis_proc.wait()

    def start_commander(self) -> None:
        self.commanders_started += 1
        env = {**os.environ, **WORKER_ENV, "REDIS_URL": self.url, "PYTHONPATH": str(ROOT)}
        log = open(self.home / f"commander-{self.commanders_started}.log", "ab")  # noqa: SIM115
        self.commander = subprocess.Popen(
            [sys.executable, "-m", "commander", "--commander-id", f"chaos-{self.commanders_started}",
             "--no-metrics", "--log-dir", str(self.home / "logs"), "--stop-workers-on-exit"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.pids_seen.add(self.commander.pid)

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


def live_workers(r: redis.Redis) -> list[WorkerInfo]:
    return read_registry(r).live()


# --- faults -------------------------------------------------------------------------------------
class Faults:
    """Injects one fault at a time from a schedule that meets the quotas, then random ones."""

    QUOTA = {"worker-kill": 20, "drain-kill": 4, "commander-kill": 3, "redis-restart": 2, "redis-pause": 3}
    WEIGHTS = {"worker-kill": 6, "drain-kill": 2, "commander-kill": 1, "redis-restart": 1, "redis-pause": 1}

    def __init__(self, cluster: Cluster, seconds: float, every: float | None, rng: random.Random) -> None:
        self.cluster, self.rng = cluster, rng
        self.count: Counter[str] = Counter()
        self.errors: list[str] = []
        scale = min(1.0, seconds / 300)
        quota = [k for k, n in self.QUOTA.items() for _ in range(max(1, round(n * scale)))]
        rng.shuffle(quota)  # the quotas first, in random order, so a run always meets them
        # faults take time themselves (pauses, restarts): leave a fifth of the run for that
        self.every = every or max(1.5, 0.8 * (seconds - 10) / max(1, len(quota)))
        extra = max(0, int((seconds - 10) / self.every) - len(quota))
        self.plan = quota + rng.choices(list(self.WEIGHTS), weights=list(self.WEIGHTS.values()), k=extra)

    def run(self, stop: threading.Event, r: redis.Redis) -> None:
        stop.wait(5.0)  # let the fleet settle first
        for kind in self.plan:
            if stop.is_set():
                return
            try:
                getattr(self, kind.replace("-", "_"))(r)
                self.count[kind] += 1
            except Exception as exc:  # a fault that could not be injected is reported, not fatal
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            stop.wait(self.every * self.rng.uniform(0.6, 1.4))

    def _victim(self, r: redis.Redis) -> WorkerInfo | None:
        workers = live_workers(r)
        for w in workers:
            self.cluster.pids_seen.add(w.pid)
        return self.rng.choice(workers) if workers else None

    def worker_kill(self, r: redis.Redis) -> None:
        victim = self._victim(r)
        if victim is None:
            raise RuntimeError("no live worker to kill")
        os.kill(victim.pid, signal.SIGKILL)

    def drain_kill(self, r: redis.Redis) -> None:
        victim = self._victim(r)
        if victim is None:
            raise RuntimeError("no live worker to drain")
        body = encode(Control(kind="drain", ts=time.time(), reason="chaos"))
        r.xadd(keys.control(victim.worker), {"m": body})
        time.sleep(self.rng.uniform(0.0, 0.3))
        try:
            os.kill(victim.pid, signal.SIGKILL)
        except ProcessLookupError:  # the drain won the race: it is an outcome, not a failure
            self.count["drain finished before the kill"] += 1

    def commander_kill(self, r: redis.Redis) -> None:
        assert self.cluster.commander is not None
        self.cluster.commander.kill()
        self.cluster.commander.wait()
        time.sleep(self.rng.uniform(0.2, 1.5))
        self.cluster.start_commander()

    def redis_restart(self, r: redis.Redis) -> None:
        self.cluster.kill_redis()
        time.sleep(self.rng.uniform(0.3, 1.5))
        self.cluster.start_redis()

    def redis_pause(self, r: redis.Redis) -> None:
        assert self.cluster.redis_proc is not None
        self.cluster.redis_proc.send_signal(signal.SIGSTOP)
        time.sleep(self.rng.uniform(2.0, 4.0))
        self.cluster.redis_proc.send_signal(signal.SIGCONT)


# --- the load and its records ----------------------------------------------------------------
@dataclass
class UserLog:
    sent: list[str] = field(default_factory=list)  # turn ids in submission order (accepted)
    uncertain: set[str] = field(default_factory=set)  # a submit that failed: maybe accepted
    answered: dict[str, float] = field(default_factory=dict)  # turn id -> wait seconds
    errors: Counter[str] = field(default_factory=Counter)  # why submits failed


async def user_loop(fleet: AsyncFleet, user: str, log: UserLog, stop: asyncio.Event,
                    rng: random.Random) -> None:
    n = 0
    while not stop.is_set():
        batch = []
        for _ in range(rng.choice((1, 1, 2, 3))):  # several turns of one user in flight at once
            turn_id = f"{user}-{n}"
            n += 1
            log.sent.append(turn_id)
            t0 = time.monotonic()
            if await _submit(fleet, user, turn_id, rng.choice((10, 40, 120)), log):
                batch.append((turn_id, t0))
            else:
                log.uncertain.add(turn_id)
        for turn_id, t0 in batch:
            await _await_reply(fleet, user, turn_id, t0, log, stop)
        await asyncio.sleep(rng.uniform(0.0, 0.3))


async def _submit(fleet: AsyncFleet, user: str, turn_id: str, sleep_ms: int, log: UserLog) -> bool:
    """Submit, and on an error submit the same turn id again: a resubmitted turn is deduplicated
    by the workers (answered once), so a client can retry without fear of doubles."""
    for attempt in range(40):
        try:
            await fleet.submit(user, f"turn {turn_id}", turn_id=turn_id, meta={"sleep_ms": sleep_ms})
            return True
        except (redis.RedisError, OSError) as exc:
            log.errors[type(exc).__name__] += 1
            await asyncio.sleep(min(2.0, 0.05 * 2 ** attempt) * random.random())
    return False


async def _await_reply(fleet: AsyncFleet, user: str, turn_id: str, t0: float, log: UserLog,
                       stop: asyncio.Event) -> None:
    """Poll for the reply without consuming it: the checker counts the replies afterwards."""
    key = keys.reply(user, turn_id)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if await fleet.r.llen(key):
                log.answered[turn_id] = time.monotonic() - t0
                return
        except (redis.RedisError, OSError):
            pass
        await asyncio.sleep(0.05)


async def run_load(url: str, users: int, seconds: float, seed: int) -> dict[str, UserLog]:
    fleet = AsyncFleet(client=connect_async(url, retries=12))  # rides out a Redis restart
    logs = {f"c{i:03d}": UserLog() for i in range(users)}
    stop = asyncio.Event()
    rng = random.Random(seed)
    tasks = [asyncio.create_task(user_loop(fleet, u, log, stop, random.Random(rng.random())))
             for u, log in logs.items()]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait(tasks, timeout=240)
    await fleet.aclose()
    return logs


# --- the checks -------------------------------------------------------------------------------
def check(r: redis.Redis, logs: dict[str, UserLog]) -> dict[str, object]:
    submitted = sum(len(v.sent) - len(v.uncertain) for v in logs.values())
    lost, duplicated, out_of_order, unseen_context = [], [], [], []
    answered = 0
    for user, log in logs.items():
        session = [decode(SessionEntry, raw) for raw in r.lrange(keys.session(user), 0, -1)]
        ids = [e.turn_id for e in session]
        if len(ids) != len(set(ids)):
            duplicated += [t for t, c in Counter(ids).items() if c > 1]
        pipe = r.pipeline(transaction=False)
        for t in log.sent:
            pipe.lrange(keys.reply(user, t), 0, -1)
        replies_of = dict(zip(log.sent, pipe.execute(), strict=True))
        # what the user's history must be: every accepted turn, and a failed submit only if it
        # was accepted after all (it has a reply); the session keeps the newest SESSION_MAX
        expected = [t for t in log.sent if t not in log.uncertain or replies_of[t]]
        if ids != expected[-len(ids):] or len(ids) != min(len(expected), SESSION_MAX):
            out_of_order.append(user)
        for i, t in enumerate(expected):
            replies = replies_of[t]
            if not replies:
                lost.append(t)
                continue
            answered += 1
            if len(replies) > 1:
                duplicated.append(t)
            rep = decode(Reply, replies[0])
            # each turn saw every earlier one (its context pack holds the last CONTEXT_TURNS)
            if rep.ok and rep.context.get("session_turns") != min(i, CONTEXT_TURNS):
                unseen_context.append(t)
    waits = [w for log in logs.values() for w in log.answered.values()]
    return {"submitted": submitted, "answered": answered, "lost": len(lost), "duplicated": len(duplicated),
            "out_of_order_users": len(out_of_order), "context_gaps": len(unseen_context),
            "uncertain_submits": sum(len(v.uncertain) for v in logs.values()),
            "submit_errors": dict(sum((v.errors for v in logs.values()), Counter())),
            "longest_wait_s": round(max(waits, default=0.0), 2),
            "examples": {"lost": lost[:5], "duplicated": duplicated[:5], "out_of_order": out_of_order[:5],
                         "context_gaps": unseen_context[:5]}}


def check_epochs(r: redis.Redis) -> tuple[bool, str]:
    holders: dict[int, set[str]] = {}
    last = 0
    monotone = True
    for _id, fields in r.xrange(keys.EVENTS):
        ev = decode(LedgerEvent, fields[b"m"])
        holders.setdefault(ev.epoch, set()).add(ev.commander)
        monotone = monotone and ev.epoch >= last
        last = max(last, ev.epoch)
    shared = {e: c for e, c in holders.items() if len(c) > 1}
    ok = monotone and not shared
    return ok, f"{len(holders)} epochs, monotone={monotone}, shared={shared or 'none'}"


def orphans(cluster: Cluster) -> list[int]:
    mine = [p for p in psutil.process_iter(["pid", "cmdline"])
            if str(cluster.home) in " ".join(p.info["cmdline"] or [])
            or p.info["pid"] in cluster.pids_seen]
    return [p.pid for p in mine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


class Sampler(threading.Thread):
    """Samples the live worker count, to check it never exceeds max_workers (no double spawn)."""

    def __init__(self, cluster: Cluster, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.cluster, self.stop, self.max_seen = cluster, stop, 0

    def run(self) -> None:
        r = redis.Redis.from_url(self.cluster.url, socket_timeout=2, socket_connect_timeout=1)
        while not self.stop.wait(0.5):
            try:
                live = live_workers(r)
            except (redis.RedisError, OSError):
                continue
            self.cluster.pids_seen.update(w.pid for w in live)
            running = [w for w in live if psutil.pid_exists(w.pid)]
            self.max_seen = max(self.max_seen, len(running))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seconds = args.minutes * 60
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="fleet-chaos-") as tmp:
        cluster = Cluster(home=Path(tmp))
        cluster.start_redis()
        r = redis.Redis.from_url(cluster.url, socket_timeout=30)
        write_policy(r, "chat", POLICY)
        cluster.start_commander()
        stop = threading.Event()
        faults = Faults(cluster, seconds, args.every, rng)
        sampler = Sampler(cluster, stop)
        injector = threading.Thread(target=faults.run, args=(stop, r), daemon=True)
        print(f"chaos: {args.users} users for {seconds:.0f} s, {len(faults.plan)} faults planned "
              f"every ~{faults.every:.1f} s", file=sys.stderr, flush=True)
        sampler.start()
        injector.start()
        progress = threading.Thread(target=_progress, args=(faults, stop, seconds), daemon=True)
        progress.start()
        logs = asyncio.run(run_load(cluster.url, args.users, seconds, args.seed))
        stop.set()
        injector.join(timeout=30)
        sampler.join(timeout=5)
        r = redis.Redis.from_url(cluster.url, socket_timeout=30)
        result = check(r, logs)
        epochs_ok, epochs = check_epochs(r)
        cluster.pids_seen.update(info.pid for info in live_workers(r))
        cluster.stop()
        time.sleep(0.5)
        left = orphans(cluster)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    result.update({"faults": dict(faults.count), "fault_errors": faults.errors, "epochs": epochs,
                   "max_live_workers": sampler.max_seen, "max_workers": POLICY.max_workers,
                   "orphans": len(left), "seconds": seconds, "users": args.users})
    failures = _failures(result, epochs_ok)
    result["invariants_failed"] = failures
    _table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if failures else 0


def _progress(faults: Faults, stop: threading.Event, seconds: float) -> None:
    start = time.monotonic()
    while not stop.wait(10):
        done = ", ".join(f"{k} {n}" for k, n in sorted(faults.count.items())) or "none yet"
        elapsed = time.monotonic() - start
        print(f"  {elapsed:5.0f}/{seconds:.0f} s  faults: {done}", file=sys.stderr, flush=True)


def _failures(res: dict[str, object], epochs_ok: bool) -> list[str]:
    fails = []
    if res["lost"]:
        fails.append("I1/I5 lost turns")
    if res["duplicated"]:
        fails.append("I1 duplicated replies or session entries")
    if res["out_of_order_users"]:
        fails.append("I2 sessions out of submission order")
    if res["context_gaps"]:
        fails.append("I3 a turn did not see every earlier turn of its user")
    if not epochs_ok:
        fails.append("I4 two commanders in one epoch, or epochs going back")
    if res["orphans"]:
        fails.append("I6 orphan processes")
    if int(res["max_live_workers"]) > int(res["max_workers"]):  # type: ignore[call-overload]
        fails.append("I6 more live workers than max_workers (double spawn)")
    return fails


def _table(res: dict[str, object]) -> None:
    rows = [("turns submitted (accepted)", res["submitted"]), ("answered", res["answered"]),
            ("lost", res["lost"]), ("duplicated", res["duplicated"]),
            ("users out of order", res["out_of_order_users"]), ("context gaps (I3)", res["context_gaps"]),
            ("submits given up (maybe accepted)", res["uncertain_submits"]),
            ("submit errors retried with the same turn id", res["submit_errors"]),
            ("longest wait (s)", res["longest_wait_s"])]
    rows += [(f"faults: {k}", n) for k, n in sorted(dict(res["faults"]).items())]  # type: ignore[arg-type]
    rows += [("ledger epochs", res["epochs"]), ("max live workers / max_workers",
                                                f"{res['max_live_workers']} / {res['max_workers']}"),
             ("orphan processes after shutdown", res["orphans"])]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    fails = res["invariants_failed"]
    print("INVARIANTS: " + ("all hold" if not fails else "FAILED: " + "; ".join(fails)))  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
