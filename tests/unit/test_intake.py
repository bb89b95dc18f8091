"""worker.intake: inbox entries become turns or clear CodecErrors; replies always have a route."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from protocol.codec import CodecError, encode
from protocol.models import MAX_TEXT_CHARS, Turn
from worker.intake import decode_entry, entry_size, reply_route

ENTRY = "1700000000123-0"
BIG = 1 << 20


def binary(**over: Any) -> dict[bytes, bytes]:
    body: dict[str, Any] = {"turn_id": "t1", "user": "alice", "text": "hello", "ts": 5.0}
    body.update(over)
    return {b"m": encode(Turn(**body))}


def packed(body: Any) -> dict[bytes, bytes]:
    return {b"m": msgpack.packb(body, use_bin_type=True)}


# --- binary form ------------------------------------------------------------------------

def test_binary_turn_decodes_as_sent() -> None:
    sent = Turn(turn_id="t1", user="alice", tier="chat", text="hi", ts=5.0, meta={"a": 1})
    assert decode_entry("alice", "chat", ENTRY, {b"m": encode(sent)}, BIG) == sent


def test_binary_turn_keeps_its_own_ids_and_format() -> None:
    turn = decode_entry("alice", "chat", ENTRY, binary(turn_id="client-id", reply_fmt="json"), BIG)
    assert (turn.turn_id, turn.reply_fmt, turn.ts) == ("client-id", "json", 5.0)


def test_binary_turn_for_another_user_is_rejected() -> None:
    with pytest.raises(CodecError, match="turn is for user 'bob' but sits in the inbox of 'alice'"):
        decode_entry("alice", "chat", ENTRY, binary(user="bob"), BIG)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        pytest.param({b"m": b"\xc1"}, "not msgpack", id="garbage"),
        pytest.param({b"m": b""}, "not msgpack", id="empty"),
        pytest.param(packed([1]), "expected a msgpack map", id="array"),
        pytest.param(packed({"turn_id": "t", "user": "alice", "text": "x", "ts": 1.0}),
                     "unsupported protocol version", id="no-version"),
        pytest.param(packed({"v": 1, "turn_id": "t", "user": "alice", "ts": 1.0}), "text: Field required",
                     id="no-text"),
        pytest.param(packed({"v": 1, "turn_id": "a b", "user": "alice", "text": "x", "ts": 1.0}), "turn_id",
                     id="bad-turn-id"),
        pytest.param(packed({"v": 1, "turn_id": "t", "user": "a:b", "text": "x", "ts": 1.0}), "user",
                     id="bad-user"),
        pytest.param(packed({"v": 1, "turn_id": "t", "user": "alice", "text": "x", "ts": 1.0, "x": 1}),
                     "Extra inputs", id="extra-field"),
    ],
)
def test_broken_binary_turns(fields: dict[bytes, bytes], reason: str) -> None:
    with pytest.raises(CodecError, match=reason):
        decode_entry("alice", "chat", ENTRY, fields, BIG)


# --- plain form -------------------------------------------------------------------------

def test_plain_turn_defaults() -> None:
    turn = decode_entry("alice", "chat", ENTRY, {b"text": b"hi"}, BIG)
    assert turn == Turn(turn_id=ENTRY, user="alice", tier="chat", text="hi", ts=1700000000.123,
                        meta={}, reply_fmt="json")


def test_plain_turn_with_id_and_meta() -> None:
    fields = {b"text": "héllo".encode(), b"turn_id": b"abc-1", b"meta": b'{"sleep_ms": 5, "x": [1]}'}
    turn = decode_entry("alice", "gpu", ENTRY, fields, BIG)
    assert (turn.turn_id, turn.tier, turn.text) == ("abc-1", "gpu", "héllo")
    assert turn.meta == {"sleep_ms": 5, "x": [1]}
    assert turn.reply_fmt == "json"


def test_plain_turn_with_an_odd_entry_id_gets_ts_zero() -> None:
    assert decode_entry("alice", "chat", "abc", {b"text": b"x"}, BIG).ts == 0.0


def test_plain_turn_empty_text_is_a_turn() -> None:
    assert decode_entry("alice", "chat", ENTRY, {b"text": b""}, BIG).text == ""


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        pytest.param({}, "plain turn has no 'text' field", id="no-fields"),
        pytest.param({b"turn_id": b"t1"}, "no 'text' field", id="missing-text"),
        pytest.param({b"text": b"\xff\xfe"}, "'text' is not valid UTF-8", id="text-not-utf8"),
        pytest.param({b"text": b"x", b"meta": b"{nope"}, "'meta' is not JSON", id="meta-not-json"),
        pytest.param({b"text": b"x", b"meta": b""}, "'meta' is not JSON", id="meta-empty"),
        pytest.param({b"text": b"x", b"meta": b"\xff"}, "'meta' is not JSON", id="meta-not-utf8"),
        pytest.param({b"text": b"x", b"meta": b"[1, 2]"}, "'meta' must be a JSON object", id="meta-array"),
        pytest.param({b"text": b"x", b"meta": b'"s"'}, "'meta' must be a JSON object", id="meta-string"),
        pytest.param({b"text": b"x", b"meta": b"null"}, "'meta' must be a JSON object", id="meta-null"),
        pytest.param({b"text": b"x", b"turn_id": b"a b"}, "turn_id", id="turn-id-space"),
        pytest.param({b"text": b"x", b"turn_id": b"a:b"}, "turn_id", id="turn-id-colon"),
        pytest.param({b"text": b"x", b"turn_id": b""}, "turn_id", id="turn-id-empty"),
        pytest.param({b"text": b"x", b"turn_id": b"t" * 65}, "turn_id", id="turn-id-long"),
        pytest.param({b"text": b"x", b"turn_id": b"\xff"}, "turn_id", id="turn-id-not-utf8"),
        pytest.param({b"text": b"x" * (MAX_TEXT_CHARS + 1)}, "text", id="text-too-long"),
    ],
)
def test_broken_plain_turns(fields: dict[bytes, bytes], reason: str) -> None:
    with pytest.raises(CodecError, match=reason):
        decode_entry("alice", "chat", ENTRY, fields, BIG)


@pytest.mark.parametrize("user", ["a b", "", "x" * 65])
def test_plain_turn_in_an_inbox_with_a_bad_user_id(user: str) -> None:
    with pytest.raises(CodecError, match="user"):
        decode_entry(user, "chat", ENTRY, {b"text": b"x"}, BIG)


# --- size -------------------------------------------------------------------------------

def test_entry_size_counts_the_values() -> None:
    # the same measure as the client's limit: the payload bytes, not the field names
    assert entry_size({b"text": b"abc", b"meta": b"{}"}) == 3 + 2
    assert entry_size({}) == 0


@pytest.mark.parametrize("form", ["plain", "binary"])
@pytest.mark.parametrize(("slack", "ok"), [(0, True), (1, True), (-1, False)], ids=["at", "under", "over"])
def test_max_bytes_bounds_the_whole_entry(form: str, slack: int, ok: bool) -> None:
    fields = {b"text": b"x" * 100} if form == "plain" else binary(text="x" * 100)
    limit = entry_size(fields) + slack
    if ok:
        assert decode_entry("alice", "chat", ENTRY, fields, limit).text == "x" * 100
    else:
        with pytest.raises(CodecError, match=f"over the limit of {limit}"):
            decode_entry("alice", "chat", ENTRY, fields, limit)


def test_oversize_is_rejected_before_decoding() -> None:
    with pytest.raises(CodecError, match="over the limit"):
        decode_entry("alice", "chat", ENTRY, {b"m": b"\xc1" * 500}, 100)


def test_a_turn_the_client_accepts_is_not_oversize_for_the_worker() -> None:
    from fleet.client import DEFAULT_MAX_TURN_BYTES, _build_turn

    def build(pad: int) -> bytes:
        return _build_turn("alice", "hi", "chat", {"pad": "x" * pad}, "t1", DEFAULT_MAX_TURN_BYTES)[1]

    pad = 1000 + DEFAULT_MAX_TURN_BYTES - len(build(1000))  # str16 header: one byte per char from here
    payload = build(pad)
    assert len(payload) == DEFAULT_MAX_TURN_BYTES  # exactly at the client's limit: accepted
    decode_entry("alice", "chat", ENTRY, {b"m": payload}, DEFAULT_MAX_TURN_BYTES)


# --- reply_route ------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(binary(), ("t1", "msgpack"), id="binary"),
        pytest.param({b"m": b"\xc1garbage"}, (ENTRY, "msgpack"), id="binary-garbage"),
        pytest.param({b"m": b"\xc1"}, (ENTRY, "msgpack"), id="binary-broken"),
        pytest.param({b"m": b"", b"turn_id": b"t9"}, (ENTRY, "msgpack"), id="binary-wins-over-turn-id"),
        pytest.param({b"text": b"x"}, (ENTRY, "json"), id="plain-no-id"),
        pytest.param({b"text": b"x", b"turn_id": b"abc-1"}, ("abc-1", "json"), id="plain-with-id"),
        pytest.param({b"turn_id": b"abc-1"}, ("abc-1", "json"), id="plain-no-text"),
        pytest.param({b"text": b"x", b"turn_id": b"a b"}, (ENTRY, "json"), id="plain-bad-id"),
        pytest.param({b"text": b"x", b"turn_id": b"a:b"}, (ENTRY, "json"), id="plain-colon-id"),
        pytest.param({b"text": b"x", b"turn_id": b"\xff\xfe"}, (ENTRY, "json"), id="plain-id-not-utf8"),
        pytest.param({b"text": b"x", b"turn_id": b""}, (ENTRY, "json"), id="plain-empty-id"),
        pytest.param({b"text": b"x", b"turn_id": b"t" * 65}, (ENTRY, "json"), id="plain-long-id"),
        pytest.param({}, (ENTRY, "json"), id="empty"),
    ],
)
def test_reply_route(fields: dict[bytes, bytes], expected: tuple[str, str]) -> None:
    assert reply_route(ENTRY, fields) == expected


@pytest.mark.parametrize(
    "fields",
    [
        {b"text": b"x", b"turn_id": b"abc-1"},
        {b"text": b"x"},
        {b"text": b"x", b"turn_id": b"a:b", b"meta": b"[]"},
        {b"turn_id": b"abc-1", b"meta": b"{"},
    ],
)
def test_reply_route_agrees_with_the_decoded_turn(fields: dict[bytes, bytes]) -> None:
    # a plain turn that decodes is answered where reply_route said, so a submitter can rely on it
    route, fmt = reply_route(ENTRY, fields)
    assert fmt == "json"
    try:
        turn = decode_entry("alice", "chat", ENTRY, fields, BIG)
    except CodecError:
        return
    assert turn.turn_id == route


def test_the_route_is_a_valid_reply_key() -> None:
    from protocol import keys

    for fields in ({b"turn_id": b"\xff"}, {b"turn_id": b"{x}"}, {b"m": b""}):
        turn_id, _ = reply_route(ENTRY, fields)
        assert keys.reply("alice", turn_id).endswith(f":reply:{ENTRY}")


# --- inputs that must be CodecErrors, not other exceptions ------------------------------

@pytest.mark.parametrize(
    "meta",
    [b"[" * 100_000, b'{"n": ' + b"1" * 5000 + b"}"],
    ids=["deep-nesting", "huge-int"],
)
def test_hostile_meta_is_a_codec_error(meta: bytes) -> None:
    with pytest.raises(CodecError):
        decode_entry("alice", "chat", ENTRY, {b"text": b"x", b"meta": meta}, BIG)


def test_meta_floats_survive() -> None:
    fields = {b"text": b"x", b"meta": json.dumps({"a": 1.5}).encode()}
    turn = decode_entry("alice", "chat", ENTRY, fields, BIG)
    assert turn.meta == {"a": 1.5}
