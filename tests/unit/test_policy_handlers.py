"""A policy naming a handler the tier's workers cannot load.

``fleet policy set chat handler=answer`` with the package installed where the CLI runs, not
where the workers do: the key is rejected by the readers that lack the handler, which keep what
they run (not the default policy); the last good copy is written only by a reader that accepted
the key; reads never write; and a worker looks for newly installed handlers before rejecting.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import EntryPoint

import fakeredis
import pytest

from protocol import keys
from protocol.codec import decode
from protocol.models import HandlerResult, WorkerInfo
from protocol.policy import Policy, PolicyError, TurnsPolicy, parse_policy
from stores.policies import read_policy, read_policy_status, write_policy
from worker import handlers
from worker.app import Worker
from worker.settings import WorkerSettings

KNOWN = ["echo", "noop", "sleep"]


def test_a_read_never_writes() -> None:
    r = fakeredis.FakeRedis()
    r.set(keys.policy("chat"), '{"min_workers": 5, "max_workers": 2}')  # invalid
    before = sorted(r.keys("*"))
    read = read_policy(r, "chat", KNOWN)
    assert read.source == "default" and "min_workers (5) > max_workers (2)" in (read.error or "")
    assert sorted(r.keys("*")) == before


def test_policy_set_writes_the_key_and_the_tier_not_the_last_good_copy() -> None:
    r = fakeredis.FakeRedis()
    write_policy(r, "chat", TurnsPolicy(concurrency=4))
    write_policy(r, "chat", TurnsPolicy(handler="answer"))
    assert r.get(keys.policy_good("chat")) is None
    assert r.smembers(keys.TIERS) == {b"chat"}


def test_a_reader_that_lacks_the_handler_runs_the_last_good_policy_and_records_why() -> None:
    r = fakeredis.FakeRedis()
    write_policy(r, "chat", TurnsPolicy(concurrency=4))
    assert read_policy(r, "chat", KNOWN, record=True, reader="worker w1").source == "key"
    write_policy(r, "chat", TurnsPolicy(handler="answer", concurrency=16))
    read = read_policy(r, "chat", KNOWN, record=True, reader="worker w1")
    assert (read.source, read.policy.concurrency, read.missing_handler) == ("last-good", 4, "answer")
    assert TurnsPolicy.model_validate_json(r.get(keys.policy_good("chat"))).concurrency == 4  # kept
    status = read_policy_status(r, "chat")
    assert status["ok"] == "0" and "'answer' is not registered" in status["error"]
    assert status["by"] == "worker w1" and status["source"] == "last-good"
    assert read_policy(r, "chat", [*KNOWN, "answer"]).source == "key"  # where it is installed


def test_a_structurally_invalid_key_names_no_missing_handler() -> None:
    r = fakeredis.FakeRedis()
    r.set(keys.policy("chat"), '{"handler": "answer", "concurrency": 0}')
    assert read_policy(r, "chat", KNOWN).missing_handler is None


def _clients() -> tuple[fakeredis.FakeAsyncRedis, fakeredis.FakeRedis]:
    server = fakeredis.FakeServer()
    return fakeredis.FakeAsyncRedis(server=server), fakeredis.FakeRedis(server=server)


def _worker(r: fakeredis.FakeAsyncRedis) -> Worker:
    return Worker(WorkerSettings(worker_id="w1", tier="chat", handler_rescan_s=0.01), r=r)


async def test_a_worker_keeps_its_policy_when_the_key_names_a_handler_it_lacks() -> None:
    """No last good copy it can load (another worker, which had the handler, accepted the key):
    it keeps the policy it runs, not the default."""
    r, sync = _clients()
    write_policy(sync, "chat", TurnsPolicy(handler="sleep", concurrency=3))
    worker = _worker(r)
    await worker.tier_policy.refresh()
    assert (worker.policy.handler, worker.policy.concurrency) == ("sleep", 3)
    sync.set(keys.policy_good("chat"), TurnsPolicy(handler="answer").to_json())
    write_policy(sync, "chat", TurnsPolicy(handler="answer", concurrency=16))
    await worker.tier_policy.refresh()
    assert (worker.policy.handler, worker.policy.concurrency) == ("sleep", 3)
    assert "'answer' is not registered" in read_policy_status(sync, "chat")["error"]
    await r.aclose()


async def test_a_worker_finds_a_handler_installed_after_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pip install`` of a package with a ``fleet.handlers`` entry point, then ``policy set``:
    the running worker re-reads the entry points, applies the policy and registers the name."""
    installed: list[EntryPoint] = []
    monkeypatch.setattr(handlers, "entry_points", lambda group: list(installed))
    monkeypatch.setattr(handlers, "_REGISTRY", dict(handlers._REGISTRY))
    handlers.rescan()
    r, sync = _clients()
    write_policy(sync, "chat", TurnsPolicy(handler="echo"))
    worker = _worker(r)
    await worker.join()
    assert "answer" not in decode(WorkerInfo, sync.hget(keys.WORKERS, "w1")).handlers
    installed.append(EntryPoint("answer", f"{__name__}:answer", "fleet.handlers"))  # the install
    write_policy(sync, "chat", TurnsPolicy(handler="answer"))
    await asyncio.sleep(0.02)
    await worker.tier_policy.refresh()
    assert worker.policy.handler == "answer" and worker.tier_policy.handler is answer
    assert "answer" in decode(WorkerInfo, sync.hget(keys.WORKERS, "w1")).handlers
    assert read_policy_status(sync, "chat")["ok"] == "1"
    await r.aclose()


def answer(ctx: handlers.TurnContext) -> HandlerResult:
    return HandlerResult(text="42")


async def test_the_async_read_records_like_the_blocking_one() -> None:
    r = fakeredis.FakeAsyncRedis()
    await r.set(keys.policy("chat"), TurnsPolicy(concurrency=2).to_json())
    assert (await read_policy(r, "chat", KNOWN)).source == "key"
    assert await r.get(keys.policy_good("chat")) is None  # not recorded
    await read_policy(r, "chat", KNOWN, record=True, reader="worker w1")
    assert await r.get(keys.policy_good("chat")) is not None
    await r.aclose()


def _grouped(blue: str, green: str) -> Policy:
    return parse_policy({"groups": [{"name": "blue", "weight": 90, "handler": blue},
                                    {"name": "green", "weight": 10, "handler": green}]})


def test_each_groups_workers_keep_their_own_verdict_and_last_good_copy() -> None:
    """Two virtualenvs: green's has the new handler, blue's does not. A key green accepts must
    not become the copy blue falls back on, nor its verdict overwrite blue's (before: green's
    workers wrote the tier's one last good copy, blue's then failed on it too and ran the
    default policy, without groups; and the two wrote one status hash in turn)."""
    r = fakeredis.FakeRedis()
    blue_has, green_has = ["echo"], ["echo", "answer"]
    write_policy(r, "chat", _grouped("echo", "echo"))
    for group, has in (("blue", blue_has), ("green", green_has)):
        assert read_policy(r, "chat", has, record=True, reader=group, group=group).source == "key"
    write_policy(r, "chat", _grouped("answer", "answer"))  # blue's venv lacks "answer"
    green = read_policy(r, "chat", green_has, record=True, reader="green", group="green")
    assert green.source == "key" and green.policy.group_handler("green") == "answer"
    blue = read_policy(r, "chat", blue_has, record=True, reader="blue", group="blue")
    assert blue.source == "last-good" and blue.missing_handler == "answer"
    assert blue.policy.group_handler("blue") == "echo" and blue.policy.rollout.groups  # its groups kept
    assert read_policy_status(r, "chat", "blue")["ok"] == "0"
    assert "answer" in read_policy_status(r, "chat", "blue")["error"]
    assert read_policy_status(r, "chat", "green")["ok"] == "1"
    read_policy(r, "chat", green_has, record=True, reader="green", group="green")
    assert read_policy_status(r, "chat", "blue")["ok"] == "0"  # not overwritten by green


def test_an_entry_point_that_fails_to_import_is_one_handler_unavailable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each entry point loads on its own: the broken one is unavailable with its error, the
    others load, and a policy naming the broken one is refused with that error."""
    installed = [EntryPoint("broken", "no_such_module_here.handlers:answer", "fleet.handlers"),
                 EntryPoint("answer", f"{__name__}:answer", "fleet.handlers")]
    monkeypatch.setattr(handlers, "entry_points", lambda group: list(installed))
    monkeypatch.setattr(handlers, "_REGISTRY", dict(handlers._REGISTRY))
    monkeypatch.setattr(handlers, "_UNAVAILABLE", {})
    assert "answer" in handlers.rescan() and "broken" not in handlers.registered_names()
    error = handlers.unavailable()["broken"]
    assert error.startswith("ModuleNotFoundError: No module named 'no_such_module_here'")
    with pytest.raises(PolicyError, match="'broken' cannot be loaded here: ModuleNotFoundError"):
        parse_policy({"handler": "broken"}, handlers.known())
    assert parse_policy({"handler": "answer"}, handlers.known()).handler == "answer"
    r = fakeredis.FakeRedis()
    write_policy(r, "chat", TurnsPolicy(handler="broken"))
    read = read_policy(r, "chat", handlers.known(), record=True, reader="worker w1")
    assert read.source == "default" and read.missing_handler == "broken"
    assert "cannot be loaded here" in read_policy_status(r, "chat")["error"]
