"""What a new commander needs to adopt an rq tier's RQ workers: their run records
say they are RQ workers, RQ's worker registry is read for the ones without a record, and only
a worker id of the process runtime's form names a tier."""

from __future__ import annotations

import os
from pathlib import Path

import fakeredis
import pytest

from commander.runtime import Lifecycle, WorkerHandle
from commander.runtime.process.identity import looks_like_rq_worker
from commander.runtime.process.launch import tier_of
from commander.runtime.process.run_records import read_records, write_record
from protocol import keys
from stores.registry import RqEntry, rq_entries


@pytest.mark.parametrize(("worker_id", "tier"), [
    ("writeback-0123abcd", "writeback"),
    ("eval-runs-deadbeef", "eval-runs"),
    ("writeback-0123ABCD", None),  # not hex of ours
    ("writeback-0123abc", None),
    ("relay-1", None),
    ("rq-1a2b3c4d", "rq"),
])
def test_tier_of_a_worker_id(worker_id: str, tier: str | None) -> None:
    assert tier_of(worker_id) == tier


@pytest.mark.parametrize(("member", "name"), [
    ("rq:worker:writeback-0123abcd", "writeback-0123abcd"),
    ("rq:worker:", None),
    ("rq:worker:a b", None),
    ("fleet:workers", None),
])
def test_rq_worker_names_from_the_registry_set(member: str, name: str | None) -> None:
    assert keys.rq_worker_name(member) == name


def test_run_records_say_which_workers_are_rq_workers(tmp_path: Path) -> None:
    for wid, rq in (("writeback-0123abcd", True), ("chat-0123abcd", False)):
        write_record(tmp_path, WorkerHandle(wid, wid.split("-")[0], 1, Lifecycle.RUNNING, 1.0), None, rq=rq)
    (tmp_path / "old-00000000.json").write_text('{"worker": "old-00000000", "tier": "old", "pid": 1, '
                                                '"started": 1.0}')  # written before the flag
    assert {rec["worker"]: rec["rq"] for rec in read_records(tmp_path)} == {
        "writeback-0123abcd": True, "chat-0123abcd": False, "old-00000000": False}


def test_rq_entries_skip_incomplete_and_foreign_members() -> None:
    r = fakeredis.FakeRedis()
    r.sadd(keys.RQ_WORKERS, "rq:worker:writeback-0123abcd", "rq:worker:half-00000000",
           "rq:worker:gone-00000000", "not-a-worker-key")
    r.hset("rq:worker:writeback-0123abcd", mapping={"hostname": "vm", "pid": 42,
                                                    "birth": "2026-12-03T23:09:01.500000Z"})
    r.hset("rq:worker:half-00000000", mapping={"hostname": "vm", "pid": 43})  # registering: no birth yet
    (entry,) = rq_entries(r)
    assert entry == RqEntry("writeback-0123abcd", "vm", 42, 1796339341.5)


def test_an_rq_worker_is_recognised_by_its_name_and_age() -> None:
    me = os.getpid()  # this process: not named like the worker, so never taken for it
    assert looks_like_rq_worker(me, "writeback-0123abcd", started=4e9) is None
    assert looks_like_rq_worker(2**22 + 1, "writeback-0123abcd", started=4e9) is None  # no such pid
