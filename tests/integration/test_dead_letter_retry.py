"""Retrying and purging dead letters against a real redis-server and real workers:
a turn a failing handler dead-lettered is retried, served, answered once; purge removes."""

from __future__ import annotations

import json

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.codec import decode, encode
from protocol.groups import Group
from protocol.models import Reply, SessionEntry, Turn
from protocol.policy import TurnsPolicy, turns_policy
from stores import deadletters
from stores.deadletters import dead_letter_rows, purge_dead_letters, retry_dead_letters
from stores.policies import write_policy
from tests.helpers import fleet_cli
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration


def session_ids(r: redis.Redis, user: str) -> list[str]:
    return [decode(SessionEntry, raw).turn_id for raw in r.lrange(keys.session(user), 0, -1)]


def dead_letter_a_turn(r: redis.Redis, redis_server, start_worker, user: str, text: str):
    """A turn the handler fails on every attempt, dead-lettered; then the handler is fixed (the
    failing worker stopped, the policy changed, a new worker started)."""
    write_policy(r, "chat", TurnsPolicy(handler="sleep", max_attempts=2,
                                        handler_options={"sleep_ms": 1, "fail_attempts": 9}))
    failing = start_worker()
    fleet = Fleet(redis_server.role_url("fleet-client"))
    handle = fleet.submit(user, text)
    reply = handle.result(20)
    assert not reply.ok and "injected failure" in reply.error
    row = wait_until(lambda: dead_letter_rows(r, "chat", 10, user), 10, "the dead letter")[0]
    assert row.retriable and row.turn_id == handle.turn_id and row.user == user
    failing.proc.terminate()
    failing.proc.wait(timeout=15)
    write_policy(r, "chat", TurnsPolicy(handler="sleep", max_attempts=2, handler_options={"sleep_ms": 1}))
    start_worker()
    return fleet, handle, row


def test_a_retried_dead_letter_is_served_in_order_and_its_reply_arrives(r, redis_server, start_worker):
    fleet, handle, row = dead_letter_a_turn(r, redis_server, start_worker, "bob", "boom")
    before = fleet.submit("bob", "queued before the retry")  # the retry goes after it
    done = retry_dead_letters(r, "chat", [row.id])
    assert [(d.id, d.outcome, d.user, d.tier) for d in done] == [(row.id, "retried", "bob", "chat")]
    assert done[0].turn_id == f"{handle.turn_id}.r1"
    assert before.result(10).ok
    got = r.blpop([keys.reply("bob", done[0].turn_id)], timeout=10)
    assert got, "no reply to the retried turn"
    reply = decode(Reply, got[1])  # a binary turn: a msgpack reply, as the original's
    assert reply.ok and reply.text == "slept: boom"
    assert session_ids(r, "bob") == [before.turn_id, done[0].turn_id]
    assert dead_letter_rows(r, "chat", 10) == []  # removed once re-enqueued
    again = retry_dead_letters(r, "chat", [row.id])
    assert [(d.outcome, d.reason) for d in again] == [("unknown", f"no dead letter {row.id} in tier chat")]


def test_a_retry_that_crashed_before_the_delete_is_answered_once(r, redis_server, start_worker, monkeypatch):
    fleet, handle, row = dead_letter_a_turn(r, redis_server, start_worker, "carol", "once")

    def lost(self, *ids):  # the process dies between the submit and the delete
        raise redis.ConnectionError("lost")

    monkeypatch.setattr(type(r), "xdel", lost)  # redis.Redis, or RedisCluster on the cluster run
    with pytest.raises(redis.ConnectionError):
        retry_dead_letters(r, "chat", [row.id])
    monkeypatch.undo()
    assert [d.id for d in dead_letter_rows(r, "chat", 10)] == [row.id]  # kept: it may be retried
    done = retry_dead_letters(r, "chat", None)  # --all
    assert [(d.id, d.outcome) for d in done] == [(row.id, "retried")]
    assert fleet._wait("carol", done[0].turn_id, 10).ok
    # both copies are consumed (the second as a duplicate): the lane is released with an empty inbox
    wait_until(lambda: r.xlen(keys.inbox("carol")) == 0 and not r.exists(keys.lane("carol")), 10,
               "both copies to be consumed")
    assert session_ids(r, "carol") == [done[0].turn_id]  # served once
    assert r.llen(keys.reply("carol", done[0].turn_id)) == 0  # one reply, taken
    assert r.hget(keys.usage("carol"), "turns") == b"1"


def test_old_entries_cannot_be_retried_and_purge_removes(r, fleet_env, tmp_path):
    # written before the turn was kept, and a bad notification's
    old = r.xadd(keys.dead("chat"), {"user": "dan", "entry": "1-0", "turn_id": "t1", "reason": "boom"})
    note = r.xadd(keys.dead("chat"), {"user": "x}{y", "entry": "", "turn_id": "", "reason": "bad note"})
    old, note = old.decode(), note.decode()
    done = retry_dead_letters(r, "chat", [old, note, "9-9"])
    assert [(d.id, d.outcome, d.reason) for d in done] == [
        (old, "not_retriable", deadletters.NOT_KEPT),
        (note, "not_retriable", "cannot retry: a bad notification, not a turn"),
        ("9-9", "unknown", "no dead letter 9-9 in tier chat")]
    assert r.xlen(keys.dead("chat")) == 2  # kept

    out = fleet_cli(fleet_env, "dead-letters", "retry", old, "--json", cwd=tmp_path)
    assert out.returncode == 1 and json.loads(out.stdout)[0]["outcome"] == "not_retriable"
    out = fleet_cli(fleet_env, "dead-letters", cwd=tmp_path)  # the listing as before
    assert out.returncode == 0 and f"{old}  user='dan' turn=t1  boom" in out.stdout
    for argv, why in ((["retry"], "nothing to retry"), (["purge", old, "--all"], "not both"),
                      (["purge", "nope"], "invalid dead-letter id"), (["retry", "--all", "--tier", "A"],
                                                                      "invalid tier")):
        out = fleet_cli(fleet_env, "dead-letters", *argv, cwd=tmp_path)
        assert out.returncode == 2 and why in out.stderr and len(out.stderr.splitlines()) == 1, (argv, out)

    out = fleet_cli(fleet_env, "dead-letters", "purge", old, "9-9", cwd=tmp_path)
    assert out.returncode == 0 and "1 dead letter(s) removed" in out.stdout, out
    r.xadd(keys.dead("chat"), {"user": "eve", "reason": "x"})
    out = fleet_cli(fleet_env, "dead-letters", "--tier", "chat", "purge", "--all", "--json", cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)["removed"] == 2, out
    assert r.xlen(keys.dead("chat")) == 0
    assert purge_dead_letters(r, "chat", None) == 0


def test_a_retry_on_a_tier_with_groups_goes_to_the_pool_of_the_users_group(r):
    # every user's group is green (weight 100): its pool, chat.green, is what its workers read
    groups = (Group(name="blue", weight=0), Group(name="green", weight=100))
    write_policy(r, "chat", turns_policy(groups=groups))
    kept = {b"m": encode(Turn(turn_id="t1", user="dora", tier="chat", text="again", ts=1.0))}
    r.xadd(keys.dead("chat"), deadletters.dead_letter_fields(user="dora", entry="5-0", turn_id="t1",
                                                             reason="boom", worker="w", fields=kept, now=2.0))
    (row,) = dead_letter_rows(r, "chat", 10)
    (done,) = retry_dead_letters(r, "chat", [row.id])
    assert (done.outcome, done.user, done.turn_id) == ("retried", "dora", "t1.r1")
    assert r.xlen(keys.ready("chat.green")) == 1  # the notification: where green's workers read
    assert not r.exists(keys.ready("chat")) and not r.exists(keys.ready("chat.blue"))
    assert r.xlen(keys.inbox("dora")) == 1
