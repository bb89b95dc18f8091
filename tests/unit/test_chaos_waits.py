"""The chaos run measures each turn's wait on its own (scripts/chaos.py ``user_loop``).

A user submits several turns at once and then waits for their replies. The replies were polled
one after the other, so a turn after one that a failover lost was only looked at once the lost
one's poll gave up: its wait read 172 s where its reply had come within a second (a cluster run
with ``replica_acks`` 1, seed 11: the "longest wait" of the table was the harness's own)."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from typing import Any

from tests.conftest import ROOT

if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import chaos  # noqa: E402  (after the path)
from chaos_check import UserLog  # noqa: E402

from protocol import keys  # noqa: E402


class Replies:
    """The reply lists of the turns that have one: the first turn of the batch never does."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    async def llen(self, key: str) -> int:
        return int(key in self.at and time.monotonic() >= self.at[key])


class FakeFleet:
    def __init__(self) -> None:
        self.r = Replies()
        self.unreplicated: set[str] = set()

    async def submit(self, user: str, text: str, turn_id: str, **_: Any) -> str:
        if not turn_id.endswith("-0"):  # every turn but the first is answered at once
            self.r.at[keys.reply(user, turn_id)] = time.monotonic()
        return turn_id


async def test_a_turn_behind_a_lost_one_is_timed_by_its_own_reply() -> None:
    fleet, log, stop = FakeFleet(), UserLog(), asyncio.Event()
    seed = next(s for s in range(100) if random.Random(s).choice((1, 1, 2, 3)) > 1)
    first = random.Random(seed).choice((1, 1, 2, 3))  # the turns of the first batch
    rng = random.Random(seed)
    loop = asyncio.create_task(chaos.user_loop(fleet, fleet.r, "u1", log, stop, rng,  # type: ignore[arg-type]
                                               grace_s=0.0))
    behind = [f"u1-{n}" for n in range(1, first)]
    assert behind
    try:  # polled one after the other, they would be looked at only once the lost one's poll ends
        async with asyncio.timeout(2.0):
            while not all(t in log.answered for t in behind):
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(loop, 10)
    assert "u1-0" not in log.answered  # lost: never answered
    assert max(log.answered[t] for t in behind) < 0.3, log.answered  # each timed by its own reply
