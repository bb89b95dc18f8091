"""The per-tier ``WAIT`` after the lane acquire and the turn commit (failover).

- the policy fields and their validation;
- ``replica_acks`` 0 sends the script call alone (no ``WAIT``, no pipeline);
- ``replica_acks`` N sends ``FCALL`` + ``WAIT N timeout`` on one non-transactional pipeline
  (one connection: ``WAIT`` counts the writes of the connection it is sent on), and on a
  Cluster on one connection of the node serving the user's slot;
- a ``WAIT`` short of its replicas (or failed: fakeredis has no ``WAIT``) is counted and the
  turn goes on; a MOVED on the node path patches the client's slot table and is raised.

``tests/cluster/test_replica_wait_cluster.py`` does it on a real 3+3 cluster.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import pytest
import redis.asyncio.client as aclient
from redis.exceptions import MovedError, ResponseError

from protocol import keys
from protocol.policy import (
    PolicyError,
    TurnsPolicy,
    as_turns,
    parse_assignments,
    parse_policy,
    turns_policy,
    updated,
)
from stores import cluster, functions
from stores.replicas import ReplicaAcks, ReplicaWait, fewest
from stores.submit_options import SubmitOptions, submit_options_of
from stores.turns import Lease, UserStore, Writes

U = "alice"


# --- the policy -------------------------------------------------------------------------


def test_the_default_policy_sends_no_wait() -> None:
    p = TurnsPolicy()
    assert (p.durability.replica_acks, p.durability.replica_ack_timeout_ms) == (0, 100)
    assert ReplicaWait.of(p) is None
    assert ReplicaWait.of(turns_policy(replica_acks=1)) == ReplicaWait(1, 100)
    assert ReplicaWait.of(turns_policy(replica_acks=2, replica_ack_timeout_ms=30)) == ReplicaWait(2, 30)


@pytest.mark.parametrize(("changes", "words"), [
    ({"replica_acks": -1}, "replica_acks: -1 is not a replica count: 0 (no WAIT) .. 8"),
    ({"replica_acks": 9}, "replica_acks: 9 is not a replica count"),
    ({"replica_ack_timeout_ms": 0}, "replica_ack_timeout_ms: 0 ms: at least 1 (Redis' WAIT with timeout 0 "
                                    "blocks for ever"),
    ({"replica_ack_timeout_ms": 2001}, "replica_ack_timeout_ms: 2001 ms: at most 2000"),
    ({"replica_acks": "one"}, "replica_acks: Input should be a valid integer"),
    ({"replica_acks": 1.5}, "replica_acks: Input should be a valid integer"),
])
def test_bad_replica_fields_are_refused_with_a_reason(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(PolicyError) as err:
        updated(TurnsPolicy(), changes)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_the_fields_are_set_like_any_other() -> None:
    p = turns_policy(TurnsPolicy(), **parse_assignments(["replica_acks=1", "replica_ack_timeout_ms=50"]))
    assert ReplicaWait.of(p) == ReplicaWait(1, 50)
    assert parse_policy(p.to_json()) == p
    assert as_turns(parse_policy('{"handler": "echo"}')).durability.replica_acks == 0  # no WAIT


# --- the commands sent ----------------------------------------------------------------


@dataclass
class Sent:
    """Every command a client sends: ``("cmd", name)`` alone, ``("pipe", [names], transaction)``."""

    log: list[tuple[Any, ...]] = field(default_factory=list)

    def names(self) -> list[str]:
        return [x[1] for x in self.log if x[0] == "cmd"]

    def pipes(self) -> list[tuple[list[str], bool]]:
        return [(x[1], x[2]) for x in self.log if x[0] == "pipe"]


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sent]:
    out = Sent()
    real_cmd, real_exec = aclient.Redis.execute_command, aclient.Pipeline.execute

    async def execute_command(self: aclient.Redis, *args: Any, **options: Any) -> Any:
        if not isinstance(self, aclient.Pipeline):
            out.log.append(("cmd", str(args[0]).upper()))
        return await real_cmd(self, *args, **options)

    async def execute(self: aclient.Pipeline, raise_on_error: bool = True) -> Any:
        out.log.append(("pipe", [str(a[0]).upper() for a, _o in self.command_stack], self.is_transaction))
        return await real_exec(self, raise_on_error=raise_on_error)

    monkeypatch.setattr(aclient.Redis, "execute_command", execute_command)
    monkeypatch.setattr(aclient.Pipeline, "execute", execute)
    yield out


@pytest.fixture
async def r() -> AsyncIterator[fakeredis.FakeAsyncRedis]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()


async def one_turn(store: UserStore, r: fakeredis.FakeAsyncRedis, sent: Sent) -> tuple[Lease, str]:
    entry = (await r.xadd(keys.inbox(U), {"text": "hi"})).decode()
    sent.log.clear()
    lease = await store.acquire(U)
    assert isinstance(lease, Lease) and lease.next is not None and lease.next.entry == entry
    res = await store.commit(lease, entry, "t1", Writes(turn_id="t1", reply=b"r"), int(time.time() * 1000))
    assert res.result == "ok"
    return lease, entry


async def test_replica_acks_0_sends_exactly_the_script_calls(r: fakeredis.FakeAsyncRedis, sent: Sent) -> None:
    store = UserStore(r, "w1")
    store.replica_wait = ReplicaWait.of(TurnsPolicy())
    await one_turn(store, r, sent)
    # acquire, commit: no WAIT; each in the group commit's pipeline (alone here: one call each)
    assert sent.log == [("pipe", ["FCALL"], False), ("pipe", ["FCALL"], False)]
    assert store.acks.waits == {"acquire": 0, "commit": 0}


async def test_replica_acks_1_pipelines_fcall_and_wait(r: fakeredis.FakeAsyncRedis, sent: Sent) -> None:
    store = UserStore(r, "w1")
    store.replica_wait = ReplicaWait.of(turns_policy(replica_acks=1, replica_ack_timeout_ms=7))
    await one_turn(store, r, sent)
    # one non-transactional pipeline each: one connection, so WAIT counts the script's writes
    assert sent.log == [("pipe", ["FCALL", "WAIT"], False), ("pipe", ["FCALL", "WAIT"], False)]
    # fakeredis has no WAIT (an error reply): a failed WAIT got no replica; the turn went on
    assert store.acks.waits == {"acquire": 1, "commit": 1}
    assert store.acks.short == {"acquire": 1, "commit": 1}
    assert (await r.hget(keys.state(U), "cursor")) is not None
    assert await r.lrange(keys.reply(U, "t1"), 0, -1) == [b"r"]


async def test_a_fenced_commit_with_wait_is_still_fenced(r: fakeredis.FakeAsyncRedis, sent: Sent) -> None:
    from stores.turns import Fenced
    store = UserStore(r, "w1")
    store.replica_wait = ReplicaWait(1, 5)
    entry = (await r.xadd(keys.inbox(U), {"text": "hi"})).decode()
    lease = await store.acquire(U)
    assert isinstance(lease, Lease)
    await r.set(keys.lane(U), "w2|99")
    with pytest.raises(Fenced):
        await store.commit(lease, entry, "t1", Writes(turn_id="t1", reply=b"r"), 0)


async def test_a_missing_library_is_waited_for_on_the_pipelined_path(r: fakeredis.FakeAsyncRedis, sent: Sent,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(functions, "CHECK_EVERY_S", 0.01)
    store = UserStore(r, "w1")
    store.replica_wait = ReplicaWait(1, 5)
    await r.xadd(keys.inbox(U), {"text": "hi"})
    await r.function_delete(functions.LIBRARY)  # as FUNCTION FLUSH or a restart without persistence
    acquire = asyncio.ensure_future(store.acquire(U))
    while sent.names().count("FCALL_RO") < 2:  # checked, and checked again: waiting
        await asyncio.sleep(0.005)
    assert not acquire.done()
    functions.install(fakeredis.FakeRedis(server=r.connection_pool.connection_kwargs["server"]))
    assert isinstance(await acquire, Lease)
    assert [p for p, _t in sent.pipes()] == [["FCALL", "WAIT"], ["FCALL", "WAIT"]]  # nothing ran, then once
    assert await r.get(keys.fence(U)) == b"1"  # the function ran once


# --- the Cluster path: one connection of the slot's master --------------------------------


@dataclass
class FakeNode:
    """A ClusterNode's ``execute_pipeline`` (one connection) on fakeredis, answering WAIT."""

    r: fakeredis.FakeAsyncRedis
    acks: int = 1
    moved: bool = False
    name: str = "127.0.0.1:7000"
    sent: list[list[str]] = field(default_factory=list)

    async def execute_pipeline(self, cmds: list[Any]) -> bool:
        self.sent.append([str(c.args[0]) for c in cmds])
        for c in cmds:
            if c.args[0] == "WAIT":
                c.result = self.acks
            elif self.moved:
                c.result = MovedError("3999 127.0.0.1:7001")
            else:
                try:
                    c.result = await self.r.execute_command(*c.args)
                except Exception as exc:  # noqa: BLE001 - a reply error, as a node gives it
                    c.result = exc
        return False

    async def execute_command(self, *args: Any) -> Any:
        self.sent.append([" ".join(str(a) for a in args[:2])])
        return await self.r.execute_command(*args)


@dataclass
class FakeNodes:
    moved_to: list[Any] = field(default_factory=list)

    async def move_slot(self, e: Any) -> None:
        self.moved_to.append((e.host, e.port))

    def move_node_to_end_of_cached_nodes(self, name: str) -> None:
        pass


@dataclass
class FakeCluster:
    node: FakeNode
    nodes_manager: FakeNodes = field(default_factory=FakeNodes)
    asked: list[str] = field(default_factory=list)
    _initialize: bool = False

    async def initialize(self) -> FakeCluster:
        return self

    def get_node_from_key(self, key: str) -> FakeNode:
        self.asked.append(key)
        return self.node



async def test_on_a_cluster_fcall_and_wait_go_to_the_slot_master(r: fakeredis.FakeAsyncRedis,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster, "is_cluster", lambda c: isinstance(c, FakeCluster))
    node = FakeNode(r)
    rc = FakeCluster(node)
    store = UserStore(rc, "w1")  # type: ignore[arg-type]
    store.replica_wait = ReplicaWait(1, 20)
    entry = (await r.xadd(keys.inbox(U), {"text": "hi"})).decode()
    lease = await store.acquire(U)
    assert isinstance(lease, Lease)
    assert (await store.commit(lease, entry, "t1", Writes(turn_id="t1", reply=b"r"), 0)).result == "ok"
    assert set(rc.asked) == {keys.lane(U)}  # the user's slot, for every call
    assert node.sent == [["FCALL", "WAIT"], ["FCALL", "WAIT"]]
    assert store.acks.short == {"acquire": 0, "commit": 0}
    assert store.acks.acked == {"acquire": 1, "commit": 1}
    node.acks = 0  # the replica is away: the WAIT times out with none
    await r.delete(keys.lane(U))
    entry2 = (await r.xadd(keys.inbox(U), {"text": "again"})).decode()
    lease = await store.acquire(U)
    assert isinstance(lease, Lease)
    assert (await store.commit(lease, entry2, "t2", Writes(turn_id="t2", reply=b"r2"), 0)).result == "ok"
    assert store.acks.short == {"acquire": 1, "commit": 1}


async def test_a_moved_on_the_node_path_patches_the_slots_and_is_raised(
        r: fakeredis.FakeAsyncRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster, "is_cluster", lambda c: isinstance(c, FakeCluster))
    rc = FakeCluster(FakeNode(r, moved=True))
    store = UserStore(rc, "w1")  # type: ignore[arg-type]
    store.replica_wait = ReplicaWait(1, 20)
    with pytest.raises(MovedError):
        await store.acquire(U)
    assert rc.nodes_manager.moved_to == [("127.0.0.1", 7001)]


# --- the client's submit ------------------------------------------------------------------


def test_a_client_takes_the_submit_wait_from_the_policy() -> None:
    assert submit_options_of(TurnsPolicy().to_json(), None) == SubmitOptions(1, None)
    wanted = turns_policy(replica_acks=1, replica_ack_timeout_ms=30, ready_shards=2).to_json()
    assert submit_options_of(wanted, None) == SubmitOptions(2, ReplicaWait(1, 30))
    # lenient as the shard count is: an odd value means no WAIT (or the default timeout)
    assert submit_options_of(b'{"replica_acks": 9}', None).wait is None
    assert submit_options_of(b'{"replica_acks": true}', None).wait is None
    zero_timeout = b'{"replica_acks": 1, "replica_ack_timeout_ms": 0}'
    assert submit_options_of(zero_timeout, None).wait == ReplicaWait(1, 100)
    # a policy key being edited into nonsense: the last good one holds
    assert submit_options_of(b"{oops", turns_policy(replica_acks=2).to_json()).wait == ReplicaWait(2, 100)
    assert submit_options_of(None, None) == SubmitOptions()


def test_the_fewest_acknowledgements_of_a_multi_master_write_count() -> None:
    assert fewest([1, 2, 1]) == 1
    assert fewest([2, 0]) == 0
    err = ResponseError("ERR WAIT cannot be used with replica instances")
    assert fewest([1, err]) is err
    assert fewest([]) == 0


def test_a_short_submit_wait_is_counted_and_logged_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    acks = ReplicaAcks.of("submit")
    wait = ReplicaWait(1, 20)
    with caplog.at_level("WARNING", logger="fleet.replicas"):
        acks.count("submit", wait, 1, 0.0)
        acks.count("submit", wait, 0, 1.0)
        acks.count("submit", wait, 0, 2.0)  # within 10 s of the last warning: counted, not logged
        acks.count("submit", wait, ResponseError("ERR unknown command 'WAIT'"), 12.0)
    assert (acks.waits, acks.acked, acks.short) == ({"submit": 4}, {"submit": 1}, {"submit": 3})
    messages = [rec.getMessage() for rec in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("WAIT 1 after submit got 0 within 20 ms")
    assert "failed: ERR unknown command" in messages[1] and "3 such shortfalls (2 since" in messages[1]
