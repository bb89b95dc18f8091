"""Connecting to a real Redis Cluster: detected from any node's URL, forced by
``FLEET_REDIS_CLUSTER``, and ridden through a master's failover by the retry loops."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import MovedError

from protocol import keys as fleet_keys
from stores.cluster import is_cluster
from stores.connection import ClusterModeError, connect_async, connect_sync
from stores.retry import TRANSIENT, Backoff, until_ok
from tests.cluster.conftest import ClusterNode, RedisClusterRig, cluster_acl_denials
from tests.conftest import ROLE_PASSWORDS

pytestmark = pytest.mark.integration
log = logging.getLogger("test.cluster")


def key_on(rig: RedisClusterRig, master: ClusterNode, prefix: str = "k") -> str:
    """A key whose slot the given master serves now."""
    for i in range(100_000):
        key = f"{prefix}{i}"
        if rig.master_of_slot(key_slot(key.encode())) is master:
            return key
    raise LookupError(master.port)


def keys_per_master(rig: RedisClusterRig, prefix: str = "k") -> dict[int, str]:
    """One key per master (by port), found by walking CLUSTER SLOTS once."""
    with rig.masters()[0].client() as c:
        ranges = [(lo, hi, int(m[1])) for lo, hi, m, *_ in c.execute_command("CLUSTER", "SLOTS")]
    out: dict[int, str] = {}
    i = 0
    while len(out) < len({port for *_, port in ranges}):
        key = f"{prefix}{i}"
        slot = key_slot(key.encode())
        port = next(p for lo, hi, p in ranges if lo <= slot <= hi)
        out.setdefault(port, key)
        i += 1
    return out


# --- detection ---------------------------------------------------------------------------------
def test_a_cluster_url_of_any_node_gives_a_cluster_client(redis_cluster: RedisClusterRig):
    for url in redis_cluster.urls():  # masters and replicas alike
        r = connect_sync(url)
        try:
            assert is_cluster(r)
            assert r.ping()
        finally:
            r.close()


async def test_async_a_cluster_url_gives_an_asyncio_cluster_client(redis_cluster: RedisClusterRig):
    r = connect_async(redis_cluster.url)
    try:
        assert is_cluster(r)
        assert isinstance(r, aioredis.RedisCluster)
        assert await r.ping()
    finally:
        await r.aclose()


def test_no_forces_a_plain_client_which_meets_moved(redis_cluster: RedisClusterRig,
                                                    monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLEET_REDIS_CLUSTER", "no")
    r = connect_sync(redis_cluster.url, retries=0)
    try:
        assert not is_cluster(r)
        assert isinstance(r, redis.Redis)
        served_here = redis_cluster.masters()[0].port
        elsewhere = next(k for p, k in keys_per_master(redis_cluster).items() if p != served_here)
        with pytest.raises(MovedError):
            r.set(elsewhere, "x")
    finally:
        r.close()
    assert not is_cluster(connect_async(redis_cluster.url))


def test_an_explicit_mode_overrides_the_env(redis_cluster: RedisClusterRig, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLEET_REDIS_CLUSTER", "no")
    r = connect_sync(redis_cluster.url, cluster="auto")
    try:
        assert is_cluster(r)
    finally:
        r.close()


def test_yes_on_a_single_node_is_a_clear_error(redis_server, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLEET_REDIS_CLUSTER", "yes")
    with pytest.raises(ClusterModeError, match=r"FLEET_REDIS_CLUSTER=yes, but .* is not a cluster node"):
        connect_sync(redis_server.url)
    with pytest.raises(ClusterModeError, match="not a cluster node"):
        connect_async(redis_server.url)
    monkeypatch.setenv("FLEET_REDIS_CLUSTER", "auto")
    plain = connect_sync(redis_server.url)
    assert not is_cluster(plain) and plain.ping()
    plain.close()


def test_a_bad_mode_is_an_error_before_any_connection(redis_cluster: RedisClusterRig,
                                                      monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLEET_REDIS_CLUSTER", "maybe")
    with pytest.raises(ClusterModeError, match="must be one of auto, yes, no"):
        connect_sync(redis_cluster.url)
    with pytest.raises(ClusterModeError, match="must be one of"):
        connect_async(redis_cluster.url)


def test_a_cluster_url_naming_another_database_is_refused(redis_cluster: RedisClusterRig):
    with pytest.raises(ClusterModeError, match="only database 0"):
        connect_sync(redis_cluster.url.replace("/0", "/3"))


@pytest.mark.parametrize("denied", ["info", "select"])
def test_detection_needs_only_one_of_select_or_info(redis_cluster: RedisClusterRig, denied: str):
    """SELECT 1 (in the security page's ACL) decides; INFO cluster only if SELECT is refused."""
    admins = [n.client() for n in redis_cluster.nodes]
    try:
        for admin in admins:  # an ACL is per node
            admin.acl_setuser("probe", enabled=True, passwords=["+pw"], keys=["*"],
                              commands=["+@all", f"-{denied}"])
            admin.acl_log_reset()
        url = redis_cluster.plain_url.replace("redis://", "redis://probe:pw@")
        r = connect_sync(url)
        try:
            assert is_cluster(r) and r.set("k", 1)
        finally:
            r.close()
        logged = [e for a in admins for e in a.acl_log()]
        if denied == "info":
            assert logged == [], logged  # INFO was never sent
    finally:
        for admin in admins:
            admin.acl_deluser("probe")
            admin.close()


# --- commands on every master ------------------------------------------------------------------
def test_a_key_of_each_master_works_through_the_cluster_client(redis_cluster: RedisClusterRig):
    keys = keys_per_master(redis_cluster)
    assert len(keys) == 3
    r = connect_sync(redis_cluster.url)
    try:
        for port, key in keys.items():
            assert r.set(key, port)
            assert r.get(key) == str(port).encode()
            with next(n for n in redis_cluster.nodes if n.port == port).client() as node:
                assert node.execute_command("GET", key) == str(port).encode()  # landed on its master
    finally:
        r.close()


async def test_async_a_key_of_each_master_works(redis_cluster: RedisClusterRig):
    keys = keys_per_master(redis_cluster, prefix="a")
    r = connect_async(redis_cluster.url)
    try:
        for port, key in keys.items():
            await r.xadd(key, {"p": port})
            assert await r.xlen(key) == 1
    finally:
        await r.aclose()


# --- a master's failover -------------------------------------------------------------------------
async def test_until_ok_rides_out_a_master_failover(redis_cluster: RedisClusterRig,
                                                    caplog: pytest.LogCaptureFixture):
    """Writes to a key of every master, one after another through ``until_ok``, while one master
    is SIGKILLed: the errors of the failover are retried, none is raised, every write lands."""
    caplog.set_level(logging.WARNING, logger="test.cluster")
    keys = keys_per_master(redis_cluster, prefix="f")
    victim = redis_cluster.masters()[0]
    victim_key = keys[victim.port]
    r = connect_async(redis_cluster.url, retries=2)
    written = 0
    promoted = asyncio.Event()
    after_promotion = 0

    async def writer() -> None:
        nonlocal written, after_promotion
        while after_promotion < 30:
            for key in keys.values():
                async def write(key: str = key) -> None:
                    await r.incr(key)
                await until_ok(f"incr {key}", write, backoff=Backoff(base=0.05, cap=0.5), log=log)
                written += 1
                if promoted.is_set():
                    after_promotion += 1
            await asyncio.sleep(0.01)

    try:
        task = asyncio.create_task(writer())
        deadline = time.monotonic() + 10
        while written < len(keys):  # a first write to every master went through
            assert not task.done() and time.monotonic() < deadline, "the writer did not get going"
            await asyncio.sleep(0.01)
        began = time.monotonic()
        redis_cluster.kill_master(victim)
        new_master = await asyncio.to_thread(redis_cluster.wait_promoted, victim)
        took = time.monotonic() - began
        promoted.set()
        await asyncio.wait_for(task, 60)  # raises if an error escaped until_ok
        assert new_master.port != victim.port
        assert redis_cluster.master_of_slot(key_slot(victim_key.encode())) is new_master
        assert int(await r.get(victim_key)) >= 1
        retried = [rec for rec in caplog.records if "retrying" in rec.getMessage()]
        log.warning("failover took %.1f s; %d writes; %d retried by until_ok", took, written, len(retried))
        assert retried, "the failover should have been seen by until_ok (the client's own retries are few)"
    finally:
        await r.aclose()


def test_a_sync_client_made_before_a_failover_works_after_it(redis_cluster: RedisClusterRig):
    """The commander's kind of loop: catch TRANSIENT, back off, go on, with the same client."""
    keys = keys_per_master(redis_cluster, prefix="s")
    victim = redis_cluster.masters()[0]
    r = connect_sync(redis_cluster.url, retries=2)
    try:
        r.set(keys[victim.port], "before")
        redis_cluster.kill_master(victim)
        redis_cluster.wait_promoted(victim)
        failures = 0
        deadline = time.monotonic() + 30
        while True:
            try:
                r.set(keys[victim.port], "after")
                break
            except TRANSIENT:
                failures += 1
                assert time.monotonic() < deadline
                time.sleep(Backoff(base=0.05, cap=0.5).compute(failures))
        assert r.get(keys[victim.port]) == b"after"
    finally:
        r.close()


# --- a role's credentials on every node ---------------------------------------------------------
def users_per_master(rig: RedisClusterRig) -> dict[int, str]:
    """One user per master (by port) whose inbox that master serves."""
    out: dict[int, str] = {}
    for i in range(100_000):
        user = f"u{i}"
        out.setdefault(rig.master_of_slot(key_slot(fleet_keys.inbox(user).encode())).port, user)
        if len(out) == len(rig.masters()):
            return out
    raise LookupError(out)


def test_a_role_url_authenticates_on_every_node_the_client_discovers(redis_cluster: RedisClusterRig):
    """The URL names one node; the cluster client opens its connections to the others from
    CLUSTER SLOTS, with the URL's user and password (refused with NOAUTH without them)."""
    users = users_per_master(redis_cluster)
    r = connect_sync(redis_cluster.role_url("fleet-client"))
    try:
        for port, user in users.items():
            r.xadd(fleet_keys.inbox(user), {"p": port})
            with next(n for n in redis_cluster.nodes if n.port == port).client() as node:
                assert node.xlen(fleet_keys.inbox(user)) == 1  # landed on its master
    finally:
        r.close()


async def test_async_a_role_url_authenticates_on_every_node(redis_cluster: RedisClusterRig):
    users = users_per_master(redis_cluster)
    r = connect_async(redis_cluster.role_url("fleet-client"))
    try:
        for port, user in users.items():
            await r.xadd(fleet_keys.inbox(user), {"p": port})
            assert await r.exists(fleet_keys.inbox(user)) == 1
    finally:
        await r.aclose()


@pytest.mark.acl_denials
def test_a_refusal_of_a_role_is_found_on_whichever_node_refused_it(redis_cluster: RedisClusterRig):
    """The check the ``redis_cluster`` fixture runs after each test reads every node's ACL LOG."""
    for node in redis_cluster.masters():
        role = redis.Redis(port=node.port, username="fleet-client", password=ROLE_PASSWORDS["fleet-client"])
        with role, pytest.raises(redis.exceptions.NoPermissionError):
            role.flushall()
    denials = cluster_acl_denials(redis_cluster)
    assert sorted(d.split(":")[0] for d in denials) == sorted(str(n.port) for n in redis_cluster.masters())
    assert all(d.endswith("fleet-client command flushall") for d in denials), denials
