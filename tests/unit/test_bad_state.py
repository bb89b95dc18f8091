"""Every reader of shared state survives a bad entry: it skips it, warns once, counts it, and
the commander and ``fleet status`` go on with the good ones."""

from __future__ import annotations

import asyncio
import logging
import time

import fakeredis
import pytest

from commander.decide_states import DecideStates
from commander.metrics import Metrics, sample
from commander.observe import Observer
from fleet.status import snapshot
from protocol import keys
from protocol.codec import encode
from protocol.models import CommanderInfo, WorkerInfo
from protocol.policy import turns_policy
from stores import registry
from stores.bad_state import BadState
from stores.commanders import commander_entries, read_commanders
from stores.group_assignment import known_pools, read_pin_and_record, read_pins, rejected_groups
from stores.policies import list_tiers, read_policy, read_policy_status, write_policy
from stores.registry import read_registry
from tests.unit.commander_helpers import RecordingRuntime, leading


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


def kinds(bad: BadState) -> list[tuple[str, str, str]]:
    return [(e.kind, e.key, e.member) for e in bad.entries]


def info(worker: str = "w1", tier: str = "chat") -> bytes:
    return encode(WorkerInfo(worker=worker, tier=tier, pid=1, host="h", started=1.0))


# --- the tier set -------------------------------------------------------------------------------
def test_a_member_no_tier_can_have_is_skipped_and_named(r) -> None:
    r.sadd(keys.TIERS, "chat", "Bad Tier!", b"\xff\xfe")
    bad = BadState()
    assert list_tiers(r, bad) == ["chat"]
    assert sorted(kinds(bad)) == [("tier", keys.TIERS, "Bad Tier!"), ("tier", keys.TIERS, "\ufffd\ufffd")]


def test_a_tier_set_of_the_wrong_type_is_skipped_and_policy_keys_still_count(r) -> None:
    r.set(keys.TIERS, "not a set")
    r.set(keys.policy("chat"), turns_policy().to_json())
    bad = BadState()
    assert list_tiers(r, bad) == ["chat"]
    assert kinds(bad) == [("tier", keys.TIERS, "")]
    assert "WRONGTYPE" in bad.entries[0].reason


# --- the registry -------------------------------------------------------------------------------
@pytest.mark.parametrize("field, blob, why", [
    ("w2", b"\x00garbage", "decode"),
    ("w3", "{}", "decode"),
    ("bad id!", None, "worker id"),  # (None: a valid entry for that field's own id)
    ("w4", "tier", "tier"),
    ("w5", "other", "names"),
])
def test_a_registry_entry_that_fails_validation_is_skipped(r, field, blob, why) -> None:
    r.hset(keys.WORKERS, "w1", info())
    r.set(keys.heartbeat("w1"), "1")
    if blob is None:
        blob = info(field)
    elif blob == "tier":
        blob = info(field, tier="Bad Tier!")
    elif blob == "other":
        blob = info("w6")
    r.hset(keys.WORKERS, field, blob)
    bad = BadState()
    reg = read_registry(r, bad)
    assert list(reg.workers) == ["w1"] and reg.workers["w1"][1] is True
    assert kinds(bad) == [("registry", keys.WORKERS, field)]
    assert reg.unreadable == (field,)


def test_liveness_is_the_heartbeat_and_one_of_another_type_is_none(r, monkeypatch) -> None:
    """Beating, expired, or a heartbeat key that is not a string (never a worker's): dead. The
    heartbeats are read a thousand at a time: three reads here of two each."""
    monkeypatch.setattr("stores.registry.HEARTBEATS_PER_MGET", 2)
    for wid in ("w1", "w2", "w3", "w4", "w5"):
        r.hset(keys.WORKERS, wid, info(wid))
    r.set(keys.heartbeat("w1"), "1")
    r.set(keys.heartbeat("w4"), "1")
    r.hset(keys.heartbeat("w3"), "x", "1")
    alive = {wid: a for wid, (_i, a) in read_registry(r, BadState()).workers.items()}
    assert alive == {"w1": True, "w2": False, "w3": False, "w4": True, "w5": False}


def test_a_registry_read_decodes_only_the_entries_that_changed(r, monkeypatch) -> None:
    """With the entries of the last read (``known``), an entry whose bytes are unchanged is not
    decoded again; a changed one is, and one turned bad is skipped and told every read (it is
    never kept); ``known`` is left holding this read's good entries only."""
    decoded: list[str] = []
    real = registry._entry
    monkeypatch.setattr(registry, "_entry", lambda wid, blob: decoded.append(wid) or real(wid, blob))
    for wid in ("w1", "w2", "w3"):
        r.hset(keys.WORKERS, wid, info(wid))
    known = registry.Known(time.monotonic)
    assert sorted(read_registry(r, BadState(), known).workers) == ["w1", "w2", "w3"]
    assert sorted(decoded) == ["w1", "w2", "w3"]
    decoded.clear()
    r.hset(keys.WORKERS, "w2", info("w2", tier="batch"))
    r.hset(keys.WORKERS, "w3", b"\x00garbage")
    for _ in range(2):
        bad = BadState()
        reg = read_registry(r, bad, known)
        assert sorted(reg.workers) == ["w1", "w2"] and reg.workers["w2"][0].tier == "batch"
        assert kinds(bad) == [("registry", keys.WORKERS, "w3")]
    assert decoded == ["w2", "w3", "w3"]
    assert sorted(known.entries) == [b"w1", b"w2"]


def test_a_registry_of_the_wrong_type_reads_empty(r) -> None:
    r.lpush(keys.WORKERS, "x")
    bad = BadState()
    assert read_registry(r, bad).workers == {}
    assert kinds(bad) == [("registry", keys.WORKERS, "")]


# --- the commanders' records --------------------------------------------------------------------
def test_commander_records_of_the_wrong_type_or_garbage_are_skipped(r) -> None:
    r.hset(keys.COMMANDERS, "c1", encode(CommanderInfo(commander="c1", pid=1, host="h", started=1.0)))
    r.hset(keys.COMMANDERS, "c2", b"garbage")
    bad = BadState()
    rows = read_commanders(r, bad=bad)
    assert [c["commander"] for c in rows] == ["c1", "c2"] and rows[1]["role"] == "unreadable entry"
    assert kinds(bad) == [("commander", keys.COMMANDERS, "c2")]
    r.delete(keys.COMMANDERS)
    r.xadd(keys.COMMANDERS, {"a": "b"})
    assert commander_entries(r, bad) == []
    assert ("commander", keys.COMMANDERS, "") in kinds(bad)


# --- policies -----------------------------------------------------------------------------------
@pytest.mark.parametrize("write", [
    lambda r, k: r.hset(k, "a", "b"),
    lambda r, k: r.rpush(k, "a"),
    lambda r, k: r.xadd(k, {"a": "b"}),
    lambda r, k: r.set(k, b"\x00\xff garbage"),
    lambda r, k: r.set(k, '{"max_workers": "many"}'),
    lambda r, k: r.set(k, "[1, 2]"),
])
def test_a_policy_key_of_garbage_or_the_wrong_type_is_rejected_with_the_last_good_in_force(r, write) -> None:
    good = turns_policy(max_workers=7)
    r.set(keys.policy_good("chat"), good.to_json())
    r.delete(keys.policy("chat"))
    write(r, keys.policy("chat"))
    read = read_policy(r, "chat", record=True, reader="w1")
    assert read.source == "last-good" and read.policy.max_workers == 7 and read.error


def test_policy_copies_and_status_of_the_wrong_type_are_ignored(r) -> None:
    write_policy(r, "chat", turns_policy(max_workers=3))
    r.rpush(keys.policy_good("chat"), "x")
    r.sadd(keys.policy_status("chat", ""), "x")
    read = read_policy(r, "chat", ["echo"], record=True, reader="w1")
    assert read.source == "key" and read.policy.max_workers == 3
    assert read_policy_status(r, "chat") == {}
    r.delete(keys.policy("chat"), keys.policy_good("chat"))
    r.hset(keys.policy("chat"), "a", "b")
    r.rpush(keys.policy_good("chat"), "x")
    assert read_policy(r, "chat", record=True, reader="w1").source == "default"  # no good copy readable


def test_rejected_groups_and_pools_of_the_wrong_type_read_empty(r) -> None:
    r.set(keys.groups_rejected("chat"), "x")
    assert rejected_groups(r, "chat") == {}
    r.set(keys.pools("chat"), "x")
    bad = BadState()
    assert known_pools(r, "chat", bad) == set()
    r.delete(keys.pools("chat"))
    r.sadd(keys.pools("chat"), "chat.blue", "Bad Pool!")
    assert known_pools(r, "chat", bad) == {"chat.blue"}
    assert kinds(bad) == [("pool", keys.pools("chat"), ""), ("pool", keys.pools("chat"), "Bad Pool!")]


# --- pins ---------------------------------------------------------------------------------------
def test_pins_of_the_wrong_type_or_no_group_read_as_none(r) -> None:
    r.set(keys.pins("ann"), "x")
    r.hset(keys.pins("bob"), "chat", "Not A Group!")
    r.hset(keys.pins("cat"), "chat", "blue")
    bad = BadState()
    assert read_pins(r, ["ann", "bob", "cat"], "chat", bad) == {"ann": None, "bob": None, "cat": "blue"}
    assert kinds(bad) == [("pin", keys.pins("ann"), "chat"), ("pin", keys.pins("bob"), "chat")]

    async def read_async() -> list[str | None]:
        aio = fakeredis.FakeAsyncRedis(server=r.connection_pool.connection_kwargs["server"])
        return [(await read_pin_and_record(aio, u, "chat"))[0] for u in ("ann", "bob", "cat")]

    assert asyncio.run(read_async()) == [None, None, "blue"]


# --- decide state -------------------------------------------------------------------------------
@pytest.mark.parametrize("write", [
    lambda r, k: r.hset(k, "a", "b"),
    lambda r, k: r.set(k, "{not json"),
    lambda r, k: r.set(k, "[]"),
    lambda r, k: r.set(k, '"text"'),
    lambda r, k: r.set(k, '{"history": [["x", 1]]}'),
    lambda r, k: r.set(k, '{"history": [], "last_scale_up": "yesterday"}'),
    lambda r, k: r.set(k, '{"history": [], "failures": [1]}'),
    lambda r, k: r.set(k, '{"history": [], "queued_since": {}}'),
])
def test_a_bad_decide_state_starts_afresh(r, write) -> None:
    from commander.tierstate import TierState

    write(r, keys.decide_state("chat"))
    bad = BadState()
    assert DecideStates(r, bad).get("chat") == TierState()
    assert kinds(bad) == [("decide_state", keys.decide_state("chat"), "")]


# --- reports ------------------------------------------------------------------------------------
def test_bad_reports_and_a_reports_key_of_the_wrong_type_are_skipped(r) -> None:
    bad = BadState()
    observer = Observer(r, bad=bad)
    r.set(keys.REPORTS, "x")
    assert observer.read_reports() == 0  # (the first read: the newest reports, XREVRANGE)
    assert kinds(bad) == [("report", keys.REPORTS, "")]
    r.delete(keys.REPORTS)
    first = r.xadd(keys.REPORTS, {"m": b"garbage"}).decode()
    second = r.xadd(keys.REPORTS, {"x": b"no m"}).decode()
    assert observer.read_reports() == 0  # (then those after the last read: XREAD; a key of
    # another type there is met on a real Redis: fakeredis' XREAD fails otherwise)
    assert kinds(bad)[1:] == [("report", keys.REPORTS, first), ("report", keys.REPORTS, second)]


# --- the warning and the count ------------------------------------------------------------------
def test_a_bad_entry_is_warned_about_once_and_counted_every_time(caplog) -> None:
    counted: list[str] = []
    bad = BadState(logging.getLogger("t"), counted=counted.append)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            bad.note("tier", keys.TIERS, "Bad Tier!", "invalid tier")
            bad.note("tier", keys.TIERS, "Other!", "invalid tier")
    assert counted == ["tier"] * 6
    assert [rec.getMessage().count("Bad Tier!") for rec in caplog.records] == [1, 0]


# --- the commander ------------------------------------------------------------------------------
def test_the_commander_judges_the_good_tier_past_a_bad_member_and_a_bad_registry_entry(r) -> None:
    write_policy(r, "chat", turns_policy(min_workers=1, max_workers=2))
    r.sadd(keys.TIERS, "Bad Tier!")
    r.hset(keys.WORKERS, "wz", info("wz", tier="Bad Tier!"))
    r.set(keys.heartbeat("wz"), "1")
    runtime, metrics = RecordingRuntime(), Metrics()
    commander = leading(r, runtime, metrics, always_tiers=())

    for _ in range(2):
        commander.pass_once(time.time())

    assert runtime.spawned  # chat's floor: a worker
    seen = commander.board.seen
    assert seen is not None and list(seen.tiers) == ["chat"]
    assert sample(metrics, "fleet_state_errors_total", {"kind": "tier"}) == 2
    assert sample(metrics, "fleet_state_errors_total", {"kind": "registry"}) == 2


@pytest.mark.parametrize("where", ["decide", "policy read"])
def test_one_tier_whose_pass_or_policy_read_raises_does_not_stop_the_others(r, monkeypatch, where) -> None:
    """A value no pass expects, in one tier's decide or in its policy read (every tier's policy
    is read in one round trip): that tier is left out of the pass, the others are judged."""
    from commander import commander as module
    from commander import tier_policies

    write_policy(r, "alpha", turns_policy(min_workers=1))
    write_policy(r, "beta", turns_policy(min_workers=1))
    owner, name = (module, "decide") if where == "decide" else (tier_policies, "pool_policy")
    real = getattr(owner, name)

    def broken(first, *args, **kwargs):
        if (first.tier if where == "decide" else first) == "alpha":
            raise ValueError("a value no pass expects")
        return real(first, *args, **kwargs)

    monkeypatch.setattr(owner, name, broken)
    runtime, metrics = RecordingRuntime(), Metrics()
    commander = leading(r, runtime, metrics, always_tiers=())
    commander.pass_once(time.time())

    assert [runtime.handles[w].tier for w in runtime.spawned] == ["beta"]
    assert sample(metrics, "fleet_state_errors_total", {"kind": "tier_pass"}) == 1
    assert [e.key for e in commander.bad.entries] == ["alpha"]


def test_a_pass_that_raises_outside_a_tier_is_counted_and_the_loop_goes_on(r, monkeypatch) -> None:
    import threading

    runtime, metrics = RecordingRuntime(), Metrics()
    commander = leading(r, runtime, metrics, always_tiers=("chat",), interval_s=0.01)
    calls: list[int] = []

    def broken(*_a: object) -> None:
        calls.append(1)
        raise KeyError("a value no pass expects")

    monkeypatch.setattr(commander.observer, "read_reports", broken)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    assert commander.run(stop) == 0
    assert len(calls) >= 2
    assert sample(metrics, "fleet_state_errors_total", {"kind": "pass"}) == len(calls)


# --- fleet status -------------------------------------------------------------------------------
def test_status_names_the_bad_entries_and_shows_the_good_tiers(r) -> None:
    write_policy(r, "chat", turns_policy())
    r.sadd(keys.TIERS, "Bad Tier!")
    r.hset(keys.WORKERS, "bad id!", info("bad id!"))
    r.hset(keys.COMMANDERS, "c9", b"garbage")
    r.hset(keys.policy("other"), "a", "b")
    snap = snapshot(r)
    assert "chat" in snap["tiers"] and "Bad Tier!" not in snap["tiers"]
    found = {(e["kind"], e["key"], e["member"]) for e in snap["bad_state"]}
    assert {("tier", keys.TIERS, "Bad Tier!"), ("registry", keys.WORKERS, "bad id!"),
            ("commander", keys.COMMANDERS, "c9"), ("policy", keys.policy("other"), "")} <= found
    assert all(e["reason"] for e in snap["bad_state"])


def test_a_policy_naming_a_handler_no_live_worker_has_is_rejected_but_is_no_bad_entry(r) -> None:
    """A valid key naming a handler the live workers lack is a rejection (ledgered, a gauge), not
    bad state; a key that is no policy is both."""
    from commander.tier_policies import TierPolicies

    write_policy(r, "chat", turns_policy(handler="nope"))
    registry = {"w1": (WorkerInfo(worker="w1", tier="chat", pid=1, host="h", started=1.0,
                                  handlers=["echo"]), True)}
    bad = BadState()
    policies = TierPolicies(r, ledger=_NoLedger(), metrics=None, bad=bad)
    assert policies.read_all(["chat"], {"chat": registry})["chat"].rejected
    assert bad.entries == []
    r.set(keys.policy("chat"), "{not json")
    assert policies.read_all(["chat"], {"chat": registry})["chat"].rejected
    assert kinds(bad) == [("policy", keys.policy("chat"), "")]


class _NoLedger:
    def record(self, *_args: object, **_kwargs: object) -> None:
        return None


def test_a_pressure_key_of_the_wrong_type_leaves_the_other_tiers_waited_on(r) -> None:
    bad = BadState()
    observer = Observer(r, bad=bad)
    r.set(keys.pressure("alpha"), "x")
    r.xadd(keys.pressure("beta"), {"n": 1})  # (before the first wait: not counted, as before)
    assert observer.wait_for_pressure(["alpha", "beta"], 10) == 0
    assert kinds(bad) == [("pressure", keys.pressure("alpha"), "")]
    assert observer.wait_for_pressure(["alpha", "beta"], 10) == 0  # alpha skipped until the next pass
    assert len(bad.entries) == 1 and "alpha" in observer.bad_pressure
    observer.read_reports()  # a new pass looks again
    assert observer.bad_pressure == set()


def test_a_group_verdict_on_a_rejected_key_of_the_wrong_type_still_holds_the_pool_back(r) -> None:
    from commander.rollouts.rejection import GroupChecks

    r.set(keys.groups_rejected("chat"), "x")
    runtime = RecordingRuntime()
    runtime.broken["chat.green"] = "no interpreter"
    bad = BadState()
    checks = GroupChecks(r, runtime, _NoLedger(), bad)
    assert checks.rejected("chat.green") == "no interpreter"
    runtime.broken.clear()
    assert checks.rejected("chat.green") is None
    assert kinds(bad) == [("pool", keys.groups_rejected("chat"), "")]
