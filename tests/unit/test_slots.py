"""Every multi-key operation the stores send stays in one Redis Cluster slot.

(a) Each Lua script's ``KEYS`` header names keys of one slot, for sample user, tier and
    worker ids, and the real call sites pass as many keys as the header names.
(b) Every command, pipeline and transaction the stores send is recorded at the client level
    (redis-py's ``execute_command`` and pipeline ``execute``, blocking and asyncio) while
    ``drive`` runs every public function of ``stores`` against fakeredis; then:
    - a transaction (``transaction=True``, or an explicit ``MULTI`` .. ``EXEC``) has all its
      keys in one slot;
    - a multi-key command (``MGET``, ``DEL``/``EXISTS`` of several keys, ``XREAD`` of several
      streams, a script call's ``KEYS``) has all its keys in one slot;
    - in Cluster mode (``stores.cluster.is_cluster`` forced true, so the Cluster paths run) no
      pipeline holds a command redis-py's ``ClusterPipeline`` refuses (``MGET``,
      a multi-key ``DEL``, ...).
    Coverage: every public function and method of every ``stores`` module must have issued a
    command during ``drive`` or be listed in ``NO_COMMANDS`` (with why): a new stores function
    fails here until it is driven. A command name the recorder does not know fails too, so a
    new multi-key command cannot pass as a single-key one.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import pkgutil
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.client as aclient
import redis.client as sclient
from redis.cluster import PIPELINE_BLOCKED_COMMANDS
from redis.crc import key_slot

import stores
from protocol import keys
from protocol.codec import encode
from protocol.models import (
    CommanderInfo,
    Control,
    Counters,
    LedgerEvent,
    OccupancyReport,
    Slots,
    Turn,
    WorkerInfo,
)
from protocol.policy import TurnsPolicy
from stores import (
    backlog,
    cancel,
    cluster,
    commanders,
    control,
    deadletters,
    decide_state,
    erase,
    group_assignment,
    jobctx,
    leader_lease,
    ledger,
    outbox,
    policies,
    registry,
    renotify,
    reports,
    roundtrips,
    submit,
    submit_options,
    takeover,
    tier_exists,
    users,
    worker_ops,
)
from stores.functions import NAMES, Functions, function_name, source
from stores.turns import Flush, Lease, StoreConfig, StreamTail, UserStore, Writes

STORES_DIR = Path(stores.__file__).resolve().parent
USERS = ("alice", "bob.7", "c+d@x")
TIERS = ("chat", "gpu")
WORKERS = ("chat-w1", "chat-w2", "gpu-w3")
SOLO = "solo-w9"  # the one worker of a tier without a policy

# --- (a) the Lua scripts' KEYS headers -------------------------------------------------------
_KEY_LINE = re.compile(r"^--\s+KEYS\[(\d+)\]\s+(.*)$")


def header_keys(name: str) -> list[str]:
    """The key pattern of each ``KEYS[i]`` line (the first token that looks like a key)."""
    out = []
    for line in source(name).splitlines():
        m = _KEY_LINE.match(line)
        if m:
            assert int(m.group(1)) == len(out) + 1, f"{name}: KEYS lines out of order"
            token = next((t.rstrip(",") for t in m.group(2).split() if "fleet" in t), m.group(2))
            out.append(token)
    return out


def instantiate(pattern: str, user: str, tier: str) -> str:
    return pattern.replace("{U}", f"{{{user}}}").replace("{T}", f"{{{tier}}}")


# Scripts that take a variable number of keys (their header names KEYS[1] and then ranges) and
# span slots on purpose: single-node only, with the reason; the Cluster path never calls them.
SINGLE_NODE_SCRIPTS = {
    "turn_submit": "the single-node submit in one atomic call: each turn's inbox (its user's slot) and "
                   "notification (the tier's slot), then the active set; on a Cluster the submit is "
                   "ordered instead (stores/submit.py submit_ordered: inbox acknowledged, then notification)",
}


# Scripts that take a variable number of keys of one slot (their header names KEYS[1] as any of them).
VARIABLE_KEYS_SCRIPTS = {
    "user_delete": "every key of one user (a SCAN finds the reply lists): all in the user's slot",
}


@pytest.mark.parametrize("name", NAMES)
def test_script_header_keys_share_one_slot(name: str) -> None:
    patterns = header_keys(name)
    assert patterns, f"{name}.lua has no KEYS header"
    if name in SINGLE_NODE_SCRIPTS:
        assert "SINGLE NODE ONLY" in source(name), f"{name}.lua must say it is single-node only"
        return
    for user in USERS:
        for tier in TIERS:
            built = [instantiate(p, user, tier) for p in patterns]
            assert len({key_slot(k.encode()) for k in built}) == 1, (name, built)


# --- (b) the recorder --------------------------------------------------------------------------
MULTI_KEY = {"DEL", "UNLINK", "EXISTS", "MGET", "TOUCH", "WATCH"}  # every argument is a key
SCRIPT_CALLS = {"FCALL", "FCALL_RO"}
STREAM_READS = {"XREAD", "XREADGROUP"}  # keys: the first half after STREAMS
BLOCKING_POPS = {"BLPOP", "BRPOP"}  # keys: all but the timeout
KEYLESS = {"MULTI", "EXEC", "DISCARD", "UNWATCH", "FUNCTION LOAD", "SCAN", "PING",
           "INFO", "TIME"}
SINGLE_KEY = {  # key = args[1]; each name here was checked to take one key
    "GET", "SET", "SETNX", "PSETEX", "INCR", "INCRBY", "EXPIRE", "PEXPIRE", "PTTL", "TTL", "TYPE",
    "HSET", "HGET", "HGETALL", "HMGET", "HDEL", "HEXISTS", "HINCRBY", "HLEN", "HKEYS",
    "SADD", "SREM", "SMEMBERS", "SISMEMBER", "SCARD",
    "ZADD", "ZSCAN", "ZREM", "ZCOUNT", "ZCARD", "ZSCORE", "ZRANGE", "ZREVRANGE", "ZREMRANGEBYSCORE",
    "ZREMRANGEBYRANK",
    "LPUSH", "RPUSH", "LPOP", "LRANGE", "LLEN", "LTRIM",
    "XADD", "XRANGE", "XREVRANGE", "XLEN", "XTRIM", "XDEL", "XACK", "XCLAIM", "XAUTOCLAIM",
    "XPENDING", "XGROUP CREATE", "XGROUP DESTROY", "XGROUP DELCONSUMER", "XGROUP CREATECONSUMER",
    "XGROUP SETID", "XINFO GROUPS", "XINFO CONSUMERS", "XINFO STREAM",
}


def _name(args: tuple[Any, ...]) -> str:
    head = args[0]
    return (head.decode() if isinstance(head, bytes) else str(head)).upper()


def command_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The keys of one command, or None if the recorder does not know the command."""
    name = _name(args)
    if name in KEYLESS:
        return []
    if name in MULTI_KEY:
        return list(args[1:])
    if name in SCRIPT_CALLS:
        return list(args[3:3 + int(args[2])])
    if name in STREAM_READS:
        rest = [a.decode() if isinstance(a, bytes) else a for a in args]
        at = next(i for i, a in enumerate(rest) if isinstance(a, str) and a.upper() == "STREAMS")
        names = args[at + 1:]
        return list(names[: len(names) // 2])
    if name in BLOCKING_POPS:
        return list(args[1:-1])
    if name in SINGLE_KEY:
        return [args[1]]
    return None


def slot(key: Any) -> int:
    return key_slot(key if isinstance(key, bytes) else str(key).encode())


@dataclass
class Group:
    """What went to Redis together: one command, a pipeline, or a transaction."""

    kind: str  # "command" | "pipeline" | "transaction"
    commands: list[tuple[Any, ...]]
    callers: frozenset[str]  # stores functions on the stack ("module.qualname")


@dataclass
class Recorder:
    groups: list[Group] = field(default_factory=list)
    callers: set[str] = field(default_factory=set)
    sha_to_name: dict[str, str] = field(default_factory=dict)

    def stack(self) -> frozenset[str]:
        """The stores functions on the call stack, and the operations a runner on it is running
        (``stores.roundtrips``: an operation's generator is suspended while its round trip goes
        out, so it is read from the runner's ``op``, down its ``yield from`` chain). An asyncio
        task started by ``gather`` shows only its own frames: such a group is still checked,
        only not attributed."""
        out = set()
        frame = sys._getframe(2)
        while frame is not None:
            path = Path(frame.f_code.co_filename)
            if path.parent == STORES_DIR:
                out.add(f"stores.{path.stem}.{frame.f_code.co_qualname}")
            if frame.f_code in (roundtrips.run.__code__, roundtrips.arun.__code__):
                op = frame.f_locals.get("op")
                while inspect.isgenerator(op):
                    out.add(f"stores.{Path(op.gi_code.co_filename).stem}.{op.gi_code.co_qualname}")
                    op = op.gi_yieldfrom
            frame = frame.f_back  # type: ignore[assignment]
        self.callers |= out
        return frozenset(out)

    def pipeline(self, pipe: Any) -> None:
        cmds = [tuple(args) for args, _options in pipe.command_stack]
        # the asyncio pipeline keeps the flag as ``is_transaction`` (its ``transaction`` is a method)
        atomic = pipe.is_transaction if isinstance(pipe, aclient.Pipeline) else pipe.transaction
        self.groups.append(Group("transaction" if atomic else "pipeline", cmds, self.stack()))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    for name in NAMES:
        rec.sha_to_name[function_name(name)] = name

    s_exec, s_queue, s_pexec = sclient.Redis.execute_command, sclient.Pipeline.pipeline_execute_command, \
        sclient.Pipeline.execute
    a_exec, a_queue, a_pexec = aclient.Redis.execute_command, aclient.Pipeline.pipeline_execute_command, \
        aclient.Pipeline.execute

    def sync_exec(self: Any, *args: Any, **options: Any) -> Any:
        rec.groups.append(Group("command", [args], rec.stack()))
        return s_exec(self, *args, **options)

    def sync_queue(self: Any, *args: Any, **options: Any) -> Any:
        rec.stack()
        return s_queue(self, *args, **options)

    def sync_pexec(self: Any, *args: Any, **kw: Any) -> Any:
        rec.pipeline(self)
        return s_pexec(self, *args, **kw)

    async def async_exec(self: Any, *args: Any, **options: Any) -> Any:
        rec.groups.append(Group("command", [args], rec.stack()))
        return await a_exec(self, *args, **options)

    def async_queue(self: Any, *args: Any, **options: Any) -> Any:
        rec.stack()
        return a_queue(self, *args, **options)

    async def async_pexec(self: Any, *args: Any, **kw: Any) -> Any:
        rec.pipeline(self)
        return await a_pexec(self, *args, **kw)

    monkeypatch.setattr(sclient.Redis, "execute_command", sync_exec)
    monkeypatch.setattr(sclient.Pipeline, "pipeline_execute_command", sync_queue)
    monkeypatch.setattr(sclient.Pipeline, "execute", sync_pexec)
    monkeypatch.setattr(aclient.Redis, "execute_command", async_exec)
    monkeypatch.setattr(aclient.Pipeline, "pipeline_execute_command", async_queue)
    monkeypatch.setattr(aclient.Pipeline, "execute", async_pexec)
    return rec


def force_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every stores module take its Cluster path (however it imported ``is_cluster``)."""
    monkeypatch.setattr(cluster, "is_cluster", lambda r: True)
    for mod in store_modules():
        if getattr(mod, "is_cluster", None) is not None and mod is not cluster:
            monkeypatch.setattr(mod, "is_cluster", lambda r: True)


# --- the drive: every stores function that talks to Redis, with data that reaches its branches -
def worker_info(wid: str) -> WorkerInfo:
    return WorkerInfo(worker=wid, tier=wid.split("-")[0], pid=1, host="h", started=1.0, handlers=["echo"])


def report(wid: str) -> OccupancyReport:
    return OccupancyReport(worker=wid, tier="chat", ts=3.0, state="ready", users=1, active_users=1,
                           slots=Slots(busy=1, total=4), rss=1, counters=Counters(), load=(0.0, 0.0, 0.0))


def turn(user: str, tier: str, n: int) -> tuple[Turn, bytes]:
    t = Turn(turn_id=f"t-{user.replace('@', '_').replace('+', '_')}-{n}", user=user, tier=tier,
             text="hi", ts=time.time())
    return t, encode(t)


def drive_sync(r: redis.Redis) -> None:
    now = time.time()
    for tier in TIERS:
        policies.ensure_policy(r, tier)
        policies.write_policy(r, tier, TurnsPolicy())
        policies.read_policy(r, tier, ["echo"], record=True, reader="w")
        r.set(keys.policy(tier), b"{not json")
        policies.read_policy(r, tier, ["echo"], record=True, reader="w")  # status write branch
        policies.write_policy(r, tier, TurnsPolicy())
        policies.read_policy_status(r, tier)
        submit_options.read_submit_options(r, tier)
        policies.has_policy_key(r, tier)
        policies.read_good_policy(r, tier)
    policies.ensure_policy(r, "gpu")
    policies.list_tiers(r)
    policies.has_rq_tier(r)
    # submit (the client's side)
    for tier in TIERS:
        built = [turn(u, tier, i) for i, u in enumerate(USERS)]
        submit.submit_turns(r, built, tier, pressure={"tier": tier, "user": USERS[-1]},
                            cluster=cluster.is_cluster(r))
        tier_exists.read_tier_probe(r, tier)
        submit.post_pressure(r, tier, {"user": USERS[0]})
    r.hset(keys.WORKERS, mapping={w: encode(worker_info(w)) for w in (*WORKERS, SOLO)})
    for w in (*WORKERS, SOLO):
        r.set(keys.heartbeat(w), "1", px=60_000)
    tier_exists.tier_exists(r, "solo")  # no policy: its workers' heartbeats are read
    r.rpush(keys.reply(USERS[0], "t-x"), b"r")
    submit.wait_reply(r, USERS[0], "t-x", 0.01)
    submit.read_stream(r, USERS[0], "t-x", "0-0", 1)
    submit.read_stream_rest(r, USERS[0], "t-x", "0-0")
    if not cluster.is_cluster(r):  # (the client's stream hub: one node only)
        submit.read_streams(r, {keys.stream(u, "t-x"): "0-0" for u in USERS[:2]}, 1)
    # registry
    registry.read_entries(r)
    registry.read_registry(r)
    known = registry.Known(time.monotonic)
    registry.read_registry(r, known=known)  # whole: Known.keep
    registry.read_registry(r, known=known)  # Known.stands: the version alone
    registry.registered_and_beating(r, list(WORKERS))
    registry.heartbeat_alive(r, WORKERS[0])
    # backlog
    backlog.write_starting(r, dict.fromkeys(TIERS, 2), 5_000)
    for tier in TIERS:
        backlog.active_users(r, tier, now - 60)
    backlog.read_backlog(r, TIERS, set(WORKERS))
    backlog.read_tier_load(r, TIERS, set(WORKERS), 1000, dict.fromkeys(TIERS, now - 60))
    # commanders, leader, ledger
    info = CommanderInfo(commander="c1", pid=1, host="h", started=1.0, seen=1.0)
    commanders.register_commander(r, info)
    commanders.commander_entries(r)
    commanders.read_commanders(r)
    commanders.forget_commanders(r, now)
    commanders.register_commander(r, info)
    commanders.deregister_commander(r, "c1")
    lease = leader_lease.LeaderLease(r)
    epoch = lease.acquire("c1", 5_000)
    holder = f"c1|{epoch}"
    lease.renew(holder, 5_000)
    leader_lease.lease_holder(r)
    leader_lease.lease_ttl_ms(r)
    book = ledger.Ledger(r)
    book.append(holder, LedgerEvent(ts=now, tier="chat", epoch=epoch or 0, commander="c1", action="hold"))
    ledger.ledger_page(r, "+", 10)
    ledger.ledger_tip(r)
    ledger.ledger_after(r, "0-0", 10, 0)
    ledger.read_events(r, "chat", 10)
    ledger.events_since(r, now - 60, "chat")
    lease.drop(holder)
    # control, dead letters, decide state, reports
    control.send_control(r, WORKERS[0], Control(kind="drain", ts=now), 10)
    for tier in TIERS:
        deadletters.dead_letter_count(r, tier)
        deadletters.newest_dead_letters(r, tier, 5)
        decide_state.read_decide_state(r, tier)
    decide_state.write_decide_states(r, dict.fromkeys(TIERS, {"a": 1}), 60)
    r.xadd(keys.REPORTS, {"m": encode(report(WORKERS[0]))})
    reports.reports_after(r, "0-0", 10)
    reports.newest_reports(r, 10)
    after = {tier: "0-0" for tier in TIERS}
    for tier in TIERS:
        reports.last_pressure_id(r, tier)
    reports.wait_pressure(r, after, 10, 10)  # events are there: no wait
    reports.wait_pressure(r, {tier: reports.last_pressure_id(r, tier) for tier in TIERS}, 10, 10)
    reports.wait_pressure(r, {"chat": "0-0"}, 10, 10)
    # the relay's reads and writes of the outboxes
    outbox.join_relay_group(r)
    outbox.join_relay_group(r)  # (the group exists: kept)
    for user in USERS:
        r.xadd(keys.outbox(user), {"job": "j-0", "d": b"x"})
        r.xadd(keys.OUTBOX_READY, {"user": user})
        r.zadd(keys.active("chat"), {user: now})
    hints = outbox.read_hints(r, "relay-1", 10, 1)
    outbox.claim_idle_hints(r, "relay-2", 0, "0-0", 10)
    outbox.hint_backlog(r)
    list(outbox.users_with_entries(r, outbox.registered_tiers(r)))
    for user in USERS:
        entries = outbox.read_outbox(r, user, 10)
        outbox.outbox_length(r, user)
        outbox.dead_letter(r, user, entries[0], "x", now)
        outbox.delete_entries(r, user, [e.id for e in entries])
    outbox.ack_hints(r, [h.id for h in hints])
    outbox.beat_relay(r, "relay-1", now)
    outbox.relay_beats(r)
    outbox.forget_relays(r, ["relay-1"])
    outbox.forget_relays(r, [])
    registry.rq_registered(r, WORKERS)
    registry.rq_entries(r)
    # what a deferred job reads and writes of its user
    for user in USERS:
        jobctx.pull(r, user)
        jobctx.pull(r, user, 0, 0)
        jobctx.incr_usage(r, user, "jobs_run")
        jobctx.add_memory(r, user, "summary", 0.5, count="summaries")


async def drive_async(ar: aioredis.Redis, r: redis.Redis) -> None:
    cfg = StoreConfig(lane_ttl_ms=60_000)
    for tier in TIERS:
        await worker_ops.join_ready_group(ar, tier)
        await worker_ops.join_ready_group(ar, tier)  # BUSYGROUP branch
        await policies.read_policy(ar, tier, ["echo"], record=True, reader="w")
        await policies.write_policy(ar, tier, TurnsPolicy())
        await policies.tier_defined_async(ar, tier)
        built = [turn(u, tier, 10 + i) for i, u in enumerate(USERS)]
        await submit.submit_turns(ar, built, tier, pressure={"tier": tier, "user": USERS[0]},
                                  cluster=cluster.is_cluster(ar))
        await tier_exists.read_tier_probe(ar, tier)
        await submit.post_pressure(ar, tier, {"user": USERS[0]})
    await tier_exists.tier_exists(ar, "solo")
    await ar.rpush(keys.reply(USERS[0], "t-y"), b"r")
    await submit.wait_reply(ar, USERS[0], "t-y", 0.01)
    for wid in WORKERS:
        await worker_ops.register_worker(ar, worker_info(wid), 60_000)
    await reports.post_report_async(ar, report(WORKERS[0]), 100)
    await control.read_control_async(ar, WORKERS[0], "0-0", 10, 0)
    scripts = Functions(ar)
    tier, wid, other = "chat", WORKERS[0], WORKERS[1]
    got = await worker_ops.read_ready(ar, tier, wid, 100, 0)
    nids = [nid for nid, _f in got]
    # a tier of 3 ready shards: notifications on each, read, reclaimed, acked per shard
    shards = await worker_ops.more_shards(ar, "gpu", 3, 1)
    await submit.submit_turns(ar, [turn(u, "gpu", 40 + i) for i, u in enumerate(USERS)], "gpu",
                              submit_options.SubmitOptions(shards=3), cluster=cluster.is_cluster(ar))
    await submit_options.read_submit_options(ar, "gpu")
    sharded = [nid for nid, _f in await worker_ops.read_ready(ar, "gpu", wid, 100, 0, shards, 1)]
    for k in range(shards):
        await worker_ops.reclaim_idle(ar, "gpu", wid, 0, "0-0", 10, shard=k)
    await worker_ops.touch_and_beat(ar, scripts, "gpu", wid, sharded, 60_000)
    await worker_ops.ack_covered(scripts, "gpu", other, wid, USERS[0], sharded)
    await worker_ops.ack_notifications(scripts, "gpu", wid, sharded)
    await worker_ops.notify_ready(ar, "gpu", USERS[1], 3)
    await worker_ops.trim_ready(ar, "gpu", 60.0, shards)
    await worker_ops.reclaim_idle(ar, tier, other, 0, "0-0", 1)  # one of w1's moves to w2
    store = UserStore(ar, wid, cfg)
    leases: list[Lease] = []
    for user in USERS:
        res = await store.acquire(user)
        assert isinstance(res, Lease)
        leases.append(res)
        entries = await store.read_inbox(user, "", 10)
        entry = entries[0][0]
        await store.pull(user, "t-1", entry)
        await store.uncount(user, entry, res)
        await store.append_streams([Flush(res, "t-1", 1, "chunk")])
        await store.commit(res, entry, "t-1", Writes(turn_id="t-1", session_entry=b"s", reply=b"r",
                                                      profile={"k": "v"}, memories=[(b"m", 1.0)],
                                                      usage={"turns": 1}, deferrals=[("j-0", b"d")],
                                                      stream=StreamTail(1, "rest")),
                           int(time.time() * 1000))
    # a tick's flushes of several users' streams: one call on one node, one each on a Cluster
    await store.append_streams([Flush(lease, "t-2", 1, "more") for lease in leases])
    await store.acquire("nobody")  # nothing waits: the lane is not taken
    await store.renew(leases)
    await worker_ops.touch_and_beat(ar, scripts, tier, wid, nids, 60_000)
    await worker_ops.touch_and_beat(ar, scripts, tier, wid, [], 60_000)
    await UserStore(ar, other, cfg).acquire(USERS[0])  # busy
    await worker_ops.ack_covered(scripts, tier, other, wid, USERS[0], nids[:1])
    await store.drop(leases[1])
    await worker_ops.ack_notifications(scripts, tier, wid, nids[:2])
    await worker_ops.notify_ready(ar, tier, USERS[0])
    await deadletters.dead_letter_async(ar, tier, user=USERS[0], entry="1-0", turn_id="t-1", reason="x",
                                        worker=wid, fields={b"text": b"hi"})
    await worker_ops.trim_ready(ar, tier, 60.0)
    # the operator's view of a user and the population, retry and purge
    for user in USERS:
        users.inspect_user(r, user, tiers=list(TIERS), session_n=5)
    users.active_users(r, tier)
    deadletters.dead_letter_rows(r, tier, 10, USERS[0])
    deadletters.dead_letter_kinds(r, tier)
    await deadletters.dead_letter_async(ar, tier, user=USERS[1], entry="2-0", turn_id="t-2", reason="x",
                                        worker=wid, fields={b"text": b"hi", b"tier": b"gpu"})
    retried = deadletters.retry_dead_letters(r, tier, None)  # a turn of chat and one of gpu
    assert sorted(d.tier for d in retried if d.outcome == "retried") == ["chat", "gpu"], retried
    deadletters.retry_dead_letters(r, tier, ["1-1"])
    r.xadd(keys.dead(tier), {"user": USERS[0], "reason": "old"})
    deadletters.purge_dead_letters(r, tier, ["1-1"])
    deadletters.purge_dead_letters(r, tier, None)
    # the commander's takeover of a dead worker (w1 still holds pending notifications, a lane)
    await worker_ops.deregister_worker(ar, tier, wid)  # pending: its consumer stays
    await worker_ops.deregister_worker(ar, "gpu", WORKERS[2])  # nothing pending: consumer dropped
    takeover.consumers(r, tier)
    takeover.sweep(r, tier, live={other})
    takeover.take_over(r, tier, other)
    # the recovery after a failover: users with a turn after the cursor get a fresh notification
    renotify.write_recovered(r, 7)
    renotify.read_recovered(r)
    await submit.submit_turns(ar, [turn(USERS[0], tier, 90)], tier, cluster=cluster.is_cluster(ar))
    # a cancel: its record (the user's slot), then the lane's holder told (the worker's slot)
    r.set(keys.lane(USERS[0]), f"{WORKERS[0]}|7")
    cursor = r.hget(keys.state(USERS[0]), "cursor")
    (_entry, fields), = r.xrange(keys.inbox(USERS[0]), min=f"({cursor.decode()}" if cursor else "-", count=1)
    assert cancel.cancel_turn(r, USERS[0], fields[b"turn_id"].decode()).worker == WORKERS[0]
    await cancel.cancel_turn(ar, USERS[1], "no-such-turn")
    renotify.unserved_users(r, list(USERS))
    renotify.renotify_unserved(r, tier, shards=3, batch=1)
    registry.forget_workers(r, list(WORKERS))
    erase.delete_user(r, USERS[0], "op@host", "fleet-operator", time.time())  # a user with data in every key
    Functions(r)
    await drive_groups(r, ar)


async def drive_groups(r: redis.Redis, ar: aioredis.Redis) -> None:
    """Pins and rejected groups (stores.group_assignment), and a group's pool on the data plane."""
    group_assignment.pin_group(r, USERS[0], "chat", "green")
    group_assignment.user_pins(r, USERS[0])
    _, _, raw = await group_assignment.read_pin_and_record(ar, USERS[0], "chat")
    await group_assignment.record_group(ar, USERS[0], "chat", raw, ("green", 1))
    group_assignment.unpin_group(r, USERS[0], "chat")
    group_assignment.reject_group(r, "chat", "green", "no interpreter")
    group_assignment.rejected_groups(r, "chat")
    await group_assignment.rejected_groups(ar, "chat")
    group_assignment.accept_group(r, "chat", "green")
    group_assignment.with_group_pools(r, ["chat"])
    group_assignment.read_pool_policy(r, "chat.green")
    group_assignment.read_pins(r, list(USERS), "chat")
    group_assignment.remember_pools(r, "chat", ["chat.blue", "chat.green"])
    group_assignment.known_pools(r, "chat")
    group_assignment.forget_pool(r, "chat", "chat.green")
    # a removed pool's queued users moved to their group's pool (commander.groups._move_users)
    for batch in renotify.active_users(r, "chat", batch=2):
        renotify.unserved_newest(r, batch)
    renotify.active_since(r, "chat", 0.0)
    renotify.notify_on(r, {USERS[0]: ("chat.blue", 0), USERS[1]: ("chat.blue", 0)}, 1.0)
    await submit.submit_turns(ar, [turn(USERS[1], "chat", 91)], "chat.green", cluster=cluster.is_cluster(ar))


def drive(r: redis.Redis, ar: aioredis.Redis) -> None:
    drive_sync(r)
    asyncio.run(drive_async(ar, r))


# --- coverage: what the drive must reach --------------------------------------------------------
NOT_DRIVEN = {  # public callables of stores that send no command (or are not this test's to drive)
    "stores.roles": "the ACL roles' passwords and URLs: no Redis command",
    "stores.turns.Flush": "a value",
    "stores.backlog.unserved_after_ms": "arithmetic",
    "stores.group_assignment.record_field": "a field's name",
    "stores.policies.with_epoch": "a policy's epoch from the key read by write_policy",
    "stores.redis_errors": "names an error's kind, logs and counts: no command",
    "stores.backlog.unserved_by_tier": "arithmetic over a Registry",
    "stores.backlog.TierBacklog": "a value",
    "stores.registry.RqEntry": "a value",
    "stores.registry.Known.keep": "keeps a whole read's entries: no command",
    "stores.registry.raise_unless_bumped": "parses replies",
    "stores.registry.Known.registry": "builds a Registry: no command",
    "stores.backlog.tier_backlog": "parses replies",
    "stores.backlog.workers_group": "parses replies",
    "stores.backlog.no_free_slot": "parses replies",
    "stores.backlog.parse_backlog": "parses replies",
    "stores.backlog.live_ids": "a set of ids",
    "stores.cluster.is_cluster": "an isinstance test",
    "stores.erase.Erased": "a value",
    "stores.turns.StreamTail": "a value",
    "stores.users.TurnInProgress": "a value",
    "stores.cancel.Cancel": "a value",
    "stores.cancel.CancelRefused": "an exception",
    "stores.bad_state.BadEntry.as_json": "a value",
    "stores.bad_state.BadState.note": "logs and counts a bad entry",
    "stores.bad_state.shown": "formats a value",
    "stores.bad_state.wrong_type": "reads an error",
    "stores.bad_state.readable": "reads a reply",
    "stores.bad_state.reject_wrong_type": "reads an error",
    "stores.deadletters.entry_bytes": "arithmetic",
    "stores.deadletters.trim_call": "builds a command (dead_letter_async sends it)",
    "stores.erase.who": "the OS user and host",
    "stores.erase.connection_user": "reads the client's connection settings",
    "stores.renotify.cluster_epoch": "CLUSTER INFO, a Cluster only: tests/cluster/test_failover_recovery",
    "stores.renotify.unserved": "compares stream ids",
    "stores.renotify.Renotified": "a value",
    "stores.ledger.CorruptEvent": "a value",
    "stores.ledger.parse_entry": "decodes an entry",
    "stores.ledger.tier_matches": "compares a field",
    "stores.ledger.event_json": "an entry as plain data",
    "stores.local_fleet": "files under the fleet home, no Redis",
    "stores.memory": "ranking arithmetic, no Redis",
    "stores.replies": "reply casts, no Redis",
    "stores.functions.source": "reads a file",
    "stores.functions.resolve": "assembles text",
    "stores.functions.digest": "hashes text",
    "stores.functions.library": "assembles text",
    "stores.functions.function_name": "names a function",
    "stores.functions.command": "names a command",
    "stores.functions.is_missing": "reads a reply",
    "stores.functions.state_of": "compares versions",
    "stores.functions.waiting_line": "a line of text",
    "stores.functions.missing_line": "a line of text",
    "stores.functions.LibraryMissing": "an error",
    "stores.functions.library_state": "FCALL_RO of a keyless function (any node)",
    "stores.functions.wait_for_library": "library_state, again until it is ok",
    "stores.functions.interrupt_waits": "sets an event",
    "stores.functions.wait_for_library_async": "library_state, again until it is ok",
    "stores.functions.resend_missing": "sends what its caller gives it (driven through UserStore)",
    "stores.batch.ScriptBatcher.call": "queues a call: its pipeline is sent by a task of its own, which "
                                       "the recorder sees unattributed (driven through UserStore, acks)",
    "stores.batch.BatchStats": "counters",
    "stores.turns.UserStore.acquire": "its lane_acquire call goes through the group commit (one node and "
                                      "Cluster): the recorder sees it unattributed, and checks it",
    "stores.submit.inbox_fields": "names fields",
    "stores.submit.submit_call": "names a command",
    "stores.submit.pressure_call": "names a command",
    "stores.turns.NextTurn": "a value",
    "stores.turns.Idle": "a value",
    "stores.turns.Committed": "a value",
    "stores.functions.Functions": "binds functions (no command until called: the calls are driven)",
    "stores.functions.Function": "one call (the calls are driven)",
    "stores.replicas.ReplicaWait": "a value (its keyless WAIT rides with the writes: test_replica_wait)",
    "stores.replicas.ReplicaAcks": "counters",
    "stores.replicas.by_node": "groups keys by master (no command)",
    "stores.replicas.fewest": "arithmetic",
    "stores.replicas.on_node": "a Cluster's per-master pipelines (fakeredis has none): test_replica_wait, "
                               "tests/cluster",
    "stores.replicas.OnNodes": "as on_node",
    "stores.roundtrips": "sends the round trips of the other modules' operations: none of its own",
    "stores.connection": "builds clients: no data commands",
    "stores.retry": "retry policy: no commands of its own",
    "stores.submit.committed": "parses replies",
    "stores.tier_exists.tier_defined": "parses replies",
    "stores.tier_exists.heartbeats_of": "parses replies",
    "stores.submit_options.SubmitOptions": "a value",
    "stores.submit_options.submit_options_of": "parses replies",
    "stores.submit_options.split_by_pool": "arithmetic",
    "stores.group_assignment.pool_policy": "arithmetic over a PolicyRead",
    "stores.submit.Submitted": "a value",
    "stores.submit.inbox_command": "names a command",
    "stores.submit.notify_commands": "names commands",
    "stores.submit.SubmitNotNotified": "an exception",
    "stores.submit.inbox_written": "parses replies",
    "stores.submit.notified": "parses replies",
    "stores.submit_options.ready_shards_of": "parses replies",
    "stores.worker_ops.nid_of": "names a notification",
    "stores.worker_ops.split_nid": "reads a notification's name",
    "stores.worker_ops.by_shard": "groups names",
    "stores.backlog.summed": "arithmetic",
    "stores.policies.PolicyRead": "a value",
    "stores.registry.Registry": "a value",
    "stores.ledger.NotLeading": "an exception",
    "stores.takeover.Takeover": "a value",
    "stores.turns.Fenced": "an exception",
    "stores.turns.UserDataError": "an exception",
    "stores.turns.WrongType": "a value",
    "stores.turns.StoreConfig": "a value",
    "stores.turns.Lease": "a value",
    "stores.turns.Busy": "a value",
    "stores.turns.ContextPack": "a value",
    "stores.turns.Pulled": "a value",
    "stores.turns.Writes": "a value",
    "stores.registry.Registry.live": "filters a Registry",
    "stores.deadletters.dead_letter_fields": "builds an entry",
    "stores.deadletters.DeadLetterRow": "a value",
    "stores.deadletters.parse_dead_letter": "parses replies",
    "stores.deadletters.validate_dead_letter_id": "checks an id",
    "stores.deadletters.retry_turn_id": "names a turn",
    "stores.deadletters.retry_turn": "builds a turn from an entry",
    "stores.deadletters.Retried": "a value",
    "stores.users.UserView": "a value",
    "stores.users.UserUsage": "a value",
    "stores.users.lane_parts": "parses a reply",
    "stores.users.counters": "parses a reply",
    "stores.outbox.Hint": "a value",
    "stores.outbox.Entry": "a value",
    "stores.rqview": "reads RQ's own keys through stores.rqjobs (see it)",
    "stores.rqjobs": "RQ's own keys (rq:job:<id>, rq:queue:<q>, its registries: no hash tags, written "
                     "together by RQ's scripts and transactions): RQ needs one Redis node (--rq-url); "
                     "driven by tests/unit/test_relay.py and tests/integration/test_defer_rq.py",
}

# Known exceptions: (stores function on the stack, span kind) -> why it may span slots. They
# hold on ONE node only, where each is deliberate and the Cluster path avoids it; each must
# still be observed in the single-node run (a fixed one must leave the list).
SINGLE_NODE_EXCEPTIONS = {
    ("stores.submit.submit_one_node", "command"):
        "the single-node submit: one turn_submit.lua call over the users' inboxes and the tier's ready "
        "stream and active set (user slots + tier slot), atomic by design on one node; on a Cluster "
        "the submit is ordered instead (inbox acknowledged, then notification): stores/submit.py's "
        "Cluster path (SINGLE_NODE_SCRIPTS)",
    ("stores.worker_ops.read_ready", "command"):
        "the single-node worker blocks on every ready shard of its tier in one XREADGROUP (shard k "
        "has its own slot, so that a Cluster spreads the tier); on a Cluster it reads each shard "
        "on its own (stores/worker_ops.py read_ready)",
    ("stores.registry.read_registry", "command"):
        "the single-node commander reads a thousand workers' heartbeats with one MGET (each "
        "heartbeat is in its worker's slot); on a Cluster it sends one EXISTS each "
        "(stores/registry.py read_registry)",
    ("script:stream_append", "command"):
        "the single-node worker writes every stream it flushes in a tick with one stream_append.lua "
        "call, through the group commit (each flush's lane and stream in its user's slot); on a "
        "Cluster one call per flush (stores/turns.py append_streams)",
    ("stores.backlog.existing_shards", "command"):
        "the single-node commander counts a tier's 63 possible higher ready shards with one EXISTS "
        "(each shard in its own slot), then asks shard by shard only where some exist; on a Cluster "
        "one EXISTS per shard (stores/backlog.py existing_shards)",
    ("stores.submit.read_streams", "command"):
        "the single-node client reads every reply stream it streams in one XREAD (each stream in "
        "its user's slot; fleet/stream_hub.py); on a Cluster each stream reads on its own "
        "(stores/submit.py read_stream)",
    ("stores.reports.wait_pressure", "command"):
        "the single-node commander blocks on every tier's pressure stream in one XREAD (it wakes "
        "at the first event); on a Cluster it blocks on one tier or polls each stream on its own "
        "(checked by the Cluster run and test_cluster_pressure_wait_wakes_on_an_event)",
}
# On a Cluster nothing is exempt: the submit is ordered there (stores.submit.submit_ordered).
CLUSTER_EXCEPTIONS: dict[tuple[str, str], str] = {}


def store_modules() -> list[Any]:
    return [importlib.import_module(f"stores.{m.name}") for m in pkgutil.iter_modules([str(STORES_DIR)])]


def public_callables() -> Iterator[tuple[str, str]]:
    """(qualified name, module name) of every public function, class and method in stores."""
    for mod in store_modules():
        for name, obj in vars(mod).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isfunction(obj) or isinstance(obj, roundtrips.operation):
                yield f"{mod.__name__}.{name}", mod.__name__
            elif inspect.isclass(obj):
                methods = [m for m, f in vars(obj).items() if inspect.isfunction(f) and not m.startswith("_")]
                if not methods:
                    yield f"{mod.__name__}.{name}", mod.__name__
                for m in methods:
                    yield f"{mod.__name__}.{name}.{m}", mod.__name__


def listed(qual: str, module: str) -> bool:
    return qual in NOT_DRIVEN or module in NOT_DRIVEN or qual.rsplit(".", 1)[0] in NOT_DRIVEN


@dataclass
class Finding:
    group: Group
    problem: str

    def __str__(self) -> str:
        return f"{self.problem}: {sorted(self.group.callers)} {self.group.commands}"


def exception_for(group: Group, kind: str, table: dict[tuple[str, str], str]) -> tuple[str, str] | None:
    """The listed exception for this group: its kind, and a caller named by (or starting with,
    for the ``_async`` twin) the listed function."""
    return next((k for k in table if k[1] == kind and any(c.startswith(k[0]) for c in group.callers)), None)


def _script_exception(args: Any, table: dict[tuple[str, str], str]) -> str | None:
    """``script:<op>`` if ``args`` calls a script listed by name in ``table``."""
    if _name(args) not in SCRIPT_CALLS:
        return None
    fn = args[1].decode() if isinstance(args[1], bytes) else str(args[1])
    return next((k[0] for k in table if k[0].startswith("script:")
                 and fn.startswith(f"fleet_{k[0].removeprefix('script:')}_")), None)


BLOCKED_IN_PIPELINE = {c.upper() for c in PIPELINE_BLOCKED_COMMANDS}  # (FCALL is routed by its keys)


def refused_in_cluster_pipeline(g: Group, name: str, ks: list[Any],
                                allowed: dict[tuple[str, str], str]) -> list[Finding]:
    if name in BLOCKED_IN_PIPELINE or (name in {"DEL", "UNLINK"} and len(ks) > 1):
        return [Finding(g, f"{name} in a pipeline: redis-py's ClusterPipeline refuses it")]
    if name == "MULTI" and exception_for(g, "transaction", allowed) is None:
        return [Finding(g, "explicit MULTI in a pipeline: a ClusterPipeline cannot route it")]
    return []


def check(rec: Recorder, *, cluster_mode: bool) -> tuple[list[Finding], set[tuple[str, str]]]:
    """Every group's findings (cross-slot spans; in Cluster mode, what a ClusterPipeline
    refuses), and which listed exceptions were met. The test's own setup is checked too."""
    findings, used = [], set()
    allowed = CLUSTER_EXCEPTIONS if cluster_mode else SINGLE_NODE_EXCEPTIONS
    for g in rec.groups:
        spans: list[tuple[str, list[Any]]] = []  # (kind, keys)
        in_multi: list[Any] | None = None
        for args in g.commands:
            ks = command_keys(args)
            name = _name(args)
            if ks is None:
                findings.append(Finding(g, f"unknown command {name!r} (classify it in test_slots)"))
                continue
            if cluster_mode and g.kind != "command":
                findings += refused_in_cluster_pipeline(g, name, ks, allowed)
            if name == "MULTI":
                in_multi = []
            elif name == "EXEC" and in_multi is not None:
                spans.append(("transaction", in_multi))
                in_multi = None
            else:
                if in_multi is not None:
                    in_multi += ks
                spans.append((_script_exception(args, allowed) or "command", ks))
        if g.kind == "transaction":
            spans.append(("transaction", [k for args in g.commands for k in (command_keys(args) or [])]))
        findings += _cross_slot(g, spans, allowed, used)
    return findings, used


def _cross_slot(g: Group, spans: list[tuple[str, list[Any]]], allowed: dict[tuple[str, str], str],
                used: set[tuple[str, str]]) -> list[Finding]:
    """The spans of ``g`` over several slots that no listed exception allows (``used`` gets
    the exceptions that did)."""
    findings = []
    for kind, span in spans:
        if len({slot(k) for k in span}) <= 1:
            continue
        if kind.startswith("script:"):  # a script call listed by name (its caller is the batcher)
            used.add((kind, "command"))
            continue
        exc = exception_for(g, kind, allowed)
        if exc is not None:
            used.add(exc)
            continue
        findings.append(Finding(g, f"cross-slot {kind} {span}"))
    return findings


@pytest.fixture
def clients() -> Iterator[tuple[redis.Redis, aioredis.Redis]]:
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server)
    ar = fakeredis.FakeAsyncRedis(server=server)
    yield r, ar
    r.close()


@pytest.mark.parametrize("cluster_mode", [False, True], ids=["single-node", "cluster"])
def test_every_stores_operation_is_single_slot(recorder: Recorder, clients: Any, cluster_mode: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if cluster_mode:
        force_cluster(monkeypatch)
    drive(*clients)
    findings, used = check(recorder, cluster_mode=cluster_mode)
    assert not findings, "\n".join(map(str, findings))
    expected = set(CLUSTER_EXCEPTIONS if cluster_mode else SINGLE_NODE_EXCEPTIONS)
    assert expected <= used, f"stale exceptions (fixed? remove them): {expected - used}"


def test_every_public_stores_callable_is_driven_or_listed(recorder: Recorder, clients: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    drive(*clients)  # the single-node paths, then the Cluster ones (ordered submit, ...)
    force_cluster(monkeypatch)
    drive(*clients)
    missing = [q for q, mod in public_callables() if q not in recorder.callers and not listed(q, mod)]
    assert not missing, f"stores functions neither driven by test_slots.drive nor in NOT_DRIVEN: {missing}"
    overlap = [q for q in NOT_DRIVEN if q in recorder.callers]
    assert not overlap, f"listed as sending nothing, but sent commands: {overlap}"


def test_every_script_is_called_with_its_header_keys(recorder: Recorder, clients: Any) -> None:
    drive(*clients)
    seen: dict[str, set[int]] = {}
    for g in recorder.groups:
        for args in g.commands:
            if _name(args) in SCRIPT_CALLS:
                sha = args[1].decode() if isinstance(args[1], bytes) else args[1]
                seen.setdefault(recorder.sha_to_name[sha], set()).add(int(args[2]))
    assert set(seen) == set(NAMES), f"scripts never called by the drive: {set(NAMES) - set(seen)}"
    for name, counts in seen.items():
        if name in SINGLE_NODE_SCRIPTS:  # KEYS[1], then two keys per turn
            assert all(n >= 3 and (n - 1) % 2 == 0 for n in counts), (name, counts)
            continue
        if name in VARIABLE_KEYS_SCRIPTS:
            assert all(n >= 1 for n in counts), (name, counts)
            continue
        if name == "stream_append":  # its header's two keys per flush, one flush or more
            assert all(n > 0 and n % len(header_keys(name)) == 0 for n in counts), (name, counts)
            continue
        assert counts == {len(header_keys(name))}, (name, counts)


def test_the_recorder_catches_a_cross_slot_command(recorder: Recorder, clients: Any) -> None:
    r, _ar = clients

    def bad(r: redis.Redis) -> None:
        pipe = r.pipeline(transaction=True)
        pipe.set(keys.heartbeat("w-1"), 1)
        pipe.set(keys.heartbeat("w-2"), 1)
        pipe.execute()
        r.delete(keys.inbox("a"), keys.inbox("b"))
    bad.__code__ = bad.__code__.replace(co_filename=str(STORES_DIR / "fake.py"))
    bad(r)
    findings, _ = check(recorder, cluster_mode=False)
    assert len(findings) == 2, findings


def test_cluster_pressure_wait_wakes_on_an_event(monkeypatch: pytest.MonkeyPatch, clients: Any) -> None:
    """The Cluster path of ``wait_pressure`` (several tiers: polled per stream) returns an event
    posted during the wait, long before the block time, and nothing at the end of an empty one."""
    import threading
    r, _ar = clients
    force_cluster(monkeypatch)
    after = {tier: reports.last_pressure_id(r, tier) for tier in TIERS}
    t0 = time.monotonic()
    assert reports.wait_pressure(r, after, 10, 120) == {}
    assert time.monotonic() - t0 >= 0.1
    threading.Timer(0.1, lambda: r.xadd(keys.pressure("gpu"), {"user": "alice"})).start()
    t0 = time.monotonic()
    got = reports.wait_pressure(r, after, 10, 5_000)
    assert list(got) == ["gpu"] and time.monotonic() - t0 < 1.0

