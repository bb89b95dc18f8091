"""A tier's ``durability.retention_days``: an idle user's keys expire that long after the user's
last turn (set again at each submit and commit), against a real redis-server and worker."""

from __future__ import annotations

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.policy import Durability, TurnsPolicy
from stores.group_assignment import pin_group
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration

DAY_MS = 86_400_000
RETENTION_DAYS = 0.001  # 86.4 s


def policy(days: float) -> str:
    return TurnsPolicy(handler="echo", durability=Durability(retention_days=days)).to_json()


@pytest.mark.acl_denials  # the client's PEXPIRE of a tier's stream is refused, as it must be
def test_an_inbox_expires_after_its_submit_when_no_worker_serves_it(r, redis_server):
    r.set(keys.policy("chat"), policy(RETENTION_DAYS))
    client = Fleet(redis_server.role_url("fleet-client"))
    client.submit("ivy", "anyone?")
    assert 0 < r.pttl(keys.inbox("ivy")) <= RETENTION_DAYS * DAY_MS
    # the client role may expire an inbox, and nothing else it writes (the tier's ready stream)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.r.pexpire(keys.ready("chat"), 1)
    assert r.pttl(keys.ready("chat")) == -1


def test_every_key_of_the_user_expires_after_the_last_commit_and_no_longer_once_retention_is_off(
        r, redis_server, start_worker):
    r.set(keys.policy("chat"), policy(RETENTION_DAYS))
    pin_group(r, "joe", "chat", "blue")  # a pin to a group the tier has not: served by the tier
    start_worker()
    client = Fleet(redis_server.role_url("fleet-client"))
    assert client.submit("joe", "hi").result(10).ok
    expiring = [keys.inbox("joe"), keys.state("joe"), keys.session("joe"), keys.done("joe"),
                keys.usage("joe"), keys.fence("joe"), keys.pins("joe")]
    for key in expiring:
        assert 0 < r.pttl(key) <= RETENTION_DAYS * DAY_MS, key
    r.hset(keys.profile("joe"), "name", "Joe")  # a key the next commit finds without an expiry
    assert client.submit("joe", "again").result(10).ok
    assert 0 < r.pttl(keys.profile("joe")) <= RETENTION_DAYS * DAY_MS

    r.set(keys.policy("chat"), policy(0))  # off: the next commit keeps the keys for good

    def kept() -> bool:
        assert client.submit("joe", "and again").result(10).ok
        return all(r.pttl(k) == -1 for k in (keys.state("joe"), keys.session("joe"), keys.fence("joe")))

    wait_until(kept, 20, "a commit under the policy without retention")
