"""One place maps a Redis error to its kind (``stores.redis_errors.error_kind``), and
``RedisErrors`` logs each kind once until Redis answers again, and counts every occurrence."""

from __future__ import annotations

import logging

import pytest
import redis
from redis._parsers.base import BaseParser
from redis.exceptions import RedisClusterException

from protocol.models import REDIS_ERROR_KINDS, TurnStats
from stores.redis_errors import RedisErrors, error_kind


def _reply(text: str) -> Exception:
    """The exception redis-py raises for the error reply ``-text``."""
    return BaseParser.parse_error(text)


@pytest.mark.parametrize(("reply", "kind"), [
    ("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", "busy"),
    ("BUSY Redis is busy running a script. You can only call FUNCTION KILL or SHUTDOWN NOSAVE.", "busy"),
    ("NOPERM User fleetw has no permissions to run the 'xreadgroup' command", "noperm"),
    ("READONLY You can't write against a read only replica.", "readonly"),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", "masterdown"),
    ("LOADING Redis is loading the dataset in memory", "loading"),
    ("NOSCRIPT No matching script. Please use EVAL.", "noscript"),
    ("ERR Function not found", "noscript"),
    ("ERR Library 'fleet' not found", "noscript"),
    ("TRYAGAIN Multiple keys request during rehashing of slot", "tryagain"),
    ("CLUSTERDOWN The cluster is down", "clusterdown"),
    ("MOVED 3999 127.0.0.1:6381", "moved"),
    ("ASK 3999 127.0.0.1:6381", "moved"),
    ("UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)", "other"),
    ("ERR something nobody expected", "other"),
    ("WEIRD an error no Redis ever answered", "other"),
])
def test_each_error_reply_has_its_kind(reply: str, kind: str) -> None:
    assert error_kind(_reply(reply)) == kind


@pytest.mark.parametrize(("exc", "kind"), [
    (redis.ConnectionError("Connection refused"), "connection"),
    (ConnectionResetError(104, "reset"), "connection"),
    (redis.TimeoutError("Timeout reading from socket"), "timeout"),
    (TimeoutError(), "timeout"),
    (RedisClusterException("no node for slot"), "clusterdown"),
])
def test_connection_and_cluster_errors_have_their_kind(exc: Exception, kind: str) -> None:
    assert error_kind(exc) == kind


def test_every_kind_is_a_declared_one() -> None:
    assert {"busy", "noperm", "readonly", "masterdown", "loading", "noscript", "tryagain", "clusterdown",
            "moved", "connection", "timeout", "other"} == set(REDIS_ERROR_KINDS)


def test_a_kind_is_logged_once_until_redis_answers_again(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    errors = RedisErrors(logging.getLogger("t"), clock=lambda: now[0])
    busy = _reply("BUSY Redis is busy running a script.")
    with caplog.at_level(logging.INFO, logger="t"):
        for _ in range(5):
            assert errors.failed("pull", busy) == "busy"
        errors.failed("renew", busy)
        errors.failed("renew", _reply("READONLY You can't write against a read only replica."))
        now[0] = 112.0
        errors.answered("pull")  # renew still fails: BUSY is not over
        errors.answered("renew")
        errors.answered("renew")  # nothing more to say
    lines = [r.getMessage() for r in caplog.records]
    assert sum("Redis error BUSY " in ln for ln in lines) == 1
    assert sum("Redis error READONLY " in ln for ln in lines) == 1
    assert sum("Redis answers again after 12 s of BUSY" in ln for ln in lines) == 1, lines
    assert sum("Redis answers again" in ln for ln in lines) == 2, lines
    assert errors.counts == {"busy": 6, "readonly": 1}
    errors.failed("pull", busy)  # a new episode: logged again
    assert sum("Redis error BUSY " in r.getMessage() for r in caplog.records) == 2


def test_each_count_is_reported_and_only_grows() -> None:
    counted: list[str] = []
    errors = RedisErrors(logging.getLogger("t"), counted=counted.append)
    errors.failed("pull", redis.ConnectionError("refused"))
    errors.failed("pull", redis.ConnectionError("refused"))
    assert counted == ["connection", "connection"]
    stats = TurnStats(redis_errors=errors.counts)
    assert stats.redis_errors == {"connection": 2}
    with pytest.raises(ValueError):
        TurnStats.model_validate({"redis_errors": {"made-up": 1}})  # trust nothing read from Redis


def test_workers_counts_add_up_per_tier_and_kind_in_the_commanders_metrics() -> None:
    from commander.metrics import Metrics, sample
    from commander.turn_metrics import TurnTotals, combine, went_down

    a, b = TurnStats(redis_errors={"busy": 3}), TurnStats(redis_errors={"busy": 1, "noperm": 2})
    assert combine(a, b).redis_errors == {"busy": 4, "noperm": 2}
    assert combine(b, TurnStats(redis_errors={"busy": 1}), sign=-1).redis_errors == {"noperm": 2}
    assert went_down(TurnStats(redis_errors={"busy": 3}), TurnStats(redis_errors={"busy": 2}))
    assert not went_down(TurnStats(redis_errors={"busy": 3}), TurnStats(redis_errors={"busy": 3, "other": 1}))
    totals = TurnTotals()
    from tests.unit.test_turn_metrics import report
    totals.add(report("w1", 1.0, a))
    totals.add(report("w1", 2.0, TurnStats(redis_errors={"busy": 5})))
    totals.add(report("w2", 2.0, b))
    m = Metrics()
    m.observe_turns("chat", totals.tier("chat"))
    assert sample(m, "fleet_worker_redis_errors_total", {"tier": "chat", "kind": "busy"}) == 6
    assert sample(m, "fleet_worker_redis_errors_total", {"tier": "chat", "kind": "noperm"}) == 2


def test_the_commanders_own_errors_are_counted_by_kind() -> None:
    from commander.metrics import Metrics, sample

    m = Metrics()
    m.redis_error("busy")
    m.redis_error("busy")
    assert sample(m, "fleet_commander_redis_errors_total", {"kind": "busy"}) == 2
