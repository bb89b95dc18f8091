"""Property: whatever the keys the commander and ``fleet status`` read hold — any Redis type, any
bytes, entries that almost decode — their readers do not raise, and a commander's pass ends.

On a real redis-server (its ``WRONGTYPE`` replies are the ones met in the field); each example
starts from an empty database."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from commander.decide_states import DecideStates
from commander.metrics import Metrics
from commander.observe import Observer
from fleet.status import snapshot
from protocol import keys
from protocol.codec import encode
from protocol.models import CommanderInfo, WorkerInfo
from protocol.policy import turns_policy
from stores.bad_state import BadState
from stores.commanders import read_commanders
from stores.group_assignment import known_pools, read_pin_and_record, read_pins, rejected_groups
from stores.policies import list_tiers, read_policy, read_policy_status
from stores.registry import read_registry
from tests.unit.commander_helpers import RecordingRuntime, leading

pytestmark = pytest.mark.integration

# every key the commander's pass and `fleet status` read as shared state
KEYS = (keys.TIERS, keys.WORKERS, keys.COMMANDERS, keys.REPORTS, keys.policy("chat"),
        keys.policy_good("chat"), keys.policy_status("chat", ""), keys.pools("chat"),
        keys.groups_rejected("chat"), keys.pins("alice"), keys.decide_state("chat"),
        keys.pressure("chat"))

# values that almost make sense: a valid entry of another kind, a bad id, JSON of the wrong shape
NEAR = [
    encode(WorkerInfo(worker="w1", tier="chat", pid=1, host="h", started=1.0)),
    encode(WorkerInfo(worker="w 1!", tier="Bad Tier!", pid=1, host="h", started=1.0)),
    encode(CommanderInfo(commander="c9", pid=1, host="h", started=1.0, seen=time.time())),
    turns_policy(max_workers=2).to_json().encode(), b'{"max_workers": "many"}', b"[]", b"{}", b"null",
    b'{"history": [["x", 1]]}', b'{"history": [], "last_scale_up": "soon"}', b"chat", b"chat.blue",
    b"Bad Tier!", b"w1", b"\xff\xfe", b"",
]
values = st.one_of(st.sampled_from(NEAR), st.binary(max_size=16))
fields = st.one_of(st.sampled_from([b"w1", b"c9", b"chat", b"m", b"ok", b"error", b"bad id!"]),
                   st.binary(min_size=1, max_size=8))


def _writer(kind: str, data: Any) -> Callable[[redis.Redis, str], object]:
    def write(r: redis.Redis, key: str) -> object:
        if kind == "string":
            return r.set(key, data[0])
        if kind == "hash":
            return r.hset(key, mapping=dict(data))
        if kind == "list":
            return r.rpush(key, *data)
        if kind == "set":
            return r.sadd(key, *data)
        if kind == "zset":
            return r.zadd(key, {v: i for i, v in enumerate(data)})
        return [r.xadd(key, dict([pair])) for pair in data]  # stream
    return write


writes = st.one_of(
    st.none(),  # the key left alone (absent)
    st.builds(_writer, st.just("string"), st.lists(values, min_size=1, max_size=1)),
    *(st.builds(_writer, st.just(kind), st.lists(st.tuples(fields, values), min_size=1, max_size=4))
      for kind in ("hash", "stream")),
    *(st.builds(_writer, st.just(kind), st.lists(values, min_size=1, max_size=4))
      for kind in ("list", "set", "zset")),
)


def _read_everything(r: redis.Redis, url: str) -> None:
    """Every reader of those keys, as the commander and `fleet status` call them."""
    bad = BadState()
    list_tiers(r, bad)
    read_registry(r, bad)
    read_commanders(r, bad=bad)
    read_policy(r, "chat", ["echo"], record=True, reader="w1")
    read_policy_status(r, "chat")
    rejected_groups(r, "chat")
    known_pools(r, "chat", bad)
    read_pins(r, ["alice", "bob"], "chat", bad)
    DecideStates(r, bad).get("chat")
    observer = Observer(r, bad=bad)
    observer.read_reports()  # the newest (XREVRANGE) ...
    observer.read_reports()  # ... then those after (XREAD)
    observer.wait_for_pressure(["chat", "other"], 1)
    observer.wait_for_pressure(["chat", "other"], 1)
    snapshot(r)

    async def pin() -> None:
        aio = aioredis.Redis.from_url(url)
        try:
            await read_pin_and_record(aio, "alice", "chat")
        finally:
            await aio.aclose()

    asyncio.run(pin())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries({key: writes for key in KEYS}))
def test_no_reader_raises_and_a_pass_ends_whatever_the_keys_hold(r, redis_server, chosen) -> None:
    r.flushall()
    for key, write in chosen.items():
        if write is not None:
            write(r, key)

    _read_everything(r, redis_server.url)
    runtime = RecordingRuntime()
    commander = leading(r, runtime, Metrics(), always_tiers=("chat",))
    commander.pass_once(time.time())
    commander.presence.register()
    seen = commander.board.seen
    assert seen is not None and "chat" in seen.tiers  # the good tier is still judged


def _decides(port: int) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("fleet_decide_seconds_count"))


@pytest.fixture
def running_fleet(r, redis_server, start_commander):
    """A commander serving tier ``chat`` (one echo worker), and its /metrics port."""
    from stores.policies import write_policy
    from tests.conftest import free_port
    from tests.helpers import wait_until

    write_policy(r, "chat", turns_policy(handler="echo", min_workers=1, max_workers=2))
    port = free_port()
    commander = start_commander("c1", "--metrics-port", str(port), metrics=True)
    wait_until(lambda: read_registry(r).live("chat"), 30, "chat's worker")
    yield commander, port
    for key in KEYS:  # (the fixtures' teardown reads the registry and the commanders itself)
        if key not in (keys.policy("chat"), keys.policy_good("chat")):
            r.delete(key)
    r.delete(keys.WORKERS, keys.COMMANDERS)


# the key's last good copy left alone: it is what a tier with a bad key runs (with both gone, the
# tier runs the default policy, by design); shrinking left out: each example runs real processes
@settings(max_examples=8, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries({key: writes for key in KEYS if key != keys.policy_good("chat")}))
def test_a_running_commander_survives_and_another_user_is_served(r, redis_server, running_fleet,
                                                                  chosen) -> None:
    from fleet.client import Fleet
    from tests.helpers import wait_until

    commander, port = running_fleet
    for key, write in chosen.items():
        if write is not None:
            r.delete(key)
            write(r, key)
    before = _decides(port)
    wait_until(lambda: _decides(port) >= before + 2 or not commander.alive(), 20, "two more passes")
    assert commander.alive(), commander.tail()
    reply = Fleet(redis_server.role_url("fleet-client")).submit("bob", "still there?").result(30)
    assert reply.ok and reply.text.endswith("still there?")
