"""The turn pipeline end to end: real redis-server, real worker processes (invariants I1-I3:
one reply per accepted turn, per-user order, one worker per user at a time)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import threading
import time
from collections import defaultdict

import pytest
import redis

from fleet.client import Fleet, TurnHandle
from protocol import keys
from protocol.codec import decode, encode
from protocol.models import Control, SessionEntry
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


def session_of(r: redis.Redis, user: str) -> list[SessionEntry]:
    return [decode(SessionEntry, raw) for raw in r.lrange(keys.session(user), 0, -1)]


def dead_letters(r: redis.Redis, tier: str = "chat") -> list[dict[str, str]]:
    """The tier's dead letters as text; the kept turn (msgpack, for a retry) as ``kept``."""
    return [{**{k.decode(): v.decode() for k, v in f.items() if k != b"turn"}, "kept": str(b"turn" in f)}
            for _, f in r.xrange(keys.dead(tier))]


def test_turn_goes_end_to_end_and_reply_carries_context(r, redis_server, start_worker):
    write_policy(r, "chat", TurnsPolicy())  # the client role knows a tier by its policy
    start_worker()
    fleet = Fleet(redis_server.role_url("fleet-client"))
    r.hset(keys.profile("alice"), "name", "Alice")  # the handler's to write: not the client's
    first = fleet.submit("alice", "my cat is called Tom").result(10)
    second = fleet.submit("alice", "what is my cat called?").result(10)

    assert first.ok and first.text.startswith("echo: my cat is called Tom")
    assert second.ok
    assert "previous: my cat is called Tom" in second.text  # the session
    assert "memory: said: my cat is called Tom" in second.text  # episodic memory
    assert "hello Alice" in second.text  # the profile
    assert second.context["session_turns"] == 1
    assert second.context["memories"] == ["said: my cat is called Tom"]
    assert [e.text for e in session_of(r, "alice")] == ["my cat is called Tom", "what is my cat called?"]
    assert r.hget(keys.usage("alice"), "turns") == b"2"
    assert r.xlen(keys.inbox("alice")) == 0  # processed entries are trimmed
    # the lane is released once the inbox is found empty: a round trip after the reply, which
    # the client may see first
    wait_until(lambda: not r.exists(keys.lane("alice")), 10, "the lane's release")


def test_many_users_every_turn_once_in_order(r, redis_server, start_worker):
    users, per_user = 200, 10
    write_policy(r, "chat", TurnsPolicy(concurrency=16))
    start_worker()
    start_worker()
    fleet = Fleet(redis_server.role_url("fleet-client"))
    handles: dict[str, list] = defaultdict(list)
    lock = threading.Lock()

    def submitter(mine: list[str]) -> None:
        # interleave the users of this thread, several turns of one user in flight at once
        order = [u for _ in range(per_user) for u in random.sample(mine, len(mine))]
        own = Fleet(redis_server.role_url("fleet-client"))
        for start in range(0, len(order), 50):
            batch = order[start:start + 50]
            with lock:
                texts = [f"{u} turn {len(handles[u]) + batch[:i].count(u)}" for i, u in enumerate(batch)]
            hs = own.submit_many(list(zip(batch, texts, strict=True)))
            with lock:
                for h in hs:
                    handles[h.user].append(h)

    names = [f"user{i:03d}" for i in range(users)]
    threads = [threading.Thread(target=submitter, args=(names[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    workers_seen = set()
    for user in names:
        replies = fleet.results(handles[user], timeout=120)
        assert [rep.ok for rep in replies] == [True] * per_user, user
        for i, rep in enumerate(replies):
            assert rep.text.startswith(f"echo: {user} turn {i}")
            # every turn saw all earlier turns of its user: processed one at a time, in order
            assert rep.context["session_turns"] == i
            workers_seen.add(rep.worker)
        assert [e.text for e in session_of(r, user)] == [f"{user} turn {i}" for i in range(per_user)]
        assert [e.turn_id for e in session_of(r, user)] == [h.turn_id for h in handles[user]]
    # exactly one reply each: nothing is left behind on any reply key
    assert not list(r.scan_iter(match="fleet:u:*:reply:*", count=1000))
    assert len(workers_seen) == 2
    assert dead_letters(r) == []


def test_worker_killed_inside_handler_turn_answered_once_elsewhere(r, redis_server, start_worker):
    write_policy(r, "chat", TurnsPolicy(handler="sleep", handler_options={"sleep_ms": 1500}))
    a = start_worker(worker_id="chat-a")
    b = start_worker(worker_id="chat-b")
    fleet = Fleet(redis_server.role_url("fleet-client"))
    handle = fleet.submit("dave", "slow one")
    holder = wait_until(lambda: r.get(keys.lane("dave")), 10, "a worker to take dave's lane").decode()
    victim, survivor = (a, b) if holder.startswith("chat-a|") else (b, a)
    # inside the handler: the attempt is counted (the pull precedes the handler), not only the lane taken
    wait_until(lambda: any(k.startswith(b"att:") for k in r.hkeys(keys.state("dave"))), 10, "the handler")
    victim.kill()

    reply = handle.result(30)
    assert reply.ok and reply.text == "slept: slow one"
    assert reply.worker == survivor.worker_id
    assert reply.attempts == 2  # the killed attempt counted
    assert [e.turn_id for e in session_of(r, "dave")] == [handle.turn_id]
    assert r.llen(keys.reply("dave", handle.turn_id)) == 0  # no second reply
    # the user is served normally afterwards
    assert fleet.submit("dave", "next", meta={"sleep_ms": 10}).result(10).ok


def test_bad_input_is_dead_lettered_and_the_worker_keeps_serving(r, redis_server, start_worker):
    write_policy(r, "chat", TurnsPolicy(handler="sleep", max_attempts=2, handler_options={"sleep_ms": 1}))
    w = start_worker()
    raw = redis_server.client()
    garbage_id = raw.xadd(keys.inbox("bob"), {"m": b"\xc1\xff not msgpack"}).decode()
    raw.xadd(keys.ready("chat"), {"user": "bob"})
    big_id = raw.xadd(keys.inbox("bob"), {"text": "x" * (100 * 1024)}).decode()
    raw.xadd(keys.ready("chat"), {"user": "bob"})
    notext_id = raw.xadd(keys.inbox("bob"), {"txt": "typo"}).decode()
    raw.xadd(keys.ready("chat"), {"user": "bob"})
    raw.xadd(keys.ready("chat"), {"user": "evil}{user"})
    raw.xadd(keys.ready("chat"), {"nobody": "x"})

    fleet = Fleet(redis_server.role_url("fleet-client"))
    # the reply of a turn written by hand: a handle names it (replies to binary turns are msgpack)
    garbage = TurnHandle(fleet, "bob", "chat", garbage_id, 0.0).result(10)
    assert not garbage.ok and "not msgpack" in garbage.error
    for entry, why in ((big_id, "over the limit"), (notext_id, "no 'text' field")):
        got = raw.blpop([keys.reply("bob", entry)], timeout=10)
        assert got, f"no error reply for {entry}"
        body = json.loads(got[1])  # replies to plain turns are JSON
        assert body["ok"] is False and why in body["error"]

    # a handler that keeps failing: retried max_attempts times, then dead-lettered
    failing = fleet.submit("bob", "boom", meta={"fail_attempts": 5})
    reply = failing.result(20)
    assert not reply.ok and "failed 2 attempts" in reply.error and "injected failure" in reply.error

    reasons = [d["reason"] for d in wait_until(lambda: len(dead_letters(r)) >= 6 and dead_letters(r), 10,
                                               "six dead letters")]
    assert any("not msgpack" in x for x in reasons)
    assert any("over the limit" in x for x in reasons)
    assert any("no 'text' field" in x for x in reasons)
    assert any("invalid user id" in x for x in reasons)
    assert any("no 'user' field" in x for x in reasons)
    assert any("failed 2 attempts" in x for x in reasons)
    def kept(why: str) -> list[str]:  # whether the whole entry was kept, for a retry
        return [d["kept"] for d in dead_letters(r) if why in d["reason"]]

    assert kept("failed 2 attempts") == kept("no 'text' field") == ["True"]
    assert kept("over the limit") == kept("invalid user id") == ["False"]  # too big; a notification
    assert w.proc.poll() is None  # still alive, still serving
    ok = fleet.submit("bob", "fine now").result(10)
    assert ok.ok and ok.text == "slept: fine now"
    assert [e.text for e in session_of(r, "bob")] == ["fine now"]


def test_redis_cli_alone_can_submit_and_read_the_reply(r, redis_server, start_worker):
    cli = shutil.which("redis-cli")
    assert cli, "redis-cli is not installed"
    start_worker()

    def rc(*args: str) -> str:
        # -c follows a Cluster's MOVED (tests/cluster runs this test on one): no-op on one node
        # as the client role: the raw protocol needs no other right
        out = subprocess.run([cli, "-c", "-u", redis_server.role_url("fleet-client"), "--no-auth-warning",
                              *args], capture_output=True, text=True, timeout=20, check=True)
        return out.stdout.strip()

    entry = rc("XADD", "fleet:u:{carol}:inbox", "*", "text", "hi from redis-cli")
    rc("XADD", "fleet:{chat}:ready", "*", "user", "carol")
    rc("ZADD", "fleet:{chat}:active", "1700000000", "carol")
    out = rc("BLPOP", f"fleet:u:{{carol}}:reply:{entry}", "10")
    key, body = out.splitlines()
    assert key == f"fleet:u:{{carol}}:reply:{entry}"
    reply = json.loads(body)
    assert reply["ok"] is True and reply["text"] == "echo: hi from redis-cli"
    assert reply["turn_id"] == entry

    # and with a turn id of the client's choosing
    rc("XADD", "fleet:u:{carol}:inbox", "*", "turn_id", "my-turn-1", "text", "again")
    rc("XADD", "fleet:{chat}:ready", "*", "user", "carol")
    out = rc("BLPOP", "fleet:u:{carol}:reply:my-turn-1", "10")
    assert json.loads(out.splitlines()[1])["text"].startswith("echo: again | previous: hi from redis-cli")


def test_turns_of_one_user_on_two_tiers_keep_order_and_each_tier_its_handler(r, redis_server, start_worker):
    write_policy(r, "chat", TurnsPolicy(handler="echo"))
    write_policy(r, "gpu", TurnsPolicy(handler="sleep", handler_options={"sleep_ms": 5}))
    start_worker("chat")
    start_worker("gpu")
    fleet = Fleet(redis_server.role_url("fleet-client"))
    plan = [("chat", "a"), ("gpu", "b"), ("gpu", "c"), ("chat", "d"), ("gpu", "e")]
    handles = [fleet.submit("erin", text, tier=tier) for tier, text in plan]
    replies = fleet.results(handles, timeout=30)
    assert [rep.text.split(" |")[0] for rep in replies] == [
        "echo: a", "slept: b", "slept: c", "echo: d", "slept: e"]
    assert [rep.worker.split("-")[0] for rep in replies] == ["chat", "gpu", "gpu", "chat", "gpu"]
    assert [e.text for e in session_of(r, "erin")] == ["a", "b", "c", "d", "e"]


def test_drain_finishes_the_turn_in_flight_and_hands_over_the_rest(r, redis_server, start_worker):
    write_policy(r, "chat", TurnsPolicy(handler="sleep", handler_options={"sleep_ms": 800}))
    a = start_worker(worker_id="chat-drain-a")
    fleet = Fleet(redis_server.role_url("fleet-client"))
    handles = fleet.submit_many([("finn", f"t{i}") for i in range(3)])
    wait_until(lambda: (r.get(keys.lane("finn")) or b"").startswith(b"chat-drain-a|"), 10, "a to serve finn")
    r.xadd(keys.control("chat-drain-a"), {"m": encode(Control(kind="drain", ts=time.time(), reason="test"))})
    assert a.proc.wait(timeout=20) == 0  # exits cleanly once its turn in flight is done
    b = start_worker(worker_id="chat-drain-b")
    replies = fleet.results(handles, timeout=30)
    assert [rep.text for rep in replies] == ["slept: t0", "slept: t1", "slept: t2"]
    assert replies[0].worker == "chat-drain-a" and replies[-1].worker == b.worker_id
    assert [e.text for e in session_of(r, "finn")] == ["t0", "t1", "t2"]
    assert not r.hexists(keys.WORKERS, "chat-drain-a")  # it deregistered


def test_worker_rides_out_a_redis_restart(r, redis_server, start_worker):
    write_policy(r, "chat", TurnsPolicy())  # the client role knows a tier by its policy
    w = start_worker()
    fleet = Fleet(redis_server.role_url("fleet-client"))
    assert fleet.submit("gus", "before").result(10).ok
    redis_server.stop()
    time.sleep(1.0)  # the outage itself: the worker must ride out a second without Redis
    redis_server.start()  # same port and data directory: the AOF brings the streams back
    reply = Fleet(redis_server.role_url("fleet-client")).submit("gus", "after").result(30)
    assert reply.ok and reply.text.startswith("echo: after | previous: before")
    assert w.proc.poll() is None
