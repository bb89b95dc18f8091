"""``fleet relay --check`` against real relays: a running relay's heartbeat is fresh
(exit 0), a SIGKILLed one's goes stale past the bound (exit 1, one line why); without ``--id``
the check finds the relay of this host (its default id is ``relay-<host>-<pid>``)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import redis

from stores import outbox
from tests.integration.conftest import wait_until
from tests.integration.test_defer_rq import Proc, relay, start_proc  # noqa: F401  (a fixture)
from worker.rq.relay_health import host_prefix

pytestmark = pytest.mark.integration


def check(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleet.cli", "relay", "--check", *argv], env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_live_relay_is_healthy_and_a_killed_one_goes_stale(
        r: redis.Redis, fleet_env: dict[str, str], start_proc: Callable[..., Proc]) -> None:  # noqa: F811
    assert check(fleet_env, "--id", "relay-h1").returncode == 1  # never started: no heartbeat
    p = relay(start_proc, "relay-h1")
    wait_until(lambda: "relay-h1" in outbox.relay_beats(r) or p.proc.poll() is not None, 30,
               "the relay's first heartbeat")
    assert p.proc.poll() is None, p.tail()
    first = outbox.relay_beats(r)["relay-h1"]
    wait_until(lambda: outbox.relay_beats(r)["relay-h1"] > first, 10, "a second heartbeat (every loop)")
    ok = check(fleet_env, "--id", "relay-h1", "--max-age", "10")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("fleet relay --check: relay relay-h1: heartbeat ") and ok.stderr == ""

    p.kill()
    last = outbox.relay_beats(r)["relay-h1"]  # a dead relay beats no more
    stale = wait_until(lambda: (c := check(fleet_env, "--id", "relay-h1", "--max-age", "2")).returncode
                       and c, 30, "the check to fail once the heartbeat is older than 2 s")
    assert time.time() - last > 2  # not before the bound
    lines = stale.stderr.strip().splitlines()  # type: ignore[union-attr]
    assert len(lines) == 1 and "relay relay-h1: last heartbeat" in lines[0], lines
    assert "over --max-age 2s" in lines[0] and stale.stdout == ""  # type: ignore[union-attr]
    assert outbox.relay_beats(r)["relay-h1"] == last
    assert check(fleet_env, "--id", "relay-h1", "--max-age", "3600").returncode == 0  # the bound decides


def test_without_an_id_the_check_finds_this_hosts_relay(
        r: redis.Redis, fleet_env: dict[str, str], start_proc: Callable[..., Proc]) -> None:  # noqa: F811
    got = check(fleet_env)
    assert got.returncode == 1 and "no heartbeat of a relay of this host" in got.stderr
    p = start_proc("relay-default", "relay", "--sweep-interval", "2")  # no --id: relay-<host>-<pid>
    mine = f"{host_prefix()}{p.proc.pid}"
    wait_until(lambda: mine in outbox.relay_beats(r) or p.proc.poll() is not None, 30, "its heartbeat")
    assert p.proc.poll() is None, p.tail()
    got = check(fleet_env)
    assert got.returncode == 0 and mine in got.stdout, got.stderr
