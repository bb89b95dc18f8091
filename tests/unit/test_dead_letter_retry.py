"""The pure parts of the dead-letter retry and the user view: what an entry keeps, the turn a
retry re-enqueues (or why not), its turn id, and the readings of raw replies."""

from __future__ import annotations

import json

import msgpack
import pytest

from fleet.cli_users import user_text
from protocol.codec import decode, encode
from protocol.ids import InvalidId
from protocol.models import MAX_TEXT_CHARS, SessionEntry, Turn
from stores.deadletters import (
    DEAD_TURN_BYTES,
    NOT_KEPT,
    dead_letter_fields,
    parse_dead_letter,
    retry_turn,
    retry_turn_id,
    validate_dead_letter_id,
)
from stores.users import UserView, counters, lane_parts


@pytest.mark.parametrize(("turn_id", "retried"), [
    ("t1", "t1.r1"),
    ("t1.r1", "t1.r2"),
    ("t1.r9", "t1.r10"),
    ("1700000000000-0", "1700000000000-0.r1"),
    ("a.rx", "a.rx.r1"),
    ("x" * 64, "x" * 61 + ".r1"),
    ("x" * 60 + ".r99", "x" * 59 + ".r100"),  # cut to 64
])
def test_retry_turn_id(turn_id: str, retried: str) -> None:
    assert retry_turn_id(turn_id) == retried
    assert retry_turn_id(turn_id) == retry_turn_id(turn_id)  # one dead letter, one id
    assert len(retried) <= 64


def entry(fields: dict[bytes, bytes], *, user: str = "bob", turn_id: str = "t1",
          entry_id: str = "5-0") -> dict[bytes, bytes]:
    """A dead-letter entry as Redis returns it (bytes), from what the writer builds."""
    built = dead_letter_fields(user=user, entry=entry_id, turn_id=turn_id, reason="boom", worker="w",
                               fields=fields, now=12.5)
    return {k.encode() if isinstance(k, str) else k: v if isinstance(v, bytes) else str(v).encode()
            for k, v in built.items()}


def binary(user: str = "bob", text: str = "hi", **kw: object) -> dict[bytes, bytes]:
    return {b"m": encode(Turn(turn_id="t1", user=user, tier="gpu", text=text, ts=1.0, **kw))}


def test_a_binary_turn_is_kept_whole_and_retried_under_a_new_id() -> None:
    fields = entry(binary(meta={"sleep_ms": 5}))
    assert msgpack.unpackb(fields[b"turn"], raw=True) == binary(meta={"sleep_ms": 5})
    turn = retry_turn("chat", fields, 99.0)
    assert isinstance(turn, Turn)
    assert (turn.turn_id, turn.user, turn.tier, turn.text, turn.ts, turn.meta, turn.reply_fmt) == \
        ("t1.r1", "bob", "gpu", "hi", 99.0, {"sleep_ms": 5}, "msgpack")


def test_a_plain_turn_is_retried_as_a_json_one_of_its_tier() -> None:
    turn = retry_turn("chat", entry({b"text": "héllo".encode(), b"meta": b'{"a": 1}'}), 5.0)
    assert isinstance(turn, Turn)
    assert (turn.tier, turn.text, turn.meta, turn.reply_fmt, turn.turn_id) == \
        ("chat", "héllo", {"a": 1}, "json", "t1.r1")
    turn = retry_turn("chat", entry({b"text": b"x", b"tier": b"gpu"}), 5.0)
    assert isinstance(turn, Turn) and turn.tier == "gpu"


@pytest.mark.parametrize(("fields", "why"), [
    ({b"m": b"\xc1 not msgpack"}, "cannot retry: not msgpack"),
    ({b"txt": b"typo"}, "cannot retry: plain turn has no 'text' field"),
    ({b"text": b"\xff"}, "cannot retry: 'utf-8' codec"),
    ({b"text": b"x", b"meta": b"{nope"}, "cannot retry: 'meta' is not JSON"),
    ({b"text": b"x", b"meta": b"[1]"}, "cannot retry: 'meta' must be a JSON object"),
    ({b"text": b"x", b"tier": b"Bad Tier"}, "cannot retry: 1 validation error"),
    ({b"text": b"x" * (MAX_TEXT_CHARS + 1)}, "cannot retry: 1 validation error"),
])
def test_a_turn_that_would_fail_again_is_not_retriable(fields: dict[bytes, bytes], why: str) -> None:
    got = retry_turn("chat", entry(fields), 1.0)
    assert isinstance(got, str) and got.startswith(why), got


def test_what_is_not_kept_says_so() -> None:
    old = {b"user": b"bob", b"entry": b"5-0", b"turn_id": b"t1", b"reason": b"boom"}
    assert retry_turn("chat", old, 1.0) == NOT_KEPT
    assert retry_turn("chat", {b"user": b"x}{y", b"entry": b"", b"reason": b"bad"}, 1.0) == \
        "cannot retry: a bad notification, not a turn"
    note = entry({b"user": b"x}{y"}, user="x}{y", turn_id="", entry_id="")
    assert b"turn" not in note  # a notification's fields are not a turn to keep
    big = entry({b"text": b"x" * DEAD_TURN_BYTES})
    assert b"turn" not in big and retry_turn("chat", big, 1.0) == NOT_KEPT
    other = entry(binary(user="eve"))  # a turn for another user than the inbox it sat in
    assert "dead-lettered for 'bob'" in str(retry_turn("chat", other, 1.0))
    unreadable = {**entry({b"text": b"x"}), b"turn": msgpack.packb([1])}
    assert retry_turn("chat", unreadable, 1.0) == "cannot retry: the kept turn is unreadable"


def test_a_dead_letter_reads_as_a_row_even_when_fields_are_missing() -> None:
    row = parse_dead_letter("chat", "7-0", entry({b"text": b"hi"}))
    assert (row.user, row.entry, row.turn_id, row.reason, row.ts, row.size, row.retriable) == \
        ("bob", "5-0", "t1", "boom", 12.5, 6, True)
    assert json.loads(row.payload) == {"text": "hi"}
    bare = parse_dead_letter("chat", "8-0", {b"user": b"u9", b"reason": b"boom", b"ts": b"nan?"})
    assert (bare.user, bare.turn_id, bare.ts, bare.size, bare.retriable) == ("u9", "", 0.0, 0, False)
    assert bare.to_json()["id"] == "8-0"


@pytest.mark.parametrize("bad", ["", "x", "1-", "-1", "1-0-0", "1-0 ", "+", "(1-0"])
def test_dead_letter_ids_are_checked(bad: str) -> None:
    with pytest.raises(InvalidId, match="invalid dead-letter id"):
        validate_dead_letter_id(bad)
    assert validate_dead_letter_id("1700000000000-12") == "1700000000000-12"


@pytest.mark.parametrize(("raw", "parts"), [
    (None, (None, None)),
    (b"chat-w1|17", ("chat-w1", 17)),
    (b"a|b|3", ("a|b", 3)),
    (b"chat-w1|x", ("chat-w1", None)),
    (b"odd", ("odd", None)),
])
def test_lane_parts(raw: bytes | None, parts: tuple[str | None, int | None]) -> None:
    assert lane_parts(raw) == parts


def test_counters_leave_out_what_is_no_number() -> None:
    assert counters({b"turns": b"3", b"chars_in": b"-1", b"junk": b"x"}) == {"turns": 3, "chars_in": -1}
    assert counters(None) == {}


def test_user_text_and_json() -> None:
    view = UserView(user="ann", lane_holder="chat-w1", lane_token=4, lane_ttl_ms=1500, cursor="5-0",
                    inbox_after_cursor=1000, inbox_exact=False,
                    session=[SessionEntry(turn_id="t1", entry="5-0", text="hi\nthere", reply="r" * 80,
                                          ts=90.0)],
                    pending=["chat"], pending_partial=["gpu"], usage={"turns": 2}, dead_letters=[],
                    tiers=["chat", "gpu"])
    text = user_text(view, 100.0)
    assert "lane     held by chat-w1 (token 4, 1500 ms left)" in text
    assert "inbox    at most 1000 turn(s)" in text
    assert "notification in: chat (not scanned to the end in: gpu)" in text
    assert "10s ago  t1  > hi there  < " + "r" * 49 + "…" in text
    assert json.loads(json.dumps(view.to_json()))["session"][0]["turn_id"] == "t1"


def test_retry_all_walks_the_pages_once_and_stops_at_the_newest_it_saw(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import fakeredis

    from protocol import keys
    from stores import deadletters

    r = fakeredis.FakeRedis()
    monkeypatch.setattr(deadletters, "PAGE", 3)
    ids = []
    for i in range(7):  # every third one written before turns were kept
        fields = {"user": "bob", "entry": f"{i + 1}-0", "turn_id": f"t{i}", "reason": "boom"}
        if i % 3:
            fields["turn"] = msgpack.packb({b"text": f"turn {i}".encode()})
        ids.append(r.xadd(keys.dead("chat"), fields).decode())
    real = deadletters._resubmit

    def resubmit_and_fail_again(r_: object, tier: str, batch: list) -> list:  # a new dead letter each
        done = real(r_, tier, batch)
        for _id, turn in batch:
            r.xadd(keys.dead("chat"), {"user": "bob", "entry": "9-0", "turn_id": turn.turn_id,
                                       "reason": "again", "turn": msgpack.packb({b"text": b"x"})})
        return done

    monkeypatch.setattr(deadletters, "_resubmit", resubmit_and_fail_again)
    done = deadletters.retry_dead_letters(r, "chat", None)
    assert [d.id for d in done] == ids  # each once, in order, and none of the new ones
    assert [d.outcome for d in done] == ["not_retriable", "retried", "retried"] * 2 + ["not_retriable"]
    queued = [decode(Turn, f[b"m"]) for _i, f in r.xrange(keys.inbox("bob"))]
    assert [(t.text, t.turn_id, t.reply_fmt) for t in queued] == \
        [(f"turn {i}", f"t{i}.r1", "json") for i in (1, 2, 4, 5)]  # in the dead letters' order
    assert r.xlen(keys.dead("chat")) == 3 + 4  # the unretriable ones and the new failures
