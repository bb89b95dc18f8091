"""A user's bad data on a real worker: a key of the wrong type costs that user an error reply and
a dead letter, never silence, and the user is served again once the key is repaired or deleted;
a notification whose serving keeps failing is dead-lettered at the delivery limit and acked."""

from __future__ import annotations

import pytest
import redis

from fleet.cli_admin import _status_text
from fleet.client import Fleet
from fleet.status import snapshot
from protocol import keys
from protocol.codec import decode
from protocol.models import OccupancyReport
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.integration.conftest import wait_until
from tests.integration.test_pipeline import dead_letters, session_of

pytestmark = pytest.mark.integration

WRONG = {"session": ("list", keys.session), "memory": ("zset", keys.memory), "done": ("zset", keys.done),
         "usage": ("hash", keys.usage), "reply": ("list", lambda user: keys.reply(user, "m-1"))}


def worker_stats(r: redis.Redis, worker: str) -> int | None:
    """The delivery-limit count of the worker's newest report (None before its first)."""
    for _id, fields in r.xrevrange(keys.REPORTS, count=50):
        report = decode(OccupancyReport, fields[b"m"])
        if report.worker == worker:
            return report.turn_stats.delivery_limit
    return None


@pytest.mark.parametrize("role", WRONG)
def test_a_wrong_type_key_gets_an_error_reply_and_a_dead_letter_and_deleting_it_mends_the_user(
        r: redis.Redis, redis_server, start_worker, role: str) -> None:
    wanted, key_of = WRONG[role]
    write_policy(r, "chat", TurnsPolicy())
    start_worker()
    fleet = Fleet(redis_server.role_url("fleet-client"))
    bad = key_of("mallory")
    r.set(bad, "garbage")
    first = fleet.submit("mallory", "hello", turn_id="m-1")
    reason = f"{bad} holds a string, not a {wanted}"
    dead = wait_until(lambda: [d for d in dead_letters(r) if d["user"] == "mallory"], 15,
                      "mallory's dead letter")
    assert len(dead) == 1 and reason in dead[0]["reason"] and dead[0]["kept"] == "True"
    assert dead[0]["kind"] == "user_data"
    if role != "reply":  # (its own reply key is the bad one: the dead letter is the answer)
        reply = first.result(5)
        assert not reply.ok and reason in (reply.error or "")
    # consumed, with its answer (the dead letter is written before the commit that consumes it)
    wait_until(lambda: r.xlen(keys.inbox("mallory")) == 0, 10, "mallory's turn consumed")
    assert fleet.submit("alice", "hi").result(10).ok  # everyone else is served

    r.delete(bad)
    again = fleet.submit("mallory", "again", turn_id="m-2").result(10)
    assert again.ok and again.text.startswith("echo: again")
    assert [e.text for e in session_of(r, "mallory")] == ["again"]


@pytest.mark.parametrize("key_of", [keys.inbox, keys.state], ids=["inbox", "state"])
def test_a_poison_notification_is_dead_lettered_at_the_delivery_limit_and_acked(
        r: redis.Redis, redis_server, start_worker, key_of) -> None:
    write_policy(r, "chat", TurnsPolicy(max_deliveries=3))
    w = start_worker()
    fleet = Fleet(redis_server.role_url("fleet-client"))
    ready = keys.ready("chat")
    r.set(key_of("mallory"), "garbage")
    poison = r.xadd(ready, {"user": "mallory"}).decode()
    assert fleet.submit("alice", "hi").result(10).ok

    dead = wait_until(lambda: [d for d in dead_letters(r) if d["user"] == "mallory"], 30,
                      "the poison notification's dead letter")
    assert len(dead) == 1 and dead[0]["kind"] == "delivery_limit"
    assert f"notification {poison} delivered 3 times" in dead[0]["reason"]
    assert f"WRONGTYPE {key_of('mallory')} holds a string" in dead[0]["reason"]  # its last error
    wait_until(lambda: r.xpending(ready, keys.GROUP)["pending"] == 0, 10, "the poison notification's ack")
    assert fleet.submit("alice", "still here").result(10).ok
    status = snapshot(r)
    assert status["tiers"]["chat"]["dead_letter_kinds"] == {"delivery_limit": 1}
    assert "dead: 1 delivery_limit" in _status_text(status)
    wait_until(lambda: worker_stats(r, w.worker_id) == 1, 20, "the worker's report counting it")

    r.delete(key_of("mallory"))
    mended = fleet.submit("mallory", "mended").result(10)
    assert mended.ok and mended.text.startswith("echo: mended")
    assert len([d for d in dead_letters(r) if d["user"] == "mallory"]) == 1
