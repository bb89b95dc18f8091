"""Bad entries of shared state on a running fleet: the commander keeps leading, scaling and
serving the good tier, counts them in /metrics, and ``fleet status`` names them and exits 0."""

from __future__ import annotations

import urllib.request

import pytest

from fleet.client import Fleet
from protocol import keys
from protocol.codec import encode
from protocol.models import WorkerInfo
from protocol.policy import turns_policy
from stores.policies import write_policy
from stores.registry import read_registry
from tests.conftest import free_port
from tests.helpers import fleet_cli, leads, passes, wait_until

pytestmark = pytest.mark.integration


def _state_errors(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("fleet_state_errors_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.split()[-1])
    return out


def test_a_bad_tier_member_and_registry_entry_stop_nothing(r, redis_server, fleet_env,
                                                           start_commander) -> None:
    write_policy(r, "chat", turns_policy(handler="echo", min_workers=1, max_workers=3))
    port = free_port()
    commander = start_commander("c1", "--metrics-port", str(port), metrics=True)
    wait_until(lambda: read_registry(r).live("chat"), 30, "chat's first worker")

    r.sadd(keys.TIERS, "Bad Tier!")  # an operator's typo with redis-cli
    bad_info = WorkerInfo(worker="ghost", tier="Bad Tier!", pid=1, host="nowhere", started=1.0)
    r.hset(keys.WORKERS, "ghost", encode(bad_info))
    r.set(keys.heartbeat("ghost"), "1", px=600_000)
    r.hset(keys.WORKERS, "garbage", b"\x00not an entry")
    try:
        passes(r, 3, "c1")
        assert commander.alive(), commander.tail()
        assert leads(r, "c1")

        # it still scales the good tier, and its workers serve
        write_policy(r, "chat", turns_policy(handler="echo", min_workers=2, max_workers=3))
        wait_until(lambda: len(read_registry(r).live("chat")) == 2 or not commander.alive(), 30,
                   "chat scaled to its new floor")
        reply = Fleet(redis_server.role_url("fleet-client")).submit("alice", "hello").result(30)
        assert reply.ok and reply.text.endswith("hello")

        errors = _state_errors(port)
        assert errors.get("tier", 0) >= 3 and errors.get("registry", 0) >= 3, errors
        log = commander.tail(200_000)
        assert log.count("bad tier entry (fleet:tiers 'Bad Tier!')") == 1, log[-4000:]  # once, not every pass

        status = fleet_cli(fleet_env, "status")
        assert status.returncode == 0, status.stderr
        assert "BAD STATE" in status.stdout
        assert "fleet:tiers 'Bad Tier!'" in status.stdout and "fleet:workers 'ghost'" in status.stdout
        assert "fleet:workers 'garbage'" in status.stdout
        assert commander.alive(), commander.tail()
    finally:
        r.srem(keys.TIERS, "Bad Tier!")  # (the fixtures' teardown reads the registry itself)
        r.hdel(keys.WORKERS, "ghost", "garbage")


def test_a_pressure_stream_turned_into_another_type_is_skipped_by_the_blocking_read(r) -> None:
    """The commander's wait reads every tier's pressure stream in one XREAD: one key of another
    type fails it all on a real Redis; that tier is left out, the others are still read."""
    from commander.observe import Observer
    from stores.bad_state import BadState

    bad = BadState()
    observer = Observer(r, bad=bad)
    assert observer.wait_for_pressure(["alpha", "beta"], 10) == 0  # (where each stream is now)
    r.set(keys.pressure("alpha"), "x")
    r.xadd(keys.pressure("beta"), {"n": 1})
    assert observer.wait_for_pressure(["alpha", "beta"], 10) == 0
    assert [(e.kind, e.key) for e in bad.entries] == [("pressure", keys.pressure("alpha"))]
    assert observer.wait_for_pressure(["alpha", "beta"], 10) == 1  # beta's event, alpha left out
