"""A tier spread over ready shards, end to end on a real redis-server with real workers: every
turn answered once and in order, and changing ``ready_shards`` on a live tier (3 -> 1, 1 -> 3)
under load takes effect (the clients write the new shards, the workers read them) and loses
nothing."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
import redis

from fleet.cli_admin import _status_text
from fleet.client import Fleet, TurnHandle
from fleet.status import snapshot as status_snapshot
from protocol import keys
from protocol.codec import decode
from protocol.models import SessionEntry
from protocol.policy import TurnsPolicy
from stores.backlog import read_backlog
from stores.policies import write_policy
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


def session_texts(r: redis.Redis, user: str) -> list[str]:
    return [decode(SessionEntry, raw).text for raw in r.lrange(keys.session(user), 0, -1)]


def delivered(r: redis.Redis, shard: int) -> int:
    """How many notifications the workers' group read on ``shard`` of chat."""
    group = next(g for g in r.xinfo_groups(keys.ready("chat", shard)) if g["name"] == keys.GROUP.encode())
    return int(group["entries-read"] or 0)


def added(r: redis.Redis, shard: int) -> int:
    """How many notifications were ever written to ``shard`` of chat."""
    return int(r.xinfo_stream(keys.ready("chat", shard))["entries-added"])


def drained(r: redis.Redis, shard: int) -> bool:
    """Whether the workers read and acked every notification of ``shard`` of chat."""
    group = next(g for g in r.xinfo_groups(keys.ready("chat", shard)) if g["name"] == keys.GROUP.encode())
    return int(group["lag"] or 0) == 0 and int(group["pending"]) == 0


class Quiet:
    """A condition for ``wait_until``: ``shards`` got no new notification for ``for_s`` seconds
    while shard 0 got ``busy`` or more (the submitters write on)."""

    def __init__(self, r: redis.Redis, shards: list[int], for_s: float, busy: int) -> None:
        self.r, self.shards, self.for_s, self.busy = r, shards, for_s, busy
        self.since, self.seen = time.monotonic(), self._counts()

    def _counts(self) -> tuple[int, ...]:
        return tuple(added(self.r, k) for k in [0, *self.shards])

    def __call__(self) -> bool:
        now = self._counts()
        if now[1:] != self.seen[1:]:  # one of them grew: start over from here
            self.since, self.seen = time.monotonic(), now
            return False
        return time.monotonic() - self.since >= self.for_s and now[0] - self.seen[0] >= self.busy


def check_in_order(r: redis.Redis, fleet: Fleet, handles: dict[str, list[TurnHandle]]) -> None:
    for user, hs in handles.items():
        replies = fleet.results(hs, timeout=120)
        assert [rep.ok for rep in replies] == [True] * len(hs), user
        for i, rep in enumerate(replies):
            assert rep.text.startswith(f"echo: {user} turn {i}"), (user, i, rep.text)
            # saw every earlier turn (the newest 20, WorkerSettings.context_turns): one at a time
            assert rep.context["session_turns"] == min(i, 20)
        # each turn once, in order (the newest 200: WorkerSettings.session_max)
        assert session_texts(r, user) == [f"{user} turn {i}" for i in range(len(hs))][-200:]
    assert not list(r.scan_iter(match="fleet:u:*:reply:*", count=1000))  # one reply each


def test_pipeline_on_three_ready_shards_answers_every_turn_in_order(r, redis_server, start_worker):
    write_policy(r, "chat", TurnsPolicy(concurrency=8, ready_shards=3))
    start_worker()
    start_worker()
    fleet = Fleet(redis_server.role_url("fleet-client"))
    names = [f"user{i:03d}" for i in range(60)]
    handles: dict[str, list[TurnHandle]] = defaultdict(list)
    for turn in range(5):
        for h in fleet.submit_many([(u, f"{u} turn {turn}") for u in names]):
            handles[h.user].append(h)
    check_in_order(r, fleet, handles)
    # the users' notifications went to their shards, and each shard was read (a turn may be
    # answered before its own notification is read: one job serves the user's whole inbox)
    wait_until(lambda: read_backlog(r, ["chat"], live=set())["chat"].backlog == 0, 10, "every ack")
    by_shard = [sum(1 for u in names if keys.ready_shard(u, 3) == k) * 5 for k in range(3)]
    assert [delivered(r, k) for k in range(3)] == by_shard and all(by_shard)
    # fleet status says how many shards the tier has
    snap = status_snapshot(r)
    assert snap["tiers"]["chat"]["ready_shards"] == 3 and snap["tiers"]["chat"]["backlog"] == 0
    assert "key, 3 ready shards" in _status_text(snap)


def test_pipeline_resharding_a_live_tier_3_to_1_to_3_loses_nothing(r, redis_server, start_worker):
    write_policy(r, "chat", TurnsPolicy(concurrency=8, ready_shards=3))
    start_worker()
    start_worker()
    names = [f"u{i:02d}" for i in range(30)]
    handles: dict[str, list[TurnHandle]] = defaultdict(list)
    stop = threading.Event()
    lock = threading.Lock()

    def submitter(mine: list[str]) -> None:
        own = Fleet(redis_server.role_url("fleet-client"))
        own.reread_policies()
        while not stop.is_set():
            with lock:
                batch = [(u, f"{u} turn {len(handles[u])}") for u in mine]
                for h in own.submit_many(batch):
                    handles[h.user].append(h)
            time.sleep(0.1)  # (the pace of the load: each user's jobs release between its turns)

    threads = [threading.Thread(target=submitter, args=(names[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: all(delivered(r, k) for k in range(3)), 20, "every shard read on 3 shards")
        write_policy(r, "chat", TurnsPolicy(concurrency=8, ready_shards=1))  # shrink under load
        # once the clients' cache of the policy ends, they write shard 0 only (the 1 s quiet is
        # the thing under test), and the workers drain shards 1 and 2
        wait_until(Quiet(r, [1, 2], for_s=1.0, busy=30), 30, "shards 1 and 2 written no more")
        wait_until(lambda: drained(r, 1) and drained(r, 2), 20, "shards 1 and 2 drained")
        before = {k: (added(r, k), delivered(r, k)) for k in (1, 2)}
        write_policy(r, "chat", TurnsPolicy(concurrency=8, ready_shards=3))  # and grow again
        wait_until(lambda: all(added(r, k) > before[k][0] + 10 and delivered(r, k) > before[k][1] + 10
                               for k in (1, 2)), 30, "shards 1 and 2 written and read again")
    finally:
        stop.set()
        for t in threads:
            t.join()
    fleet = Fleet(redis_server.role_url("fleet-client"))
    assert sum(len(hs) for hs in handles.values()) > 30 * 20
    check_in_order(r, fleet, handles)
