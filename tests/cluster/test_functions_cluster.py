"""Fleet's functions library on a Redis Cluster: ``fleet install`` loads it on every primary
(the replicas copy it), a fleet serves there as a user that may only call it, and the calls of
users on every master share one cluster pipeline (``FCALL`` is routed by its keys)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.crc import key_slot

from protocol import keys
from stores import functions, worker_ops
from stores.connection import connect_async
from stores.turns import Lease, UserStore
from tests.cluster.conftest import RedisClusterRig
from tests.cluster.test_fleet_on_cluster import answered_in_order, cluster_env, start_workers  # noqa: F401
from tests.helpers import fleet_cli
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration

USERS = [f"u{i}" for i in range(30)]


def versions(rig: RedisClusterRig) -> dict[int, str | None]:
    """The library version each live node (primary or replica) holds."""
    out: dict[int, str | None] = {}
    for node in rig.masters() + rig.replicas():
        client = node.client()
        try:
            if node in rig.replicas():
                client.execute_command("READONLY")
            out[node.port] = functions.library_state(client)[1]
        finally:
            client.close()
    return out


@pytest.fixture
def runtime_user(redis_cluster: RedisClusterRig) -> Iterator[str]:
    """On every node: a user allowed every command but scripting, FCALL and FCALL_RO excepted."""
    for node in redis_cluster.masters() + redis_cluster.replicas():
        node.client().execute_command("ACL", "SETUSER", "runtime", "reset", "on", ">runtime-pw", "~*", "&*",
                                      "+@all", "-@scripting", "+fcall", "+fcall_ro")
    yield redis_cluster.plain_url.replace("redis://", "redis://runtime:runtime-pw@")
    for node in redis_cluster.masters() + redis_cluster.replicas():
        node.client().execute_command("ACL", "DELUSER", "runtime")


def test_fleet_install_loads_the_library_on_every_primary(redis_cluster: RedisClusterRig,
                                                         cluster_env: dict[str, str]) -> None:  # noqa: F811
    for node in redis_cluster.masters():
        node.client().function_flush()
    assert set(versions(redis_cluster).values()) == {None}
    # as the admin: the URL's credentials, no role's password to replace them
    admin_env = {k: v for k, v in cluster_env.items() if not k.startswith("FLEET_ACL_PASSWORD_")}
    admin_env["REDIS_URL"] = redis_cluster.url
    out = fleet_cli(admin_env, "install")
    assert out.returncode == 0 and f"version {functions.VERSION} on every primary (3)" in out.stdout, out
    wait_until(lambda: set(versions(redis_cluster).values()) == {functions.VERSION}, 10,
               "every node, replicas too, to hold the library")
    check = fleet_cli(admin_env, "install", "--check")
    assert check.returncode == 0 and "ok" in check.stdout


def test_a_fleet_serves_on_a_cluster_as_a_user_that_may_only_call_functions(
        redis_cluster: RedisClusterRig, rc: redis.Redis, runtime_user: str, cluster_env: dict[str, str],  # noqa: F811
        start_workers: Callable[[int], object]) -> None:  # noqa: F811
    for name in [k for k in cluster_env if k.startswith("FLEET_ACL_PASSWORD_")]:
        del cluster_env[name]  # the URL's user, not the roles
    cluster_env["REDIS_URL"] = runtime_user
    start_workers(2)
    names = USERS[:12]
    assert len({redis_cluster.master_of_slot(key_slot(keys.inbox(u).encode())).port for u in names}) == 3
    answered_in_order(runtime_user, rc, names, 2)


def test_renewals_and_touches_of_users_on_every_master_share_a_cluster_pipeline(
        redis_cluster: RedisClusterRig, rc: redis.Redis) -> None:
    async def run() -> tuple[list[bool], list[bool]]:
        ar = connect_async(redis_cluster.role_url("fleet-worker"))
        try:
            store = UserStore(ar, "w1")
            leases = []
            for user in USERS:
                await ar.xadd(keys.inbox(user), {"text": "hi"})
                lease = await store.acquire(user)
                assert isinstance(lease, Lease)
                leases.append(lease)
            renewed = await store.renew(leases)
            rc.delete(keys.lane(USERS[0]))  # lost: its renewal says so
            again = await store.renew(leases)
            await worker_ops.join_ready_group(ar, "chat", 1)
            await worker_ops.touch_and_beat(ar, store.scripts, "chat", "w1", [], 5_000)
            return renewed, again
        finally:
            await ar.aclose()

    renewed, again = asyncio.run(run())
    assert renewed == [True] * len(USERS)
    assert again == [False] + [True] * (len(USERS) - 1)
    assert rc.exists(keys.heartbeat("w1"))
