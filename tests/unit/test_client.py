"""fleet.client: the submit transaction's shape and replies, and the refusal of a tier that runs nowhere.

The transaction's behaviour on a real server (a connection lost mid-submit, a refused command)
is in tests/integration/test_client.py; here the pure parts, and the tier check over fakeredis.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import fakeredis
import pytest
import redis

import fleet
from fleet.client import AsyncFleet, Fleet, UnknownTier
from protocol import keys
from protocol.codec import encode
from protocol.models import Turn, WorkerInfo
from protocol.policy import TurnsPolicy
from stores.functions import function_name as sha
from stores.policies import read_policy, write_policy
from stores.replicas import ReplicaWait
from stores.submit import Submitted, committed, queue_round_trip
from stores.submit_options import SubmitOptions
from stores.tier_exists import heartbeats_of, tier_defined


class Recorder:
    """A pipeline that records the commands queued on it."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any) -> None:
        self.sent.append(args)

    def xadd(self, key: str, fields: dict[str, Any]) -> None:
        self.sent.append(("XADD", key))

    def zadd(self, key: str, mapping: dict[str, float]) -> None:
        self.sent.append(("ZADD", key))

    def xinfo_groups(self, key: str) -> None:
        self.sent.append(("XINFO GROUPS", key))

    def get(self, key: str) -> None:
        self.sent.append(("GET", key))

    def wait(self, replicas: int, timeout_ms: int) -> None:
        self.sent.append(("WAIT", replicas, timeout_ms))


def info(worker: str, tier: str) -> bytes:
    return encode(WorkerInfo(worker=worker, tier=tier, pid=1, host="h", started=0.0))


def build(user: str) -> tuple[Turn, bytes]:
    """A turn of ``chat`` as the client builds it, with its payload."""
    turn = Turn(turn_id=uuid.uuid4().hex, user=user, tier="chat", text="hi", ts=time.time())
    return turn, encode(turn)


# --- the round trip's shape ---------------------------------------------------------------
def test_the_submit_is_one_script_call_and_the_pressure_check_after_it() -> None:
    built = [build(u) for u in ("alice", "bob")]
    pipe = Recorder()
    queue_round_trip(pipe, built, "chat", pressure={"tier": "chat", "user": "bob", "ts": "1"})
    assert [cmd[0] for cmd in pipe.sent] == ["FCALL", "FCALL"]
    submit, check = pipe.sent
    assert submit[1] == sha("turn_submit") and check[1] == sha("submit_pressure")
    assert submit[2:3 + submit[2]] == (5, keys.active("chat"), keys.inbox("alice"), keys.inbox("bob"),
                                       keys.ready("chat"), keys.ready("chat"))
    t_alice, p_alice = built[0]
    assert submit[8:14] == (2, "alice", t_alice.ts, t_alice.turn_id, "chat", p_alice)
    assert check[2:6] == (3, keys.ready("chat"), keys.starting("chat"), keys.pressure("chat"))


def test_without_a_pressure_check_the_submit_is_the_script_alone() -> None:
    built = [build("alice")]
    pipe = Recorder()
    queue_round_trip(pipe, built, "chat")
    assert [cmd[:2] for cmd in pipe.sent] == [("FCALL", sha("turn_submit"))]


def test_with_replica_acks_a_wait_follows_the_script_on_the_same_round_trip() -> None:
    built = [build("alice")]
    pipe = Recorder()
    queue_round_trip(pipe, built, "chat", SubmitOptions(wait=ReplicaWait(1, 50)), {"user": "alice"})
    assert [cmd[0] for cmd in pipe.sent] == ["FCALL", "WAIT", "FCALL"]
    assert pipe.sent[1] == ("WAIT", 1, 50)
    assert committed([[b"1-0"], 1, 1], waited=True, checked=True) == Submitted([], 1, True)


def test_committed_says_whether_the_check_posted_a_pressure_event() -> None:
    assert committed([[b"1-0"], 1], checked=True) == Submitted([], None, True)
    assert committed([[b"1-0"], 0], checked=True) == Submitted([], None, False)
    assert committed([[b"1-0"], redis.ResponseError("NOPERM xinfo")], checked=True) == Submitted([])
    assert committed([[b"1-0"]]) == Submitted([])


@pytest.mark.parametrize("error", [redis.ResponseError("NOPERM fcall"),
                                   redis.ResponseError("WRONGTYPE inbox"),
                                   redis.ResponseError("BADARGS turn count")])
def test_committed_raises_the_scripts_error(error: Exception) -> None:
    with pytest.raises(redis.ResponseError, match=str(error).split()[0]):
        committed([error, 1], checked=True)


# --- whether a tier exists (pure) ---------------------------------------------------------
@pytest.mark.parametrize(("has_policy", "tiers", "defined"), [
    (1, set(), True),
    (0, {b"gpu", b"chat"}, True),
    (0, {"chat"}, True),  # a client with decode_responses
    (0, {b"gpu"}, False),
    (0, set(), False),
])
def test_tier_defined(has_policy: int, tiers: set[Any], defined: bool) -> None:
    assert tier_defined("chat", has_policy, tiers) is defined


def test_heartbeats_of_keeps_the_tiers_workers_and_skips_unreadable_entries() -> None:
    registry = {b"chat-1": info("chat-1", "chat"), b"gpu-1": info("gpu-1", "gpu"),
                b"junk": b"\xc1not msgpack", b"chat-2": info("chat-2", "chat")}
    assert heartbeats_of("chat", registry) == [keys.heartbeat("chat-1"), keys.heartbeat("chat-2")]
    assert heartbeats_of("batch", registry) == []


def test_unknown_tier_is_a_value_error_with_one_line_and_the_way_out() -> None:
    exc = UnknownTier("nosuchtier")
    assert isinstance(exc, ValueError) and exc.tier == "nosuchtier"
    assert "\n" not in str(exc) and "create_tier=True" in str(exc)
    assert fleet.UnknownTier is UnknownTier and "UnknownTier" in fleet.__all__


# --- the tier check over fakeredis ---------------------------------------------------------
@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


class ProbeCounter(fakeredis.FakeRedis):
    """A client that notes the policy key of each tier probe it sends (the round trip that
    reads ``fleet:tiers``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.probed: list[str] = []

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        def noting(*args: Any, **kwargs: Any) -> Any:
            stack = [cmd for cmd, _options in pipe.command_stack]
            if ("SMEMBERS", keys.TIERS) in [tuple(cmd[:2]) for cmd in stack]:
                self.probed += [cmd[1] for cmd in stack if cmd[0] == "EXISTS"]
            return execute(*args, **kwargs)

        pipe.execute = noting  # type: ignore[method-assign]
        return pipe


@pytest.fixture
def fake(server: fakeredis.FakeServer) -> ProbeCounter:
    return ProbeCounter(server=server)


def written(r: fakeredis.FakeRedis, user: str, tier: str = "chat") -> tuple[int, int]:
    return r.xlen(keys.inbox(user)), r.xlen(keys.ready(tier))


def test_a_tier_without_policy_or_live_worker_is_refused_and_nothing_is_written(fake) -> None:
    client = Fleet(client=fake)
    with pytest.raises(UnknownTier, match="'nosuchtier' does not exist"):
        client.submit("alice", "hi", tier="nosuchtier")
    with pytest.raises(UnknownTier):
        client.submit_many([("alice", "a"), ("bob", "b")], tier="nosuchtier")
    assert fake.keys("*") == []


@pytest.mark.parametrize("how", ["policy-key", "tiers-set", "live-worker"])
def test_a_tier_exists_by_its_policy_the_tiers_set_or_a_live_worker(fake, how: str) -> None:
    if how == "policy-key":
        fake.set(keys.policy("gpu"), "{}")  # a raw SET counts, valid or not
    elif how == "tiers-set":
        fake.sadd(keys.TIERS, "gpu")
    else:
        fake.hset(keys.WORKERS, "gpu-1", info("gpu-1", "gpu"))
        fake.set(keys.heartbeat("gpu-1"), "1")
    Fleet(client=fake).submit("alice", "hi", tier="gpu")
    assert written(fake, "alice", "gpu") == (1, 1)
    assert not fake.exists(keys.policy("gpu")) or how == "policy-key"  # nothing was created


def test_a_worker_whose_heartbeat_expired_does_not_make_a_tier(fake) -> None:
    fake.hset(keys.WORKERS, "gpu-1", info("gpu-1", "gpu"))
    fake.hset(keys.WORKERS, "chat-1", info("chat-1", "chat"))
    fake.set(keys.heartbeat("chat-1"), "1")  # alive, but of another tier
    with pytest.raises(UnknownTier):
        Fleet(client=fake).submit("alice", "hi", tier="gpu")


def test_create_tier_writes_the_default_policy_then_submits(fake) -> None:
    Fleet(client=fake).submit("alice", "hi", tier="gpu", create_tier=True)
    read = read_policy(fake, "gpu")
    assert (read.source, read.policy) == ("key", TurnsPolicy())
    assert fake.smembers(keys.TIERS) == {b"gpu"}
    assert written(fake, "alice", "gpu") == (1, 1)


def test_create_tier_leaves_an_existing_policy_alone(fake) -> None:
    write_policy(fake, "gpu", TurnsPolicy(min_workers=3))
    Fleet(client=fake).submit("alice", "hi", tier="gpu", create_tier=True)
    assert read_policy(fake, "gpu").policy.min_workers == 3


def test_a_tier_is_checked_once_per_client_and_a_refused_one_again(fake) -> None:
    client = Fleet(client=fake)
    for _ in range(2):
        with pytest.raises(UnknownTier):
            client.submit("alice", "hi", tier="gpu")
    write_policy(fake, "gpu", TurnsPolicy())
    for i in range(3):
        client.submit_many([("alice", f"t{i}"), ("bob", f"t{i}")], tier="gpu")
    assert fake.probed == [keys.policy("gpu")] * 3  # refused twice (checked each time), then found once
    assert written(fake, "alice", "gpu") == (3, 6)


def test_async_fleet_refuses_creates_and_remembers_like_fleet(server, fake) -> None:
    async def run() -> None:
        client = AsyncFleet(client=fakeredis.FakeAsyncRedis(server=server))
        with pytest.raises(UnknownTier):
            await client.submit("alice", "hi", tier="gpu")
        assert fake.keys("*") == []
        await client.submit("alice", "hi", tier="gpu", create_tier=True)
        assert read_policy(fake, "gpu").source == "key"
        fake.delete(keys.policy("gpu"), keys.TIERS)  # known to this client now: not checked again
        await client.submit("alice", "again", tier="gpu")
        await client.aclose()

    asyncio.run(run())
    assert written(fake, "alice", "gpu") == (2, 2)


def test_async_fleet_finds_a_tier_by_a_live_worker_and_not_by_a_dead_one(server, fake) -> None:
    fake.hset(keys.WORKERS, mapping={"gpu-1": info("gpu-1", "gpu"), "batch-1": info("batch-1", "batch")})
    fake.set(keys.heartbeat("gpu-1"), "1")

    async def run() -> None:
        client = AsyncFleet(client=fakeredis.FakeAsyncRedis(server=server))
        await client.submit("alice", "hi", tier="gpu")
        with pytest.raises(UnknownTier):
            await client.submit("alice", "hi", tier="batch")
        await client.aclose()

    asyncio.run(run())
    assert written(fake, "alice", "gpu") == (1, 1)


def test_a_call_that_succeeds_at_once_builds_no_retry_state(fake, monkeypatch) -> None:
    """tenacity's retry state costs more CPU than a submit: a call meets it only after a
    transient error."""
    def refused(**_kwargs: Any) -> Any:
        raise AssertionError("tenacity's retry state built for a call that succeeded")

    monkeypatch.setattr("fleet.client.Retrying", refused)
    monkeypatch.setattr("fleet.client.AsyncRetrying", refused)
    client = Fleet(client=fake)
    handle = client.submit("alice", "hi", tier="gpu", create_tier=True)
    assert fake.xlen(keys.inbox("alice")) == 1 and handle.turn_id


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "asyncio"])
def test_a_call_is_retried_after_a_transient_error_and_not_after_another(monkeypatch,
                                                                        asynchronous: bool) -> None:
    import asyncio

    import redis

    from fleet import client as fleet_client

    monkeypatch.setattr(fleet_client, "_RETRY_BACKOFF", fleet_client.Backoff(base=0.001, cap=0.002))

    def flaky(errors: list[Exception]) -> Any:
        calls: list[int] = []

        def call() -> int:
            calls.append(1)
            if errors:
                raise errors.pop(0)
            return len(calls)
        return call, calls

    def retried(seconds: float, call: Any) -> Any:
        if not asynchronous:
            return fleet_client._retried(seconds, call)

        async def acall() -> Any:
            return call()
        return asyncio.run(fleet_client._aretried(seconds, acall))

    call, calls = flaky([redis.ConnectionError("reset"), redis.ConnectionError("reset")])
    assert retried(5.0, call) == 3  # twice refused, then served
    call, calls = flaky([ValueError("a bad argument")])
    with pytest.raises(ValueError, match="a bad argument"):
        retried(5.0, call)
    assert len(calls) == 1  # not transient: raised at once
    call, calls = flaky([redis.ConnectionError("reset")] * 5)
    with pytest.raises(redis.ConnectionError):
        retried(0.0, call)  # no time left after the first try
    assert len(calls) == 1
