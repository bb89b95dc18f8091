"""The ordered submit on Redis Cluster: every inbox entry is acknowledged in an earlier round
trip than any notification; a refused inbox entry gets no notification and is raised; no
``MULTI`` or script is sent to a cluster. And the single-node path is one round trip: the
submit script (``turn_submit.lua``) and the pressure check after it.

The client here is a recording fake: each ``execute`` of one of its pipelines (and each direct
command) is one round trip, recorded with its commands (the client's first two, which read
whether the tier exists and its submit options, apart in ``probes``); ``is_cluster`` is told
which fakes are clusters. The same on a real 3-master cluster: tests/cluster/test_submit_order.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis

import fleet
import fleet.client
import stores.cluster
from fleet.client import AsyncFleet, Fleet, SubmitNotNotified
from protocol import keys
from stores.functions import LibraryMissing
from stores.functions import function_name as sha

Command = tuple[str, str]


class FakeClient:
    """Records round trips; answers like Redis (``MULTI`` queues, ``EXEC`` answers the queue)."""

    def __init__(self, cluster: bool, *, lag: int = 0) -> None:
        self.cluster = cluster
        self.trips: list[list[Command]] = []
        self.probes: list[list[Command]] = []  # the tier check and the submit options read
        self.fail: dict[Command, Exception] = {}  # a command's error reply
        self.drop_trip: int | None = None  # this round trip's connection is lost (it raises)
        self.lag = lag
        self.response_callbacks: dict[str, Any] = {}
        self.seq = 0
        self.alone: list[int] = []  # the round trips sent as one command, not on a pipeline

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> FakePipe:
        return FakePipe(self)

    def reply(self, cmd: Command) -> Any:
        if cmd in self.fail:
            return self.fail[cmd]
        name = cmd[0]
        if name == "XADD":
            self.seq += 1
            return f"1-{self.seq}".encode()
        if name == "ZADD":
            return 1
        if name == "XINFO GROUPS":
            return [{"name": keys.GROUP.encode(), "lag": self.lag}]
        if name == "GET":
            return None
        if name == "EXISTS":  # the tier's policy key: the tier exists
            return 1
        if name == "SMEMBERS":
            return set()
        if name == "HGETALL":
            return {}
        if name == "FCALL" and not self.cluster:  # the single-node submit and pressure check
            return 0 if cmd[1] == sha("submit_pressure") else [b"1-1"]
        raise AssertionError(f"unexpected command {cmd}")

    def run(self, commands: list[Command]) -> list[Any]:
        if set(commands) <= PROBES:
            self.probes.append(list(commands))
            return [self.reply(cmd) for cmd in commands]
        self.trips.append(list(commands))
        if self.drop_trip == len(self.trips) - 1:
            raise redis.ConnectionError("connection lost")
        out: list[Any] = []
        queue: list[Any] | None = None
        for cmd in commands:
            if cmd[0] == "MULTI":
                assert not self.cluster, "MULTI sent to a cluster"
                queue = []
                out.append(b"OK")
            elif cmd[0] == "EXEC":
                assert queue is not None
                out.append(queue)
                queue = None
            elif queue is not None:
                queue.append(self.reply(cmd))
                out.append(b"QUEUED")
            else:
                out.append(self.reply(cmd))
        return out

    def xadd(self, key: str, fields: dict[str, Any], **_: Any) -> Any:
        return self.run([("XADD", key)])[0]

    def execute_command(self, *args: Any) -> Any:  # one command, its own round trip
        self.alone.append(len(self.trips))
        reply = self.run([(str(args[0]), str(args[1]) if len(args) > 1 else "")])[0]
        if isinstance(reply, Exception):
            raise reply
        return reply


class FakePipe:
    def __init__(self, owner: FakeClient) -> None:
        self.owner = owner
        self.queued: list[Command] = []
        self.response_callbacks: dict[str, Any] = {}

    def execute_command(self, *args: Any) -> None:
        self.queued.append((str(args[0]), str(args[1]) if len(args) > 1 else ""))  # name, key

    def xadd(self, key: str, fields: dict[str, Any], **_: Any) -> None:
        self.queued.append(("XADD", key))

    def zadd(self, key: str, mapping: dict[str, float]) -> None:
        self.queued.append(("ZADD", key))

    def xinfo_groups(self, key: str) -> None:
        self.queued.append(("XINFO GROUPS", key))

    def get(self, key: str) -> None:
        self.queued.append(("GET", key))

    def exists(self, key: str) -> None:
        self.queued.append(("EXISTS", key))

    def smembers(self, key: str) -> None:
        self.queued.append(("SMEMBERS", key))

    def hgetall(self, key: str) -> None:
        self.queued.append(("HGETALL", key))

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        assert raise_on_error is False or set(self.queued) <= PROBES  # a submit reads every reply
        return self.owner.run(self.queued)


class AsyncFakeClient(FakeClient):
    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> AsyncFakePipe:
        return AsyncFakePipe(self)

    async def xadd(self, key: str, fields: dict[str, Any], **_: Any) -> Any:
        return self.run([("XADD", key)])[0]

    async def execute_command(self, *args: Any) -> Any:  # type: ignore[override]
        return super().execute_command(*args)


class AsyncFakePipe(FakePipe):
    async def execute(self, raise_on_error: bool = True) -> list[Any]:  # type: ignore[override]
        assert raise_on_error is False or set(self.queued) <= PROBES
        return self.owner.run(self.queued)


@pytest.fixture(autouse=True)
def fakes_say_if_they_are_clusters(monkeypatch: pytest.MonkeyPatch) -> None:
    real = stores.cluster.is_cluster

    def is_cluster(r: Any) -> bool:
        return r.cluster if isinstance(r, FakeClient) else real(r)

    monkeypatch.setattr(fleet.client, "is_cluster", is_cluster)


USERS = ["alice", "bob", "carol", "alice"]
# the registry is read only for a tier no policy names
TIER_PROBE = [("EXISTS", keys.policy("chat")), ("SMEMBERS", keys.TIERS)]
OPTIONS_PROBE = [("GET", keys.policy("chat")), ("GET", keys.policy_good("chat")),
                 ("HGETALL", keys.groups_rejected("chat"))]
PROBES = set(TIER_PROBE + OPTIONS_PROBE)


def submit(mode: str, fake_cluster: bool = True, users: list[str] = USERS,
           setup: Callable[[FakeClient], None] = lambda c: None,
           retry_s: float = 0) -> tuple[FakeClient, Callable[[], Any]]:
    """A fake of ``mode`` ("sync"/"async", "many"/"one") and the call that submits on it (sent
    once unless ``retry_s``: what one submit's round trips do)."""
    sync = mode.startswith("sync")
    fake = (FakeClient if sync else AsyncFakeClient)(fake_cluster)
    setup(fake)
    many = mode.endswith("many")
    turns = [(u, f"turn {i}") for i, u in enumerate(users if many else users[:1])]
    if sync:
        client = Fleet(client=fake, retry_s=retry_s)  # type: ignore[arg-type]
        return fake, lambda: client.submit_many(turns) if many else client.submit(*turns[0])
    aclient = AsyncFleet(client=fake, retry_s=retry_s)  # type: ignore[arg-type]
    if many:
        return fake, lambda: asyncio.run(aclient.submit_many(turns))
    return fake, lambda: asyncio.run(aclient.submit(*turns[0]))


MODES = ["sync-one", "sync-many", "async-one", "async-many"]

NOTIFY = [("XADD", keys.ready("chat")), ("ZADD", keys.active("chat"))]
GAUGES = [("XINFO GROUPS", keys.ready("chat")), ("GET", keys.starting("chat"))]


def inbox(user: str) -> Command:
    return ("XADD", keys.inbox(user))


def sent(fake: FakeClient) -> list[Command]:
    return [cmd for trip in fake.trips for cmd in trip]


def trip_of(fake: FakeClient, cmd: Command) -> list[int]:
    return [i for i, trip in enumerate(fake.trips) if cmd in trip]


# --- on a cluster -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_every_inbox_entry_is_acknowledged_a_round_trip_before_any_notification(mode: str) -> None:
    fake, call = submit(mode)
    call()
    users = USERS if mode.endswith("many") else USERS[:1]
    assert fake.trips == [[inbox(u) for u in users], NOTIFY * len(users) + GAUGES]
    last_inbox = max(i for u in users for i in trip_of(fake, inbox(u)))
    assert last_inbox < min(trip_of(fake, NOTIFY[0]))
    assert not {("MULTI", ""), ("EXEC", "")} & set(sent(fake))


@pytest.mark.parametrize("mode", MODES)
def test_pressure_is_posted_after_the_notifications(mode: str) -> None:
    def lagging(fake: FakeClient) -> None:
        fake.lag = 5

    fake, call = submit(mode, setup=lagging)
    call()
    assert len(fake.trips) == 3 and fake.trips[2] == [("XADD", keys.pressure("chat"))]
    assert ("MULTI", "") not in sent(fake)


@pytest.mark.parametrize("mode", ["sync-many", "async-many"])
def test_a_refused_inbox_entry_gets_no_notification_and_is_raised(mode: str) -> None:
    def refuse_bob(fake: FakeClient) -> None:
        fake.fail[inbox("bob")] = redis.ResponseError("OOM command not allowed")

    fake, call = submit(mode, setup=refuse_bob)
    with pytest.raises(redis.ResponseError, match="OOM"):
        call()
    # bob's turn is not submitted; the others were written and are notified (as a runtime error
    # inside the single-node EXEC leaves the others applied)
    assert fake.trips == [[inbox(u) for u in USERS], NOTIFY * 3 + GAUGES]


@pytest.mark.parametrize("mode", MODES)
def test_every_inbox_entry_refused_writes_no_notification_at_all(mode: str) -> None:
    def refuse_all(fake: FakeClient) -> None:
        for u in USERS:
            fake.fail[inbox(u)] = redis.ResponseError("NOPERM no xadd")

    fake, call = submit(mode, setup=refuse_all)
    with pytest.raises(redis.ResponseError, match="NOPERM"):
        call()
    assert len(fake.trips) == 1 and NOTIFY[0] not in sent(fake)


@pytest.mark.parametrize("mode", MODES)
def test_the_inbox_round_trip_lost_raises_and_writes_no_notification(mode: str) -> None:
    def drop_first(fake: FakeClient) -> None:
        fake.drop_trip = 0

    fake, call = submit(mode, setup=drop_first)
    with pytest.raises(redis.ConnectionError):
        call()
    assert len(fake.trips) == 1 and NOTIFY[0] not in sent(fake)


@pytest.mark.parametrize("mode", MODES)
def test_notifications_lost_after_the_inbox_raise_submit_not_notified_naming_the_turns(mode: str) -> None:
    def drop_second(fake: FakeClient) -> None:
        fake.drop_trip = 1

    fake, call = submit(mode, setup=drop_second)
    with pytest.raises(SubmitNotNotified) as caught:
        call()
    users = USERS if mode.endswith("many") else USERS[:1]
    assert [t.user for t in caught.value.turns] == users
    assert isinstance(caught.value.__cause__, redis.ConnectionError)
    assert isinstance(caught.value, redis.RedisError) and "same turn_id" in str(caught.value)
    assert len(fake.trips) == 2  # no pressure, nothing else


@pytest.mark.parametrize("mode", MODES)
def test_the_client_sends_a_submit_whose_notifications_were_lost_again(mode: str) -> None:
    def drop_second(fake: FakeClient) -> None:
        fake.drop_trip = 1

    fake, call = submit(mode, setup=drop_second, retry_s=5)
    call()  # no error: the whole submit was sent again, with the same turn ids
    turns = len(USERS) if mode.endswith("many") else 1
    assert len(fake.trips) == 4 and sent(fake).count(NOTIFY[0]) == 2 * turns


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_notification_raises_submit_not_notified(mode: str) -> None:
    def refuse_ready(fake: FakeClient) -> None:
        fake.fail[NOTIFY[0]] = redis.ResponseError("WRONGTYPE ready")

    fake, call = submit(mode, setup=refuse_ready)
    with pytest.raises(SubmitNotNotified, match="WRONGTYPE") as caught:
        call()
    assert isinstance(caught.value.__cause__, redis.ResponseError)
    assert len(fake.trips) == 2


def test_a_refused_notification_outranks_an_inbox_refusal() -> None:
    def both(fake: FakeClient) -> None:
        fake.fail[inbox("bob")] = redis.ResponseError("OOM inbox")
        fake.fail[NOTIFY[1]] = redis.ResponseError("OOM active")

    fake, call = submit("sync-many", setup=both)
    with pytest.raises(SubmitNotNotified) as caught:
        call()
    assert [t.user for t in caught.value.turns] == ["alice", "carol", "alice"]


def test_submit_not_notified_is_exported() -> None:
    assert fleet.SubmitNotNotified is SubmitNotNotified and "SubmitNotNotified" in fleet.__all__


# --- on one node: one script call ----------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_one_node_is_one_script_round_trip(mode: str) -> None:
    fake, call = submit(mode, fake_cluster=False)
    call()
    assert fake.trips == [[("FCALL", sha("turn_submit")), ("FCALL", sha("submit_pressure"))]]


@pytest.mark.parametrize("mode", MODES)
def test_one_node_a_submit_with_nothing_beside_the_script_sends_it_alone(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No pressure check due and no WAIT: the script is one command, no pipeline (which costs
    the client more than the command: scripts/bench_client)."""
    monkeypatch.setattr(fleet.client, "PRESSURE_CHECK_S", 3600.0)  # the first submit's check only
    fake, call = submit(mode, fake_cluster=False)
    call()
    call()
    assert fake.trips == [[("FCALL", sha("turn_submit")), ("FCALL", sha("submit_pressure"))],
                          [("FCALL", sha("turn_submit"))]]
    assert fake.alone == [1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("error", "raised"), [
    (redis.ResponseError("WRONGTYPE fleet:u:{alice}:inbox holds a string"), redis.ResponseError),
    (redis.ResponseError("Function not found"), LibraryMissing)])
def test_one_node_the_script_sent_alone_raises_as_in_a_pipeline(
        mode: str, error: Exception, raised: type[Exception], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet.client, "PRESSURE_CHECK_S", 3600.0)
    fake, call = submit(mode, fake_cluster=False)
    call()
    fake.fail[("FCALL", sha("turn_submit"))] = error
    with pytest.raises(raised, match="WRONGTYPE" if raised is redis.ResponseError else "fleet install"):
        call()
    assert fake.trips[-1] == [("FCALL", sha("turn_submit"))] and fake.alone == [len(fake.trips) - 1]


@pytest.mark.parametrize("mode", MODES)
def test_a_clients_first_submit_reads_whether_the_tier_exists_and_its_options_first(mode: str) -> None:
    fake, call = submit(mode)
    call()
    assert fake.probes == [TIER_PROBE, OPTIONS_PROBE]
