"""Two workers meet a weight change at other moments (one has refreshed its policy, the other
not yet), and the user's turns go to one or the other in turn: the user moves once, at one turn
boundary, and never back within the change; an abort moves it back once. The record is the
user's own (``@<tier>`` in its pins hash), written by a compare-and-set (``group_record.lua``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest
import redis

from protocol import keys
from protocol.groups import Group, Rollout, assign
from protocol.policy import TurnsPolicy
from stores.connection import connect_async
from stores.group_assignment import user_pins
from stores.policies import write_policy
from worker.settings import WorkerSettings
from worker.tier_policy import TierPolicy

if TYPE_CHECKING:
    from tests.conftest import RedisServer

pytestmark = pytest.mark.integration
BEFORE = (Group(name="blue", weight=100), Group(name="green", weight=0))
DURING = (Group(name="blue", weight=50), Group(name="green", weight=50))


def weights(policy: tuple[Group, ...]) -> tuple[tuple[str, float], ...]:
    return tuple((g.name, g.weight) for g in policy)


async def no_op() -> None:
    return None


@pytest.fixture
async def workers(redis_server: RedisServer) -> AsyncIterator[tuple[TierPolicy, TierPolicy]]:
    clients = [connect_async(redis_server.role_url("fleet-worker")) for _ in range(2)]
    views = tuple(TierPolicy(c, WorkerSettings(tier="chat", worker_id=f"w{i}"), no_op, lambda _p: None)
                  for i, c in enumerate(clients))
    yield views[0], views[1]
    for c in clients:
        await c.aclose()


async def test_a_weight_change_moves_a_user_once_however_the_workers_views_interleave(
        r: redis.Redis, workers: tuple[TierPolicy, TierPolicy]) -> None:
    a, b = workers
    movers = [u for u in (f"m{i}" for i in range(200)) if assign(u, weights(DURING)) == "green"][:10]
    write_policy(r, "chat", TurnsPolicy(rollout=Rollout(groups=BEFORE)))
    await a.refresh()
    await b.refresh()
    for user in movers:
        assert await a.pool_of(user, "chat") == "chat.blue"

    write_policy(r, "chat", TurnsPolicy(rollout=Rollout(groups=DURING)))  # the rollout
    await a.refresh()  # a sees it, b not yet
    served = {u: [await w.pool_of(u, "chat") for w in (a, b, a, b, b)] for u in movers}
    assert all(s == ["chat.green"] * 5 for s in served.values()), served  # moved once, at a's turn

    write_policy(r, "chat", TurnsPolicy(rollout=Rollout(groups=BEFORE)))  # the abort
    await b.refresh()  # now b sees it first, a is behind
    served = {u: [await w.pool_of(u, "chat") for w in (a, b, a, b)] for u in movers}
    # a (behind) keeps the user where it is until b, which saw the abort, moves it back for good
    assert all(s == ["chat.green", "chat.blue", "chat.blue", "chat.blue"] for s in served.values()), served
    assert user_pins(r, movers[0]) == {}  # the record is not a pin
    assert r.hget(keys.pins(movers[0]), "@chat") is not None
