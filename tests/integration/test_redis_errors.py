"""No Redis error kills a Fleet process: a worker, a relay and a commander each meet an error
Redis answers (BUSY, NOPERM, READONLY, and through a fault proxy LOADING, MASTERDOWN and the
like), log it once per kind, count it, back off, and serve again once Redis does.

A real redis-server is put in each state where it can be (a long script for BUSY, an ACL
change for NOPERM, REPLICAOF for READONLY); the others are answered by ``tests.fault_proxy``.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.codec import decode
from protocol.models import OccupancyReport
from protocol.policy import TurnsPolicy
from stores import outbox
from stores.policies import write_policy
from stores.tier_exists import tier_exists
from tests.conftest import ADMIN_PASSWORD, RedisServer, free_port, start_on_free_port
from tests.fault_proxy import FaultProxy
from tests.helpers import Processes, fleet_argv, leads, passes, wait_until
from tests.integration.conftest import FAST_WORKER_ENV

pytestmark = pytest.mark.integration

HOLD_S = 1.0  # how long a fault lasts: every loop meets it several times meanwhile
PASSWORD = "worker-secret"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own: the tests put it in states no other test must see."""
    s = start_on_free_port(tmp_path)
    try:
        yield s
    finally:
        s.stop(sig_kill=True)


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client()
    yield client
    client.close()


def _worker(processes: Processes, env: dict[str, str], url: str, admin: redis.Redis, wid: str = "chat-e1"):
    worker = processes.start(wid, ["-m", "worker", "--tier", "chat", "--worker-id", wid],
                             {**env, **FAST_WORKER_ENV, "REDIS_URL": url})
    wait_until(lambda: _report(admin, wid) is not None or not worker.alive(), 20, f"worker {wid} serving")
    assert worker.alive(), worker.tail()
    return worker


def _report(r: redis.Redis, worker: str) -> OccupancyReport | None:
    """The worker's newest "ready" report, if any."""
    for _id, fields in r.xrevrange(keys.REPORTS, count=50):
        report = decode(OccupancyReport, fields[b"m"])
        if report.worker == worker and report.state == "ready":
            return report
    return None


def _once_and_counted(started, admin: redis.Redis, wid: str, kind: str) -> None:
    """The worker logged ``kind`` once, said Redis answers again, and reports the count."""
    text = started.tail(200_000)
    assert text.count(f"Redis error {kind.upper()} ") == 1, text[-4000:]
    wait_until(lambda: "Redis answers again after" in started.tail(200_000), 20, "the recovery logged")

    def counted() -> bool:
        report = _report(admin, wid)
        return report is not None and report.turn_stats.redis_errors.get(kind, 0) > 0

    wait_until(counted, 20, f"the worker's reports counting {kind}")


def _serves(url: str, user: str = "u1") -> None:
    with Fleet(url) as fleet:
        # the tier is known by its worker's heartbeat, which the fault may have let expire
        wait_until(lambda: tier_exists(fleet.r, "chat"), 20, "the worker's heartbeat back")
        assert fleet.submit(user, "hello").result(30).ok


def _logged(started, kind: str) -> bool:
    return f"Redis error {kind.upper()} " in started.tail(200_000) or not started.alive()


# --- the worker -----------------------------------------------------------------------------------
def test_a_worker_survives_busy_and_serves_after_script_kill(processes, fleet_env, server, admin) -> None:
    worker = _worker(processes, fleet_env, server.url, admin)
    try:
        admin.config_set("busy-reply-threshold", 100)  # ms a script runs before others get BUSY
    except redis.ResponseError:  # Redis 6 knows it by its older name
        admin.config_set("lua-time-limit", 100)
    runner = server.client()
    failed: list[Exception] = []

    def busy_loop() -> None:
        try:
            runner.eval("while true do end", 0)
        except redis.ResponseError as exc:  # killed by SCRIPT KILL
            failed.append(exc)

    thread = threading.Thread(target=busy_loop, daemon=True)
    thread.start()
    wait_until(lambda: _logged(worker, "busy"), 20, "the worker to meet BUSY")
    time.sleep(HOLD_S)  # the script keeps running: every loop meets BUSY again and again
    admin.script_kill()
    thread.join(10)
    assert failed, "the script was not killed"
    assert worker.alive(), worker.tail()
    _serves(server.url)
    _once_and_counted(worker, admin, "chat-e1", "busy")


def test_a_worker_survives_noperm_and_serves_the_turn_when_the_right_is_back(processes, fleet_env, server,
                                                                            admin) -> None:
    admin.acl_setuser("fleetw", enabled=True, passwords=[f"+{PASSWORD}"], commands=["+@all"], keys=["*"],
                      channels=["*"])
    no_roles = {k: v for k, v in fleet_env.items() if not k.startswith("FLEET_ACL_PASSWORD_")}  # as fleetw
    worker = _worker(processes, no_roles, f"redis://fleetw:{PASSWORD}@127.0.0.1:{server.port}/0", admin)
    admin.acl_setuser("fleetw", commands=["-xreadgroup"])
    wait_until(lambda: _logged(worker, "noperm"), 20, "the worker to meet NOPERM")
    with Fleet(server.url) as fleet:
        handle = fleet.submit("u2", "waits for the right")  # submitted while the worker cannot read
        time.sleep(HOLD_S)
        assert worker.alive(), worker.tail()
        admin.acl_setuser("fleetw", commands=["+xreadgroup"])
        assert handle.result(30).ok  # not lost: served once the worker may read again
    assert worker.alive(), worker.tail()
    _once_and_counted(worker, admin, "chat-e1", "noperm")


def test_a_worker_survives_readonly_after_a_failover_and_serves_again(processes, fleet_env, server,
                                                                      admin) -> None:
    worker = _worker(processes, fleet_env, server.url, admin)
    admin.replicaof("127.0.0.1", str(free_port()))  # a master that is not there: no sync, data kept
    try:
        wait_until(lambda: _logged(worker, "readonly"), 20, "the worker to meet READONLY")
        time.sleep(HOLD_S)
    finally:
        admin.replicaof("NO", "ONE")
    assert worker.alive(), worker.tail()
    _serves(server.url)
    _once_and_counted(worker, admin, "chat-e1", "readonly")


FAULTS = [  # (what the proxy answers to every command, the kind the processes log)
    ("LOADING Redis is loading the dataset in memory", "loading"),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", "masterdown"),
    ("TRYAGAIN Multiple keys request during rehashing of slot", "tryagain"),
    ("CLUSTERDOWN The cluster is down", "clusterdown"),
    ("ERR Function not found", "noscript"),
    ("NOSCRIPT No matching script. Please use EVAL.", "noscript"),
    ("WEIRD an error no Redis ever answered", "other"),
]


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[FaultProxy]:
    p = FaultProxy(server.port)
    yield p
    p.close()


@pytest.mark.parametrize(("fault", "kind"), FAULTS, ids=[k + "-" + f.split()[1] for f, k in FAULTS])
def test_a_worker_survives_each_injected_error_and_serves_again(processes, fleet_env, server, admin, proxy,
                                                                fault, kind) -> None:
    worker = _worker(processes, fleet_env, proxy.url(), admin)
    proxy.inject(fault)
    wait_until(lambda: _logged(worker, kind), 30, f"the worker to meet {kind}")
    time.sleep(HOLD_S)
    proxy.inject(None)
    assert worker.alive(), worker.tail()
    _serves(server.url)
    _once_and_counted(worker, admin, "chat-e1", kind)


# --- the relay ------------------------------------------------------------------------------------
RELAY_FAULTS = [FAULTS[0], ("READONLY You can't write against a read only replica.", "readonly")]


@pytest.mark.parametrize(("fault", "kind"), RELAY_FAULTS, ids=["loading", "readonly"])
def test_the_relay_survives_an_error_and_relays_again(processes, fleet_env, server, admin, proxy,
                                                      fault, kind) -> None:
    relay = processes.start("relay", [*fleet_argv("relay", "--id", "relay-e1")[1:]],
                            {**fleet_env, "REDIS_URL": proxy.url()})
    wait_until(lambda: "relay-e1" in outbox.relay_beats(admin) or not relay.alive(), 20, "the relay beating")
    proxy.inject(fault, ["XREADGROUP", "XAUTOCLAIM", "HSET"])
    wait_until(lambda: _logged(relay, kind), 30, f"the relay to meet {kind}")
    time.sleep(HOLD_S)
    cleared = time.time()
    proxy.inject(None)
    wait_until(lambda: outbox.relay_beats(admin).get("relay-e1", 0) > cleared or not relay.alive(), 20,
               "the relay beating again")
    assert relay.alive(), relay.tail()
    text = relay.tail(200_000)
    assert text.count(f"Redis error {kind.upper()} ") == 1, text[-4000:]
    wait_until(lambda: "Redis answers again after" in relay.tail(200_000), 20, "the recovery logged")


def test_a_deferred_job_waits_out_an_error_in_the_relay(processes, fleet_env, server, admin, proxy) -> None:
    """The relay meets READONLY on every command (the chat and RQ workers do not); once Redis
    takes its writes again, the job a turn deferred meanwhile is relayed and run."""
    write_policy(admin, "chat", TurnsPolicy(handler="echo_defer"))
    _worker(processes, fleet_env, server.url, admin)
    relay_argv = fleet_argv("relay", "--id", "relay-e2", "--claim-idle-ms", "500", "--sweep-interval", "2")
    relay = processes.start("relay", relay_argv[1:], {**fleet_env, "REDIS_URL": proxy.url()})
    processes.start("rq-e2", fleet_argv("rq-worker", "--queues", "writeback", "--name", "rq-e2")[1:],
                    {**fleet_env, "REDIS_URL": server.url})
    wait_until(lambda: "relay-e2" in outbox.relay_beats(admin) or not relay.alive(), 20, "the relay beating")
    proxy.inject("READONLY You can't write against a read only replica.")
    _serves(server.url, "alice")  # answered; its deferral waits in the outbox
    wait_until(lambda: _logged(relay, "readonly"), 30, "the relay to meet READONLY")
    time.sleep(HOLD_S)
    proxy.inject(None)
    ran = lambda: admin.hget(keys.usage("alice"), "summaries") == b"1"  # noqa: E731
    wait_until(lambda: ran() or not relay.alive(), 30, "the deferred job run")
    assert relay.alive(), relay.tail()
    assert relay.tail(200_000).count("Redis error READONLY ") == 1, relay.tail()


# --- the commander --------------------------------------------------------------------------------
def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_the_commander_survives_busy_steps_down_and_leads_again(processes, fleet_env, server, admin,
                                                                proxy) -> None:
    port = free_port()
    env = {**fleet_env, "REDIS_URL": proxy.url()}
    commander = processes.commander(env, "ce1", "--metrics-port", str(port), metrics=True)
    wait_until(lambda: leads(admin, "ce1") or not commander.alive(), 30, "the commander leading")
    passes(admin, 2, "ce1")
    proxy.inject("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.")
    wait_until(lambda: _logged(commander, "busy"), 30, "the commander to meet BUSY")
    # past the lease's TTL without a renewal, the leader is a standby
    wait_until(lambda: "could not renew the lease" in commander.tail(200_000) or not commander.alive(), 30,
               "the leader to step down")
    proxy.inject(None)
    wait_until(lambda: leads(admin, "ce1") or not commander.alive(), 30, "the commander leading again")
    passes(admin, 2, "ce1")
    assert commander.alive(), commander.tail()
    text = commander.tail(200_000)
    assert text.count("Redis error BUSY ") == 1, text[-4000:]
    wait_until(lambda: "Redis answers again after" in commander.tail(200_000), 20, "the recovery logged")
    line = [ln for ln in _metrics(port).splitlines()
            if ln.startswith('fleet_commander_redis_errors_total{kind="busy"}')]
    assert line and float(line[0].split()[-1]) > 0, _metrics(port)


def test_the_monitor_answers_503_while_redis_errs(processes, fleet_env, server, admin, proxy) -> None:
    port = free_port()
    env = {**fleet_env, "REDIS_URL": proxy.url()}
    commander = processes.commander(env, "ce2", "--metrics-port", str(port), metrics=True)
    wait_until(lambda: leads(admin, "ce2") or not commander.alive(), 30, "the commander leading")
    proxy.inject("LOADING Redis is loading the dataset in memory")
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/users/alice", timeout=30)
        err.value.close()
        assert err.value.code == 503
    finally:
        proxy.inject(None)
    assert commander.alive(), commander.tail()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/users/alice", timeout=30) as resp:
        assert resp.status == 200


def test_the_proxy_forwards_and_injects(server, proxy) -> None:
    """The helper itself: commands pass through, and the chosen ones get the error."""
    c = redis.Redis.from_url(proxy.url(f"default:{ADMIN_PASSWORD}"))  # the admin, through the proxy
    try:
        c.set("k", "v")
        proxy.inject("MASTERDOWN down", ["GET"])
        with pytest.raises(redis.exceptions.ResponseError):
            c.get("k")
        assert c.exists("k") == 1
        proxy.inject(None)
        assert c.get("k") == b"v"
    finally:
        c.close()
