"""``fleet status`` at 10,000 workers over 50 tiers, on a real redis-server: the tiers carry the
per-tier counts, the worker list is one page (every worker on exactly one page, in a stable
order, filtered by tier), and the output's size does not grow with the workers. Garbage in the
registry is skipped, counted and listed, never a crash."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from fleet.cli import main
from fleet.status import PAGE_SIZE, WorkerPage, snapshot, worker_list
from protocol import keys
from protocol.codec import encode
from protocol.models import WorkerInfo
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from stores.registry import read_registry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
TIERS = [f"t{k:02d}" for k in range(50)]
GARBAGE = {"bad-1": b"\xc1 not msgpack", "bad-2": encode(WorkerInfo(worker="other", tier="t00", pid=1,
                                                                    host="h", started=0))}


def populate(r: redis.Redis, workers: int, garbage: bool = False) -> None:
    """``workers`` registry entries over the 50 tiers (each tier's policy written), every tenth
    of each tier's without a heartbeat (dead); with ``garbage``, two entries that are not workers'."""
    for tier in TIERS:
        write_policy(r, tier, TurnsPolicy(min_workers=1, max_workers=1000))
    pipe = r.pipeline(transaction=False)
    for i in range(workers):
        tier = TIERS[i % len(TIERS)]
        wid = f"{tier}-w{i:05d}"
        pipe.hset(keys.WORKERS, wid, encode(WorkerInfo(worker=wid, tier=tier, pid=10_000 + i, host="sim",
                                                       started=1_700_000_000.0)))
        if (i // len(TIERS)) % 10:  # every tenth of each tier's workers is dead
            pipe.set(keys.heartbeat(wid), "1", ex=600)
        if i % 2000 == 1999:
            pipe.execute()
    if garbage:
        pipe.hset(keys.WORKERS, mapping=GARBAGE)  # type: ignore[arg-type]
    pipe.execute()


def _bytes(snap: dict[str, Any]) -> int:
    return len(json.dumps(snap, indent=2, default=str))  # as `fleet status --json` prints it


def test_status_json_does_not_grow_with_the_workers_and_sums_them_per_tier(r: redis.Redis) -> None:
    populate(r, 1_000)
    small = _bytes(snapshot(r))
    r.flushall()
    populate(r, 10_000)
    snap = snapshot(r)
    big = _bytes(snap)
    print(f"fleet status --json: {small:,} bytes at 1,000 workers, {big:,} at 10,000 (50 tiers)")
    assert big - small < 2_000, (small, big)  # only digits grow (a count per tier)
    assert len(snap["workers"]) == PAGE_SIZE and snap["workers_total"] == 10_000
    t03 = snap["tiers"]["t03"]
    assert (t03["workers_alive"], t03["workers_dead"]) == (180, 20)
    assert sum(t["workers_alive"] + t["workers_dead"] for t in snap["tiers"].values()) == 10_000


def test_pages_hold_every_worker_once_in_a_stable_order_and_a_tier_filter(r: redis.Redis) -> None:
    populate(r, 10_000, garbage=True)
    reg = read_registry(r)
    seen: list[str] = []
    for page in range(1, 12):
        rows, paging = worker_list(reg, WorkerPage(page=page, size=1_000), now=1_700_000_100.0)
        assert paging["total"] == 10_002 and paging["pages"] == 11 and paging["shown"] == len(rows)
        seen += [w["worker"] for w in rows]
    assert len(seen) == len(set(seen)) == 10_002  # the two garbage entries are listed as unreadable
    assert seen == sorted(seen, key=lambda w: ("?" if w.startswith("bad-") else w[:3], w))
    rows, paging = worker_list(reg, WorkerPage(tier="t07", page=2, size=150), now=1_700_000_100.0)
    assert paging["total"] == 200 and [w["tier"] for w in rows] == ["t07"] * 50
    assert rows[-1]["worker"] == "t07-w09957" and rows[0]["age_s"] == 100.0
    past, paging = worker_list(reg, WorkerPage(page=99, size=1_000), now=0.0)
    assert past == [] and paging["shown"] == 0  # a page past the end is empty, not an error


def test_garbage_in_the_registry_is_skipped_counted_and_named(r: redis.Redis) -> None:
    populate(r, 200, garbage=True)
    snap = snapshot(r, page=WorkerPage(tier="t00"))
    assert snap["workers_unreadable"] == 2 and snap["workers_total"] == 4  # t00's four: none unreadable
    assert {e["member"] for e in snap["bad_state"] if e["kind"] == "registry"} == set(GARBAGE)
    assert snap["tiers"]["t00"]["workers_alive"] + snap["tiers"]["t00"]["workers_dead"] == 4


def test_the_text_shows_one_page_and_says_how_to_see_the_rest(r: redis.Redis, redis_server: Any,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    populate(r, 10_000)
    url = ["--redis-url", redis_server.url]
    assert main([*url, "status"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("t") and " sim " in line]
    assert len(rows) == PAGE_SIZE
    assert "workers 1-100 of 10000 shown" in out and "fleet status --page 2" in out
    tier_line = next(line for line in out.splitlines() if line.startswith("t03 "))
    assert tier_line.split()[1:3] == ["180", "20"]  # WORKERS (alive), DEAD WORKERS
    assert main([*url, "status", "--tier", "t07", "--page", "4", "--page-size", "50"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("t07-w")]
    assert len(rows) == 50 and "workers 151-200 of 200 (tier t07) shown" in out
    assert main([*url, "status", "--json", "--all"]) == 0
    assert len(json.loads(capsys.readouterr().out)["workers"]) == 10_000
