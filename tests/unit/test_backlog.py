"""The backlog reader (stores.backlog): only turns no worker has started count.

The pure judgement is table-tested over raw replies; the I/O wrapper, the commander's
observer and ``fleet status`` are tested on fakeredis with real consumer-group states.
"""

from __future__ import annotations

import dataclasses
import time

import fakeredis
import pytest
import redis

from commander.decide_inputs import TierSignals, holding, with_lanes
from commander.decide_inputs import snapshot as tier_snapshot
from commander.observe import Observer
from commander.snapshot import WorkerView
from fleet.status import snapshot, tier_backlog
from protocol import keys
from protocol.codec import encode
from protocol.models import WorkerInfo
from stores.backlog import TierBacklog, read_backlog, unserved_after_ms, unserved_by_tier
from stores.backlog import tier_backlog as judge

NOGROUP = redis.ResponseError("NOGROUP No such key or consumer group")
NOKEY = redis.ResponseError("no such key")


def group(pending: int, lag: int | None, name: bytes = b"workers") -> dict[str, object]:
    return {"name": name, "consumers": 2, "pending": pending, "last-delivered-id": b"5-0",
            "entries-read": 5, "lag": lag}


def consumer(name: str, pending: int) -> dict[str, object]:
    return {"name": name.encode(), "pending": pending}


def summary(*consumers: dict[str, object]) -> dict[str, object]:
    """The reply of ``XPENDING <stream> <group>``: the entries pending, who holds how many."""
    pending = sum(int(str(c["pending"])) for c in consumers)
    return {"pending": pending, "min": b"1-0", "max": b"5-0", "consumers": list(consumers)}


def idle(consumer: str, n: int = 1) -> list[dict[str, object]]:
    """``n`` entries of ``consumer`` in the reply of ``XPENDING … IDLE``: not claimed again lately."""
    return [{"message_id": f"{i}-0".encode(), "consumer": consumer.encode(), "time_since_delivered": 9_000,
             "times_delivered": 1} for i in range(n)]


@pytest.mark.parametrize(("groups", "consumers", "stale", "length", "live", "want"), [
    # no stream: nothing waits
    (NOKEY, NOGROUP, NOGROUP, 0, {"w1"}, TierBacklog()),
    # a stream with no group yet (no worker ever started): every entry is undelivered
    ([], NOGROUP, NOGROUP, 4, set(), TierBacklog(undelivered=4, backlog=4)),
    ([group(0, 0, name=b"other")], NOGROUP, NOGROUP, 3, set(), TierBacklog(undelivered=3, backlog=3)),
    # a live worker's pending is its jobs in progress: not backlog
    ([group(3, 0)], summary(consumer("w1", 3)), [], 3, {"w1"},
     TierBacklog(pending=3, in_progress=3, held={"w1": 3})),
    # lag is counted; live pending is not
    ([group(3, 2)], summary(consumer("w1", 3)), [], 5, {"w1"},
     TierBacklog(undelivered=2, pending=3, in_progress=3, backlog=2, held={"w1": 3})),
    # a consumer with no live registry entry (SIGKILLed: stays in the group) is backlog
    ([group(3, 0)], summary(consumer("dead", 3)), idle("dead", 3), 3, set(),
     TierBacklog(pending=3, backlog=3)),
    ([group(3, 0)], summary(consumer("dead", 3)), [], 3, set(),
     TierBacklog(pending=3, backlog=3)),  # idle or not
    ([group(5, 1)], summary(consumer("w1", 2), consumer("dead", 3)), [], 6, {"w1"},
     TierBacklog(undelivered=1, pending=5, in_progress=2, backlog=4, held={"w1": 2})),
    # a live worker's entries it stopped claiming (its job lost the lane): no one serves them
    ([group(3, 0)], summary(consumer("w1", 3)), idle("w1", 2), 3, {"w1"},
     TierBacklog(pending=3, in_progress=1, backlog=2, held={"w1": 1})),
    ([group(3, 0)], summary(consumer("w1", 2), consumer("w2", 1)), idle("w2"), 3, {"w1", "w2"},
     TierBacklog(pending=3, in_progress=2, backlog=1, held={"w1": 2})),  # w2 holds no job: idle
    # idle entries unreadable: the live workers' pending counts as served
    ([group(2, 0)], summary(consumer("w1", 2)), NOGROUP, 2, {"w1"},
     TierBacklog(pending=2, in_progress=2, held={"w1": 2})),
    # a consumer with no pending counts for nothing
    ([group(2, 0)], summary(consumer("w1", 2), consumer("w2", 0)), [], 2, {"w1", "w2"},
     TierBacklog(pending=2, in_progress=2, held={"w1": 2})),
    # lag unknown after deletions: what is not pending is taken as undelivered
    ([group(3, None)], summary(consumer("w1", 3)), [], 7, {"w1"},
     TierBacklog(undelivered=4, pending=3, in_progress=3, backlog=4, held={"w1": 3})),
    ([group(3, None)], summary(consumer("w1", 3)), [], 2, {"w1"},
     TierBacklog(pending=3, in_progress=3, held={"w1": 3})),
    # consumers unreadable (group gone between two replies): no pending is known to be held
    ([group(2, 0)], NOGROUP, [], 2, {"w1"}, TierBacklog(pending=2, backlog=2)),
    # replies read a moment apart: never more in progress than the group has pending
    ([group(1, 0)], summary(consumer("w1", 2)), [], 2, {"w1"},
     TierBacklog(pending=1, in_progress=1, held={"w1": 2})),
    ([group(1, 0)], summary(consumer("w1", 1)), idle("w1", 2), 2, {"w1"}, TierBacklog(pending=1, backlog=1)),
])
def test_judge(groups: object, consumers: object, stale: object, length: int, live: set[str],
               want: TierBacklog) -> None:
    assert judge(groups, consumers, stale, length, live) == want


# --- on fakeredis: real consumer-group states --------------------------------------------
@pytest.fixture
def r() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def submit(r: redis.Redis, tier: str, *users: str) -> None:
    for user in users:
        r.xadd(keys.ready(tier), {"user": user})


def take(r: redis.Redis, tier: str, worker: str, n: int) -> None:
    """``worker`` reads ``n`` notifications and keeps them pending (jobs in progress)."""
    r.xreadgroup(keys.GROUP, worker, {keys.ready(tier): ">"}, count=n)


def register(r: redis.Redis, worker: str, tier: str = "chat", alive: bool = True) -> None:
    r.hset(keys.WORKERS, worker, encode(WorkerInfo(worker=worker, tier=tier, pid=1, host="h", started=0)))
    if alive:
        r.set(keys.heartbeat(worker), "1")


def group_on(r: redis.Redis, tier: str) -> None:
    r.xgroup_create(keys.ready(tier), keys.GROUP, id="0", mkstream=True)


def test_read_backlog_states(r: fakeredis.FakeRedis) -> None:
    group_on(r, "busy")
    submit(r, "busy", "a", "b", "c", "d")
    take(r, "busy", "w1", 3)  # three in progress, one undelivered
    group_on(r, "orphan")
    submit(r, "orphan", "a", "b")
    take(r, "orphan", "gone", 2)  # its worker died: both wait
    submit(r, "nogroup", "a", "b")
    got = read_backlog(r, ["busy", "orphan", "nogroup", "nostream"], {"w1"})
    assert got == {
        "busy": TierBacklog(undelivered=1, pending=3, in_progress=3, backlog=1, held={"w1": 3}),
        "orphan": TierBacklog(pending=2, backlog=2),
        "nogroup": TierBacklog(undelivered=2, backlog=2),
        "nostream": TierBacklog(),
    }
    assert read_backlog(r, [], {"w1"}) == {}


def test_entries_a_live_worker_stopped_claiming_are_backlog(r: fakeredis.FakeRedis) -> None:
    group_on(r, "chat")
    submit(r, "chat", "a", "b", "c")
    take(r, "chat", "w1", 3)
    ready = keys.ready("chat")
    pending = [e["message_id"] for e in r.xpending_range(ready, keys.GROUP, "-", "+", 3)]
    # idle times set, not slept for: the two it stopped claiming 20 s ago, its one job renewed now
    r.xclaim(ready, keys.GROUP, "w1", 0, pending[1:], idle=20_000, justid=True)
    r.xclaim(ready, keys.GROUP, "w1", 0, pending[:1], justid=True)  # the renew of its one job
    assert read_backlog(r, ["chat"], {"w1"}, unserved_ms=10_000)["chat"] == TierBacklog(
        pending=3, in_progress=1, backlog=2, held={"w1": 1})
    assert read_backlog(r, ["chat"], {"w1"}, unserved_ms=60_000)["chat"] == TierBacklog(
        pending=3, in_progress=3, held={"w1": 3})
    obs = Observer(r, unserved_ms=10_000)
    assert obs.tier_signals(["chat"], {}, 0.0, live={"w1"})["chat"].backlog == 2


def _entry(wid: str, tier: str, renew: float | None = None) -> WorkerInfo:
    extra = {} if renew is None else {"renew_interval_s": renew}
    return WorkerInfo(worker=wid, tier=tier, pid=1, host="h", started=0.0, **extra)


def test_the_bound_is_two_renews_of_the_tiers_slowest_live_worker() -> None:
    assert unserved_after_ms() == 3_000  # the workers' default renew: 1.5 s
    workers = {"a": (_entry("a", "chat", 0.4), True), "b": (_entry("b", "chat", 0.2), True),
               "c": (_entry("c", "chat", 10.0), False),  # dead: its renew is no one's now
               "d": (_entry("d", "batch", 2.0), True), "e": (_entry("e", "old"), True)}
    assert unserved_by_tier(workers, ["chat", "batch", "old", "none"]) == {
        "chat": 800, "batch": 4_000, "old": 3_000, "none": 3_000}  # "old": an entry without it


def test_the_observer_takes_the_bound_from_the_registry(r: fakeredis.FakeRedis) -> None:
    """A live worker renewing every 0.05 s has not claimed an entry idle 200 ms: backlog. With
    the default bound (3 s) that entry would count as its job in progress."""
    ready = keys.ready("chat")
    r.xgroup_create(ready, keys.GROUP, id="0", mkstream=True)
    r.xadd(ready, {"user": "u1"})
    r.xreadgroup(keys.GROUP, "w1", {ready: ">"})
    r.hset(keys.WORKERS, "w1", encode(_entry("w1", "chat", 0.05)))
    r.set(keys.heartbeat("w1"), "1")
    time.sleep(0.2)  # the entry's idle time: what is measured, not a race
    assert Observer(r).tier_signals(["chat"], {}, 0.0)["chat"].backlog == 1
    r.hset(keys.WORKERS, "w1", encode(_entry("w1", "chat")))
    assert Observer(r).tier_signals(["chat"], {}, 0.0)["chat"].backlog == 0
    # one observer, pass after pass: the bound follows the registry (the worker registers again
    # with another renew, bumping the version)
    obs = Observer(r)
    for renew, backlog in ((0.05, 1), (1.5, 0), (0.05, 1)):
        r.hset(keys.WORKERS, "w1", encode(_entry("w1", "chat", renew)))
        r.incr(keys.WORKERS_VERSION)
        obs.registry()
        assert obs.tier_signals(["chat"], {}, 0.0)["chat"].backlog == backlog, renew


def test_observer_backlog_counts_only_unstarted_work(r: fakeredis.FakeRedis) -> None:
    group_on(r, "chat")
    submit(r, "chat", *[f"u{i}" for i in range(6)])
    register(r, "live")
    register(r, "dead", alive=False)  # SIGKILLed: registered, no heartbeat
    take(r, "chat", "live", 3)
    take(r, "chat", "dead", 1)
    take(r, "chat", "stranger", 1)  # a consumer the registry does not know
    obs = Observer(r)
    obs.registry()  # the commander reads the registry before the signals, every pass
    sig = obs.tier_signals(["chat"], {"chat": 60.0}, 0.0)["chat"]
    assert sig.backlog == 3  # 1 undelivered + the dead worker's + the stranger's, not the 3 live
    # without a registry read this pass it reads one itself
    assert Observer(r).tier_signals(["chat"], {}, 0.0)["chat"].backlog == 3
    # or is told who is live
    assert Observer(r).tier_signals(["chat"], {}, 0.0, live={"live", "dead"})["chat"].backlog == 2
    assert sig.held == {"live": 3}  # who holds the jobs in progress, for the worker views


def test_observer_pressure_counts_only_while_undelivered(r: fakeredis.FakeRedis) -> None:
    group_on(r, "chat")
    submit(r, "chat", "a")
    register(r, "live")
    take(r, "chat", "live", 1)
    obs = Observer(r)
    obs.pressure_pending["chat"] = 2
    assert obs.tier_signals(["chat"], {}, 0.0)["chat"].pressure_events == 0  # taken already
    submit(r, "chat", "b")
    obs.pressure_pending["chat"] = 2
    assert obs.tier_signals(["chat"], {}, 0.0)["chat"].pressure_events == 2


def test_observer_registry_read_is_used_once(r: fakeredis.FakeRedis) -> None:
    group_on(r, "chat")
    submit(r, "chat", "a")
    register(r, "w1")
    take(r, "chat", "w1", 1)
    obs = Observer(r)
    obs.registry()
    assert obs.tier_signals(["chat"], {}, 0.0)["chat"].backlog == 0
    r.delete(keys.heartbeat("w1"))  # w1 dies between passes
    assert obs.tier_signals(["chat"], {}, 0.0)["chat"].backlog == 1  # not last pass's liveness


def test_status_shows_pending_and_the_new_backlog(r: fakeredis.FakeRedis) -> None:
    group_on(r, "chat")
    submit(r, "chat", "a", "b", "c", "d")
    register(r, "live")
    register(r, "dead", alive=False)
    take(r, "chat", "live", 2)
    take(r, "chat", "dead", 1)
    want = {"lag": 1, "pending": 3, "in_progress": 2, "backlog": 2}
    assert tier_backlog(r, "chat") == want
    row = snapshot(r)["tiers"]["chat"]
    assert {k: row[k] for k in want} == want
    assert tier_backlog(r, "chat", live=set()) == {"lag": 1, "pending": 3, "in_progress": 0, "backlog": 4}


# --- the views: a worker holding jobs in Redis is not idle, whatever its last report --------
def test_a_worker_holding_notifications_is_not_idle() -> None:
    caught_between_turns = WorkerView("w1", busy=0, total=2, lanes=0)
    resting = WorkerView("w2", busy=0, total=2, lanes=0)
    busy = WorkerView("w3", busy=2, total=2, lanes=2)
    snap = tier_snapshot("chat", (caught_between_turns, resting, busy),
                         TierSignals(held={"w1": 1, "w3": 2, "gone": 4}))
    by_id = {w.id: w for w in snap.workers}
    assert not by_id["w1"].idle and by_id["w1"].lanes == 1 and by_id["w1"].busy == 0
    assert by_id["w2"].idle and by_id["w2"] == resting
    assert by_id["w3"] == busy
    assert set(by_id) == {"w1", "w2", "w3"}  # a holder the views do not know adds no worker


def test_the_backlog_reads_the_consumers_that_hold_entries_not_every_consumer(r: fakeredis.FakeRedis,
                                                                             monkeypatch) -> None:
    """Who holds what comes from XPENDING's summary (the consumers with entries pending), not
    from XINFO CONSUMERS, which lists every consumer: a commander read 10,000 of them a pass."""
    group_on(r, "chat")
    submit(r, "chat", "a", "b", "c")
    register(r, "live")
    take(r, "chat", "live", 2)
    for i in range(20):
        r.xgroup_createconsumer(keys.ready("chat"), keys.GROUP, f"chat-idle{i}")
    listed: list[object] = []
    monkeypatch.setattr(redis.client.Pipeline, "xinfo_consumers", lambda *a, **k: listed.append(a))
    got = read_backlog(r, ["chat"], {"live"}, unserved_ms=60_000)["chat"]
    assert got == TierBacklog(undelivered=1, pending=2, in_progress=2, backlog=1, held={"live": 2})
    assert listed == []


def test_holding_makes_a_view_again_only_when_its_view_or_count_changed() -> None:
    """The commander keeps what ``holding`` made from pass to pass (thousands of views): a
    worker whose view and count are the last call's gets the very view made then; one whose
    count or view changed gets a new one; and a copy keeps every field but ``lanes``."""
    every = WorkerView("w1", state="draining", occupancy=0.5, busy=1, total=3, lanes=0, fresh=False,
                       is_reception=True, started=5.0, ready_at=6.0, turns=7, protected_until=8.0)
    assert {f.name for f in dataclasses.fields(WorkerView)} == set(WorkerView.__slots__)
    assert all(getattr(every, f.name) != f.default for f in dataclasses.fields(WorkerView)
               if f.name not in ("id", "lanes"))
    assert with_lanes(every, 2) == dataclasses.replace(every, lanes=2)
    other = WorkerView("w2", busy=0, total=2, lanes=0)
    kept: dict[str, tuple[WorkerView, int, WorkerView]] = {}
    first = holding((every, other), {"w1": 2, "w2": 1}, kept)
    assert holding((every, other), {"w1": 2, "w2": 1}, kept)[0] is first[0]
    again = holding((every, other), {"w1": 3}, kept)
    assert again[0] is not first[0] and again[0].lanes == 3 and again[1] is other
    assert set(kept) == {"w1"}  # (what the last call made, no more)
    moved = dataclasses.replace(every, occupancy=0.9)
    assert holding((moved, other), {"w1": 3}, kept)[0] == dataclasses.replace(moved, lanes=3)
