"""The client's reading of a reply stream, sans I/O (``fleet.client._StreamRead``) on fakeredis:
chunks, restarts, the end and the reply; bad entries skipped; a step cut midway keeps what it took."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from fleet.client import Restart, TurnTimeout, _StreamRead
from protocol import keys
from protocol.codec import encode
from protocol.models import Reply
from stores.roundtrips import run

U, T = "alice", "t1"


def reply(text: str = "hello") -> bytes:
    return encode(Reply(turn_id=T, user=U, ok=True, text=text))


def add(r: fakeredis.FakeRedis, **fields: Any) -> None:
    r.xadd(keys.stream(U, T), {k: str(v) for k, v in fields.items()})


def test_chunks_restarts_and_the_reply_in_order() -> None:
    r = fakeredis.FakeRedis()
    read = _StreamRead(U, T, 1 << 20)
    add(r, k="chunk", a=1, t="hel")
    assert run(r, read.step(0.01, 1.0)) == ["hel"]
    assert run(r, read.step(0.01, 1.0)) == []  # nothing new
    add(r, k="restart", a=2)
    add(r, k="chunk", a=2, t="hel")
    add(r, k="chunk", a=2, t="lo")
    add(r, k="end", status="ok")
    r.rpush(keys.reply(U, T), reply())
    items = run(r, read.step(0.01, 1.0))
    assert items[:3] == [Restart(2), "hel", "lo"] and isinstance(items[3], Reply) and items[3].text == "hello"
    assert not r.exists(keys.reply(U, T))  # taken, as a wait takes it


def test_a_reply_without_an_end_read_yet_reads_the_rest_first() -> None:
    r = fakeredis.FakeRedis()
    read = _StreamRead(U, T, 1 << 20)
    add(r, k="chunk", a=1, t="a")
    assert run(r, read.step(0.01, 1.0)) == ["a"]
    add(r, k="chunk", a=1, t="b")
    add(r, k="end", status="ok")
    r.rpush(keys.reply(U, T), reply("ab"))
    read.after = "0-0"  # as if the XREAD had come back before the commit, the LPOP after it
    read.ended, read.attempt = False, 0
    items = run(r, read.step(0.01, 1.0))
    assert items[:2] == ["a", "b"] and isinstance(items[-1], Reply)


def test_a_turn_never_streamed_ends_with_its_reply() -> None:
    r = fakeredis.FakeRedis()
    r.rpush(keys.reply(U, T), reply("plain"))
    items = run(r, _StreamRead(U, T, 1 << 20).step(0.01, 1.0))
    assert len(items) == 1 and isinstance(items[0], Reply) and items[0].text == "plain"


def test_bad_entries_and_stale_chunks_are_skipped_and_counted() -> None:
    r = fakeredis.FakeRedis()
    read = _StreamRead(U, T, 1 << 20)
    add(r, k="restart", a=3)
    add(r, k="chunk", a=2, t="stale")
    add(r, k="nonsense")
    add(r, x="y")
    add(r, k="chunk", a="NaN", t="z")
    add(r, k="chunk", a=3, t="ok")
    assert run(r, read.step(0.01, 1.0)) == [Restart(3), "ok"]
    assert read.skipped == 4


def test_an_end_whose_reply_another_reader_took_times_out() -> None:
    r = fakeredis.FakeRedis()
    add(r, k="end", status="ok")
    with pytest.raises(TurnTimeout, match="another reader"):
        run(r, _StreamRead(U, T, 1 << 20).step(0.01, 0.05))


class CutAfterLpop(fakeredis.FakeRedis):
    """The reading of the rest fails once (a lost connection) after the reply was taken."""

    cut = True

    def xrange(self, *args: Any, **kwargs: Any) -> Any:
        if self.cut:
            self.cut = False
            raise RedisConnectionError("lost (test)")
        return super().xrange(*args, **kwargs)


def test_a_step_cut_after_taking_the_reply_keeps_it_for_its_retry() -> None:
    r = CutAfterLpop()
    read = _StreamRead(U, T, 1 << 20)
    add(r, k="chunk", a=1, t="x")
    r.rpush(keys.reply(U, T), reply("x"))
    read.ended = False
    with pytest.raises(RedisConnectionError):
        run(r, read.step(0.01, 1.0))
    items = run(r, read.step(0.01, 1.0))  # the retry: the reply is gone from its list, kept here
    assert items[0] == "x" and isinstance(items[-1], Reply) and items[-1].text == "x"
