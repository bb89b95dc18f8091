"""fleet.client: the submit transaction's shape and replies.

The transaction's behaviour on a real server (a connection lost mid-submit, a refused command)
is in tests/integration/test_client.py; here the pure parts.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from fleet.client import _build_turn, _queue_round_trip, committed
from protocol import keys


class Recorder:
    """A pipeline that records the commands queued on it."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any) -> None:
        self.sent.append(args)

    def xadd(self, key: str, fields: dict[str, Any]) -> None:
        self.sent.append(("XADD", key))

    def zadd(self, key: str, mapping: dict[str, float]) -> None:
        self.sent.append(("ZADD", key))

    def xinfo_groups(self, key: str) -> None:
        self.sent.append(("XINFO GROUPS", key))

    def get(self, key: str) -> None:
        self.sent.append(("GET", key))


# --- the round trip's shape ---------------------------------------------------------------
def test_the_submit_commands_are_inside_multi_exec_and_the_gauges_after_it() -> None:
    built = [_build_turn(u, "hi", "chat", None, None, 1 << 16) for u in ("alice", "bob")]
    pipe = Recorder()
    _queue_round_trip(pipe, built, "chat")
    per_turn = [("XADD", keys.inbox(u)) for u in ("alice", "bob")]
    assert pipe.sent == [
        ("MULTI",),
        per_turn[0], ("XADD", keys.ready("chat")), ("ZADD", keys.active("chat")),
        per_turn[1], ("XADD", keys.ready("chat")), ("ZADD", keys.active("chat")),
        ("EXEC",),
        ("XINFO GROUPS", keys.ready("chat")), ("GET", keys.starting("chat")),
    ]


def _replies(exec_reply: Any, queued: list[Any] | None = None, multi: Any = b"OK") -> list[Any]:
    return [multi, *(queued or [b"QUEUED"] * 3), exec_reply, ["groups"], b"2"]


def test_committed_returns_the_gauges_of_an_applied_transaction() -> None:
    assert committed(_replies([b"1-0", b"1-1", 1]), 1) == [["groups"], b"2"]


@pytest.mark.parametrize(("replies", "error"), [
    pytest.param(_replies(redis.ResponseError("NOPERM exec"), [redis.ResponseError("NOPERM xadd")] * 3,
                          multi=redis.ResponseError("NOPERM multi")),
                 "NOPERM multi", id="multi-refused"),
    pytest.param(_replies(redis.exceptions.ExecAbortError("EXECABORT discarded"),
                          [b"QUEUED", b"QUEUED", redis.ResponseError("NOPERM zadd")]),
                 "NOPERM zadd", id="queue-time-refusal-is-the-cause"),
    pytest.param(_replies(redis.exceptions.ExecAbortError("EXECABORT discarded")), "EXECABORT",
                 id="aborted"),
    pytest.param(_replies([b"1-0", redis.ResponseError("WRONGTYPE ready"), 1]), "WRONGTYPE",
                 id="runtime-error-inside-exec"),
    pytest.param(_replies(None), "unexpected reply", id="no-array"),
    pytest.param(_replies([b"1-0"]), "unexpected reply", id="short-array"),
])
def test_committed_raises_the_first_error_of_the_transaction(replies: list[Any], error: str) -> None:
    with pytest.raises(redis.ResponseError, match=error):
        committed(replies, 1)
