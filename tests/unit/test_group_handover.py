"""Workers of two groups of one tier (fakeredis): each user is served by its group only, and a
user who moves group (a pin, a weight change) finishes the turn in progress where it was and
has the next one served by the new group, in order (the hand-over between tiers, per group)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import fakeredis
import pytest

from fleet.client import AsyncFleet
from protocol import keys
from protocol.codec import decode
from protocol.groups import assign
from protocol.models import SessionEntry
from protocol.policy import parse_policy
from stores.policies import write_policy
from worker.app import Worker
from worker.settings import WorkerSettings

WEIGHTS = [("blue", 50.0), ("green", 50.0)]
# max_attempts 1: a hand-over must not count as an attempt (else a moved user is dead-lettered)
POLICY = parse_policy({"concurrency": 4, "max_attempts": 1,
                       "groups": [{"name": n, "weight": w} for n, w in WEIGHTS]})
USERS = [f"user-{i}" for i in range(8)]


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[fakeredis.FakeAsyncRedis, AsyncFleet]]:
    async for r, client, _workers in _fleet():
        yield r, client


@pytest.fixture
async def fleet_workers() -> AsyncIterator[tuple[fakeredis.FakeAsyncRedis, AsyncFleet, list[Worker]]]:
    async for one in _fleet():
        yield one


async def _fleet() -> AsyncIterator[tuple[fakeredis.FakeAsyncRedis, AsyncFleet, list[Worker]]]:
    r = fakeredis.FakeAsyncRedis()
    await write_policy(r, "chat", POLICY)
    workers = [Worker(WorkerSettings(worker_id=f"w-{g}", tier="chat", group=g, block_ms=50,
                                     policy_refresh_s=0.05), r=r) for g in ("blue", "green")]
    runs = [asyncio.ensure_future(w.run()) for w in workers]
    try:
        yield r, AsyncFleet(client=r), workers
    finally:
        for w in workers:
            w.drain("test over")
        await asyncio.wait(runs, timeout=10)
        assert all(run.done() and run.result() == 0 for run in runs)
        await r.aclose()


async def session_texts(r: fakeredis.FakeAsyncRedis, user: str) -> list[str]:
    return [decode(SessionEntry, raw).text for raw in await r.lrange(keys.session(user), 0, -1)]


async def test_each_user_is_served_by_its_group_in_order(
        fleet: tuple[fakeredis.FakeAsyncRedis, AsyncFleet]) -> None:
    r, client = fleet
    turns = await client.submit_many([(u, f"{u} {n}") for n in range(3) for u in USERS])
    replies = [await client.wait(t.user, t.turn_id, timeout=5) for t in turns]
    groups = {assign(u, WEIGHTS) for u in USERS}
    assert groups == {"blue", "green"}  # (the table's users fall in both)
    for turn, reply in zip(turns, replies, strict=True):
        assert reply.ok and reply.worker == f"w-{assign(turn.user, WEIGHTS)}", (turn.user, reply.worker)
    for user in USERS:
        assert await session_texts(r, user) == [f"{user} {n}" for n in range(3)]


async def test_a_pinned_user_is_handed_to_its_group_between_turns(
        fleet: tuple[fakeredis.FakeAsyncRedis, AsyncFleet]) -> None:
    r, client = fleet
    user = next(u for u in USERS if assign(u, WEIGHTS) == "blue")
    first = await client.submit(user, "one")
    assert (await client.wait(user, first.turn_id, timeout=5)).worker == "w-blue"
    await r.hset(keys.pins(user), "chat", "green")  # (stores.group_assignment.pin_group, on the async client)
    # the client still sends it to blue (it knows no pins): blue's worker hands it over
    later = await client.submit_many([(user, "two"), (user, "three")])
    replies = [await client.wait(user, t.turn_id, timeout=5) for t in later]
    assert [(rep.ok, rep.worker, rep.attempts) for rep in replies] == [(True, "w-green", 1)] * 2, replies
    assert await session_texts(r, user) == ["one", "two", "three"]


async def test_a_weight_change_moves_users_between_turns(
        fleet_workers: tuple[fakeredis.FakeAsyncRedis, AsyncFleet, list[Worker]]) -> None:
    r, client, workers = fleet_workers
    blue_users = [u for u in USERS if assign(u, WEIGHTS) == "blue"]
    before = await client.submit_many([(u, "before") for u in blue_users])
    assert {(await client.wait(t.user, t.turn_id, timeout=5)).worker for t in before} == {"w-blue"}
    all_green = parse_policy({**POLICY.model_dump(mode="json"), "groups": [
        {"name": "blue", "weight": 0}, {"name": "green", "weight": 100}]})
    await write_policy(r, "chat", all_green)
    async with asyncio.timeout(5):  # the workers' policy refresh (every 50 ms)
        while any(w.tier_policy.whole is None  # (written with the next epoch: compared by weights)
                  or w.tier_policy.whole.rollout.weights() != all_green.rollout.weights() for w in workers):
            await asyncio.sleep(0.01)
    client.reread_policies()
    after = await client.submit_many([(u, "after") for u in blue_users])
    assert {(await client.wait(t.user, t.turn_id, timeout=5)).worker for t in after} == {"w-green"}
    for user in blue_users:
        assert await session_texts(r, user) == ["before", "after"]
