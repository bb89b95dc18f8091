"""Fuzzing the boundary decoders: any input is a valid result or the documented error, never a crash.

``decode_entry`` and ``codec.decode`` may only raise ``CodecError``; ``parse_policy`` and
``parse_assignments`` only ``PolicyError``.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protocol.codec import CodecError, decode
from protocol.models import Control, MemoryItem, Turn
from protocol.policy import (
    KINDS,
    PolicyError,
    RqPolicy,
    TurnsPolicy,
    parse_assignments,
    parse_policy,
    resolve,
)
from protocol.policy_legacy import FLAT_KEYS
from worker.intake import decode_entry, reply_route

FUZZ = settings(database=None, deadline=None, max_examples=400,
                suppress_health_check=[HealthCheck.too_slow])

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats() | st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)
msgpack_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
                   | st.floats() | st.text(max_size=20) | st.binary(max_size=20))
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8) | st.binary(max_size=8), c,
                                                        max_size=4),
    max_leaves=12,
)
turn_keys = st.sampled_from(["turn_id", "user", "tier", "text", "ts", "meta", "reply_fmt", "v", "x"])
control_keys = st.sampled_from(["kind", "ts", "reason", "v", "x"])
entry_ids = st.builds(lambda ms, seq: f"{ms}-{seq}", st.integers(0, 2**48), st.integers(0, 2**16))
field_names = st.sampled_from([b"m", b"text", b"turn_id", b"meta", b"user", b"x"]) | st.binary(max_size=6)
field_values = (st.binary(max_size=60) | st.text(max_size=40).map(str.encode)
                | json_values.map(lambda v: json.dumps(v).encode())
                | msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
users = st.sampled_from(["alice", "bob", "a b", "", "x" * 65]) | st.text(max_size=10)


def _versioned(keys: st.SearchStrategy[str]) -> st.SearchStrategy[bytes]:
    """msgpack maps that pass the version check, so that validation itself is fuzzed."""
    return st.dictionaries(keys, msgpack_values, max_size=8).map(
        lambda d: msgpack.packb({**d, "v": 1}, use_bin_type=True))


# --- codec.decode -----------------------------------------------------------------------

@FUZZ
@given(data=st.binary(max_size=200) | msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True))
       | _versioned(control_keys),
       max_bytes=st.none() | st.integers(0, 300))
@example(data=b"\x93" * 100_000, max_bytes=None)  # deeply nested arrays
@example(data=b"\xdd\xff\xff\xff\xff", max_bytes=None)  # array of 4G items, no data
def test_decode_control_only_raises_codec_error(data: bytes, max_bytes: int | None) -> None:
    try:
        control = decode(Control, data, max_bytes=max_bytes)
    except CodecError as exc:
        assert str(exc)
        return
    assert control.kind == "drain"
    assert max_bytes is None or len(data) <= max_bytes


@FUZZ
@given(data=st.binary(max_size=200) | _versioned(turn_keys)
       | _versioned(st.sampled_from(["id", "text", "importance", "ts"])))
def test_decode_turn_and_memory_only_raise_codec_error(data: bytes) -> None:
    for model in (Turn, MemoryItem):
        try:
            got = decode(model, data)
        except CodecError as exc:
            assert str(exc)
            continue
        assert isinstance(got, model)  # and a valid one: it survives validation again
        assert model.model_validate(got.model_dump()) == got


# --- decode_entry -----------------------------------------------------------------------

@FUZZ
@given(user=users, entry=entry_ids, data=st.binary(max_size=300) | _versioned(turn_keys),
       max_bytes=st.integers(0, 1000))
def test_decode_entry_binary_only_raises_codec_error(user: str, entry: str, data: bytes,
                                                     max_bytes: int) -> None:
    fields = {b"m": data}
    try:
        turn = decode_entry(user, "chat", entry, fields, max_bytes)
    except CodecError:
        return
    assert turn.user == user


@FUZZ
@given(user=users, entry=entry_ids, fields=st.dictionaries(field_names, field_values, max_size=5),
       max_bytes=st.integers(0, 2000))
@example(user="alice", entry="1-0", fields={b"text": b"x", b"meta": b"{}"}, max_bytes=100)
def test_decode_entry_fields_only_raise_codec_error(user: str, entry: str, fields: dict[bytes, bytes],
                                                    max_bytes: int) -> None:
    route, fmt = reply_route(entry, fields)  # never raises, even on garbage
    assert route and fmt in ("msgpack", "json")
    try:
        turn = decode_entry(user, "chat", entry, fields, max_bytes)
    except CodecError:
        return
    assert turn.user == user
    if b"m" not in fields:
        assert turn.reply_fmt == "json" and turn.turn_id == route


# --- parse_policy -----------------------------------------------------------------------

policy_fields = st.sampled_from(sorted({*FLAT_KEYS, *TurnsPolicy.model_fields, *RqPolicy.model_fields,
                                        "bogus"}))
policy_dicts = st.dictionaries(policy_fields, json_values, max_size=6)
plausible_policy_dicts = st.fixed_dictionaries(
    {},
    optional={
        "min_workers": st.integers(-2, 20), "max_workers": st.integers(-2, 20),
        "admission_threshold": st.floats(-0.5, 1.5), "reception_threshold": st.floats(-0.5, 1.5),
        "handler": st.sampled_from(["echo", "sleep", "os.system", "a.b:c", "Echo", ""]),
        "users_per_instance": st.none() | st.floats(),
        "no_scale_in_windows": st.lists(st.fixed_dictionaries(
            {"start": st.sampled_from(["09:00", "23:59", "24:00", "9:00", "x"]),
             "end": st.sampled_from(["17:00", "00:00", "17:60"])},
            optional={"days": st.lists(st.integers(-1, 8), max_size=3)}), max_size=2),
    },
)


def _check_policy(raw: Any, handlers: list[str] | None) -> None:
    try:
        policy = parse_policy(raw, handlers)
    except PolicyError as exc:
        assert str(exc)  # (a field name from the input is quoted verbatim: see test_policy)
        return
    assert policy.min_workers <= policy.max_workers
    occupancy = policy.scale_rules().scaling.occupancy
    assert occupancy.reception_threshold <= occupancy.admission_threshold
    assert handlers is None or not isinstance(policy, TurnsPolicy) or policy.handler in handlers
    assert parse_policy(policy.to_json(), handlers).min_workers == policy.min_workers


@FUZZ
@given(raw=st.text(max_size=100) | st.binary(max_size=100) | json_values.map(json.dumps),
       handlers=st.none() | st.just(["echo", "sleep"]))
def test_parse_policy_text_only_raises_policy_error(raw: str | bytes, handlers: list[str] | None) -> None:
    _check_policy(raw, handlers)


@FUZZ
@given(body=policy_dicts | plausible_policy_dicts, as_json=st.booleans(),
       handlers=st.none() | st.just(["echo", "sleep"]))
def test_parse_policy_objects_only_raise_policy_error(body: dict[str, Any], as_json: bool,
                                                      handlers: list[str] | None) -> None:
    _check_policy(json.dumps(body) if as_json else body, handlers)


@FUZZ
@given(pairs=st.lists(st.text(max_size=30) | st.builds(lambda k, v: f"{k}={v}", policy_fields,
                                                        st.text(max_size=20) | json_values.map(json.dumps)),
                      max_size=4))
def test_parse_assignments_only_raises_policy_error(pairs: list[str]) -> None:
    try:
        got = parse_assignments(pairs)
    except PolicyError as exc:
        assert str(exc)
        return
    expected: dict[str, Any] = {}
    for pair in pairs:  # each value is what its word says: null, its JSON, else its text (last wins)
        key, _, value = pair.partition("=")
        if value.lower() in ("none", "null", ""):
            expected[key] = None
            continue
        try:
            expected[key] = json.loads(value)
        except json.JSONDecodeError:
            expected[key] = value
    assert all(_names_a_field(key) for key in got)
    assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)  # (NaN == NaN here)


def _names_a_field(name: str) -> bool:
    for model in KINDS.values():
        try:
            resolve(model, name)
            return True
        except PolicyError:
            continue
    return False


HOSTILE_JSON = [
    pytest.param("[" * 100_000, id="deep-nesting"),
    pytest.param('{"concurrency": ' + "1" * 5000 + "}", id="huge-int"),
]


@pytest.mark.parametrize("raw", HOSTILE_JSON)
def test_parse_policy_hostile_json_is_a_policy_error(raw: str) -> None:
    with pytest.raises(PolicyError):
        parse_policy(raw)


@pytest.mark.parametrize("value", ["1" * 5000, "[" * 100_000], ids=["huge-int", "deep-nesting"])
def test_parse_assignments_hostile_value_is_a_policy_error(value: str) -> None:
    with pytest.raises(PolicyError, match="^concurrency: unreadable value"):
        parse_assignments([f"concurrency={value}"])
