"""protocol.codec: versioned msgpack round trips, and clear reasons for what cannot decode."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from pydantic import BaseModel

from protocol.codec import PROTOCOL_VERSION, CodecError, decode, encode, unpack, validate
from protocol.models import (
    Control,
    Counters,
    MemoryItem,
    OccupancyReport,
    Reply,
    SessionEntry,
    Slots,
    Turn,
    WorkerInfo,
)

SAMPLES: list[BaseModel] = [
    Turn(turn_id="t1", user="alice", text="hello", ts=1700000000.25),
    Turn(turn_id="t-2", user="a.b@c+d", tier="gpu", text="é ü 字 🙂", ts=1.0,
         meta={"k": [1, 2.5, "x"], "nested": {"a": None, "b": True}}, reply_fmt="json"),
    Turn(turn_id="t3", user="bob", text="", ts=0.0),
    Reply(turn_id="t1", user="alice", ok=True, text="hi", worker="w1", ts=2.0, attempts=2,
          context={"memories": ["m"], "profile": {"name": "A"}}),
    Reply(turn_id="t1", user="alice", ok=False, error="bad turn: x"),
    OccupancyReport(worker="w1", tier="chat", ts=3.0, state="ready", users=4, active_users=2,
                    slots=Slots(busy=1, total=8, queue_depth=3), cpu=0.5, rss=123456,
                    counters=Counters(turns=10, errors=1, handler_seconds=2.5), load=(0.1, 0.2, 0.3)),
    OccupancyReport(worker="w2", tier="chat", ts=3.0, state="starting", users=0, active_users=0,
                    slots=Slots(busy=0, total=8), cpu=None, rss=0, counters=Counters(), load=(0, 0, 0)),
    Control(kind="drain", ts=5.0, reason="scale-in"),
    Control(kind="drain", ts=5.0),
    MemoryItem(id="m1", text="likes tea", importance=1.0, ts=6.0),
    MemoryItem(id="m2", text="x", importance=1e-9, ts=-1.0),
    SessionEntry(turn_id="t1", entry="1700000000000-0", text="hi", reply="hello", ts=7.0),
    WorkerInfo(worker="w1", tier="chat", pid=42, host="h", started=8.0),
]


@pytest.mark.parametrize("model", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(model: BaseModel) -> None:
    data = encode(model)
    assert isinstance(data, bytes)
    assert decode(type(model), data) == model


@pytest.mark.parametrize("model", SAMPLES, ids=lambda m: type(m).__name__)
def test_encoded_map_carries_the_version(model: BaseModel) -> None:
    body = msgpack.unpackb(encode(model))
    assert body["v"] == PROTOCOL_VERSION


def test_round_trip_of_reply_text_near_the_limit_with_max_bytes() -> None:
    model = Reply(turn_id="t1", user="alice", ok=True, text="x" * 1000)
    data = encode(model)
    assert decode(Reply, data, max_bytes=len(data)) == model


def _packed(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


CONTROL = {"v": PROTOCOL_VERSION, "kind": "drain", "ts": 1.0}

REJECTIONS = [
    pytest.param(b"", "not msgpack", id="empty"),
    pytest.param(b"\xc1", "not msgpack", id="never-used-byte"),
    pytest.param(b"\x92\x01", "not msgpack", id="truncated-array"),
    pytest.param(_packed(CONTROL) + b"\x00", "not msgpack", id="trailing-data"),
    pytest.param(b"\xa2\xff\xfe", "not msgpack", id="str-not-utf8"),
    pytest.param(_packed({1: "x"}), "not msgpack", id="int-map-key"),
    pytest.param(_packed([1, 2]), "expected a msgpack map, got list", id="array"),
    pytest.param(_packed("drain"), "expected a msgpack map, got str", id="string"),
    pytest.param(_packed(None), "expected a msgpack map, got NoneType", id="nil"),
    pytest.param(_packed(7), "expected a msgpack map, got int", id="int"),
    pytest.param(_packed({"kind": "drain", "ts": 1.0}), "unsupported protocol version None", id="no-version"),
    pytest.param(_packed({**CONTROL, "v": 2}), "unsupported protocol version 2", id="version-2"),
    pytest.param(_packed({**CONTROL, "v": 0}), "unsupported protocol version 0", id="version-0"),
    pytest.param(_packed({**CONTROL, "v": "1"}), "unsupported protocol version '1'", id="version-str"),
    pytest.param(_packed({**CONTROL, "v": None}), "unsupported protocol version None", id="version-nil"),
    pytest.param(_packed({"v": 1, "ts": 1.0}), "kind: Field required", id="missing-field"),
    pytest.param(_packed({**CONTROL, "extra": 1}), "extra: Extra inputs are not permitted", id="extra-field"),
    pytest.param(_packed({**CONTROL, "kind": "explode"}), "kind: Input should be 'drain'", id="bad-literal"),
    pytest.param(_packed({**CONTROL, "ts": "soon"}), "ts: Input should be a valid number", id="bad-type"),
    pytest.param(_packed({"v": 1, b"kind": "drain", "ts": 1.0}), "Keys should be strings", id="bytes-key"),
]


@pytest.mark.parametrize(("data", "reason"), REJECTIONS)
def test_rejections_say_why(data: bytes, reason: str) -> None:
    with pytest.raises(CodecError) as info:
        decode(Control, data)
    assert reason in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("version", [True, 1.0], ids=["bool", "float"])
def test_non_integer_version_is_rejected(version: object) -> None:
    with pytest.raises(CodecError, match="unsupported protocol version"):
        decode(Control, _packed({**CONTROL, "v": version}))


def test_reason_stays_one_line_for_a_hostile_field_name() -> None:
    with pytest.raises(CodecError) as info:
        decode(Control, _packed({**CONTROL, "x\nFAKE LOG LINE": 1}))
    assert "\n" not in str(info.value)


def test_error_reason_is_one_line_and_capped_at_three_errors() -> None:
    body = {"v": 1, "a": 1, "b": 2, "c": 3, "d": 4}  # 2 missing + 4 extra
    with pytest.raises(CodecError) as info:
        decode(Control, _packed(body))
    msg = str(info.value)
    assert msg.count(";") == 2
    assert "(+3 more)" in msg


def test_not_msgpack_reason_is_capped() -> None:
    with pytest.raises(CodecError) as info:
        decode(Control, b"\xc1" * 10_000)
    assert len(str(info.value)) <= 300


@pytest.mark.parametrize(
    ("extra_bytes", "ok"),
    [(-1, True), (0, True), (1, False), (1000, False)],
    ids=["under", "at-limit", "one-over", "far-over"],
)
def test_max_bytes(extra_bytes: int, ok: bool) -> None:
    data = encode(Control(kind="drain", ts=1.0))
    limit = len(data) - extra_bytes
    if ok:
        assert decode(Control, data, max_bytes=limit).kind == "drain"
    else:
        with pytest.raises(CodecError, match=f"over the limit of {limit}"):
            decode(Control, data, max_bytes=limit)


def test_oversize_is_checked_before_parsing() -> None:
    # garbage that is too big says "over the limit", not "not msgpack": no parsing was tried
    with pytest.raises(CodecError, match="over the limit"):
        decode(Control, b"\xc1" * 100, max_bytes=10)


def test_unpack_removes_the_version() -> None:
    assert unpack(_packed(CONTROL)) == {"kind": "drain", "ts": 1.0}


def test_validate_turns_errors_into_codec_errors() -> None:
    with pytest.raises(CodecError, match="importance"):
        validate(MemoryItem, {"id": "m", "text": "t", "importance": 0.0, "ts": 1.0})


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"turn_id": "a b", "user": "alice", "text": "x", "ts": 1.0}, "turn_id"),
        ({"turn_id": "t", "user": "a{b}", "text": "x", "ts": 1.0}, "user"),
        ({"turn_id": "t", "user": "alice", "tier": "Chat", "text": "x", "ts": 1.0}, "tier"),
        ({"turn_id": "t", "user": "alice", "text": "x" * 32_001, "ts": 1.0}, "text"),
        ({"turn_id": "t", "user": "alice", "text": "x", "ts": 1.0, "reply_fmt": "xml"}, "reply_fmt"),
        ({"turn_id": "t", "user": "alice", "text": "x", "ts": 1.0, "meta": [1]}, "meta"),
    ],
)
def test_turn_fields_are_validated_in_the_codec(body: dict[str, Any], field: str) -> None:
    with pytest.raises(CodecError, match=field):
        decode(Turn, _packed({"v": 1, **body}))


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (MemoryItem, {"id": "m", "text": "t", "importance": 1.5, "ts": 1.0}),
        (MemoryItem, {"id": "m", "text": "t", "importance": -0.1, "ts": 1.0}),
        (OccupancyReport, {"worker": "w", "tier": "chat", "ts": 1.0, "state": "dead", "users": 0,
                           "active_users": 0, "slots": {"busy": 0, "total": 1}, "rss": 0,
                           "counters": {}, "load": [0, 0, 0]}),
        (OccupancyReport, {"worker": "w", "tier": "chat", "ts": 1.0, "state": "ready", "users": -1,
                           "active_users": 0, "slots": {"busy": 0, "total": 1}, "rss": 0,
                           "counters": {}, "load": [0, 0, 0]}),
        (OccupancyReport, {"worker": "w", "tier": "chat", "ts": 1.0, "state": "ready", "users": 0,
                           "active_users": 0, "slots": {"busy": 0, "total": 1}, "rss": 0,
                           "counters": {}, "load": [0, 0]}),
        (SessionEntry, {"turn_id": "t", "entry": "1-0", "text": "a", "ts": 1.0}),
        (Reply, {"turn_id": "t", "user": "alice"}),
    ],
    ids=["importance>1", "importance<0", "bad-state", "negative-users", "short-load",
         "session-no-reply", "reply-no-ok"],
)
def test_model_constraints_are_codec_errors(model: type[BaseModel], body: dict[str, Any]) -> None:
    with pytest.raises(CodecError):
        decode(model, _packed({"v": 1, **body}))


def test_a_turn_not_streamed_encodes_as_before_streams() -> None:
    import msgpack

    from protocol.models import Turn

    plain = Turn(turn_id="t", user="u", text="x", ts=1.0)
    streamed = Turn(turn_id="t", user="u", text="x", ts=1.0, stream=True)
    assert "stream" not in msgpack.unpackb(encode(plain))  # a worker without the field reads it
    assert decode(Turn, encode(streamed)).stream and not decode(Turn, encode(plain)).stream
