"""protocol.policy: a policy is validated as a whole before it is ever applied."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol.policy import PolicyError, TurnsPolicy, parse_assignments, parse_policy, resolve, updated
from protocol.policy_controls import TimeWindow
from protocol.policy_legacy import get_path

# (changes to the defaults, error fragment or None when valid)
VALIDATION_TABLE: list[Any] = [
    pytest.param({}, None, id="defaults"),
    pytest.param({"min_workers": 0}, None, id="scale-to-zero"),
    pytest.param({"min_workers": 3, "max_workers": 3}, None, id="min==max"),
    pytest.param({"min_workers": 5, "max_workers": 4}, "min_workers (5) > max_workers (4)", id="min>max"),
    pytest.param({"admission_threshold": 0}, "admission_threshold", id="admission-0"),
    pytest.param({"admission_threshold": 1.01}, "admission_threshold", id="admission>1"),
    pytest.param({"admission_threshold": 1.0}, None, id="admission-1"),
    pytest.param({"reception_threshold": 0}, "reception_threshold", id="reception-0"),
    pytest.param({"reception_threshold": 1.5}, "reception_threshold", id="reception>1"),
    pytest.param({"reception_threshold": 1.0, "admission_threshold": 1.0}, None, id="both-1"),
    pytest.param({"reception_threshold": 0.9, "admission_threshold": 0.8},
                 "reception_threshold (0.9) > admission_threshold (0.8)", id="reception>admission"),
    pytest.param({"reception_threshold": 0.8, "admission_threshold": 0.8}, None, id="reception==admission"),
    pytest.param({"concurrency": 0}, "concurrency", id="concurrency-0"),
    pytest.param({"concurrency": -1}, "concurrency", id="concurrency-negative"),
    pytest.param({"concurrency": 1025}, "concurrency", id="concurrency-over"),
    pytest.param({"max_attempts": 0}, "max_attempts", id="attempts-0"),
    pytest.param({"min_workers": -1}, "min_workers", id="min-negative"),
    pytest.param({"max_workers": 0, "min_workers": 0}, "max_workers", id="max-0"),
    pytest.param({"target_buffer": -1}, "target_buffer", id="buffer-negative"),
    pytest.param({"max_step_up": 0}, "max_step_up", id="step-0"),
    pytest.param({"users_per_instance": 0}, "users_per_instance", id="users-0"),
    pytest.param({"users_per_instance": -5}, "users_per_instance", id="users-negative"),
    pytest.param({"users_per_instance": None}, None, id="users-disabled"),
    pytest.param({"target_backlog_per_worker": 0}, "target_backlog_per_worker", id="backlog-0"),
    pytest.param({"target_rps_per_worker": 2.5}, None, id="rps-enabled"),
    pytest.param({"target_rps_per_worker": -1}, "target_rps_per_worker", id="rps-negative"),
    pytest.param({"active_window_s": 0}, "active_window_s", id="window-0"),
    pytest.param({"compaction_margin": 0.99}, "compaction_margin", id="margin<1"),
    pytest.param({"memory_limit_mb": 0}, "memory_limit_mb", id="memory-0"),
    pytest.param({"memory_limit_mb": 512}, None, id="memory-512"),
    pytest.param({"scale_down_stabilization_s": 0}, None, id="stabilization-0"),
    pytest.param({"scale_down_stabilization_s": -1}, "scale_down_stabilization_s", id="stabilization-neg"),
    pytest.param({"drain_timeout_s": 0}, "drain_timeout_s", id="drain-0"),
    pytest.param({"report_interval_s": -1}, "report_interval_s", id="report-negative"),
    pytest.param({"admission_threshold": float("nan")}, "admission_threshold", id="admission-nan"),
    pytest.param({"unknown_field": 1}, "unknown_field: Extra inputs are not permitted", id="unknown-field"),
    pytest.param({"handler": "sleep"}, None, id="handler-name"),
    pytest.param({"handler": "os.system"}, "is not a handler name", id="handler-dotted"),
    pytest.param({"handler": "a.b:c"}, "is not a handler name", id="handler-entry-point"),
    pytest.param({"handler": "Echo"}, "is not a handler name", id="handler-uppercase"),
    pytest.param({"handler": ""}, "is not a handler name", id="handler-empty"),
    pytest.param({"handler": "__import__"}, "is not a handler name", id="handler-dunder"),
    pytest.param({"handler": 5}, "handler", id="handler-int"),
    pytest.param({"handler_options": {"sleep_ms": 5, "mode": "x", "on": True}}, None, id="options"),
    pytest.param({"handler_options": {"nested": {"a": 1}}}, "handler_options", id="options-nested"),
    pytest.param({"no_scale_in_windows": [{"start": "09:00", "end": "17:00", "days": [0, 4]}]},
                 None, id="window"),
    pytest.param({"no_scale_in_windows": [{"start": "9:00", "end": "17:00"}]}, "HH:MM", id="window-hhmm"),
    pytest.param({"no_scale_in_windows": [{"start": "24:00", "end": "17:00"}]}, "HH:MM", id="window-24h"),
    pytest.param({"no_scale_in_windows": [{"start": "09:00", "end": "17:60"}]}, "HH:MM", id="window-60m"),
    pytest.param({"no_scale_in_windows": [{"start": "09:00", "end": "17:00", "days": [7]}]},
                 "days are 0", id="window-day-7"),
    pytest.param({"no_scale_in_windows": [{"start": "09:00", "end": "17:00", "tz": "CET"}]},
                 "tz", id="window-extra"),
]


@pytest.mark.parametrize(("changes", "error"), VALIDATION_TABLE)
def test_validation_table(changes: dict[str, Any], error: str | None) -> None:
    raw = json.dumps(changes, allow_nan=True)
    if error is None:
        policy = parse_policy(raw)
        for key, value in changes.items():
            dumped = get_path(policy.model_dump(mode="json"), tuple(resolve(policy, key).split(".")))
            assert dumped == value
    else:
        with pytest.raises(PolicyError) as info:
            parse_policy(raw)
        assert error in str(info.value)
        assert "\n" not in str(info.value)
        assert "Value error, " not in str(info.value)


def test_reason_stays_one_line_for_a_hostile_field_name() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy('{"x\\nFAKE LOG LINE": 1}')
    assert "\n" not in str(info.value)


def test_defaults_match_the_design() -> None:
    p = parse_policy("{}")
    assert p == TurnsPolicy()
    occupancy = p.scaling.occupancy
    assert (occupancy.admission_threshold, occupancy.reception_threshold, occupancy.compaction_margin) == \
        (0.8, 0.5, 1.5)
    assert p.min_workers <= p.max_workers


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        pytest.param("not json", "not JSON", id="text"),
        pytest.param("{", "not JSON", id="truncated"),
        pytest.param(b"\xff\xfe\xfa", "not JSON", id="bytes-not-utf8"),
        pytest.param("", "not JSON", id="empty"),
        pytest.param("[]", "a policy is a JSON object, got list", id="array"),
        pytest.param('[{"handler": "echo"}]', "got list", id="array-of-object"),
        pytest.param('"echo"', "got str", id="string"),
        pytest.param("3", "got int", id="number"),
        pytest.param("null", "got NoneType", id="null"),
    ],
)
def test_not_an_object(raw: str | bytes, error: str) -> None:
    with pytest.raises(PolicyError, match=error):
        parse_policy(raw)


def test_accepts_bytes_and_mappings() -> None:
    assert parse_policy(b'{"concurrency": 4}').concurrency == 4
    assert parse_policy({"concurrency": 4}).concurrency == 4


@pytest.mark.parametrize(
    ("handler", "registered", "ok"),
    [
        ("echo", ["echo", "sleep"], True),
        ("sleep", ["echo", "sleep"], True),
        ("llm", ["echo", "sleep"], False),
        ("echo", [], False),
        ("llm", None, True),  # no registry given: only the name's shape is checked
    ],
)
def test_handler_must_be_registered(handler: str, registered: list[str] | None, ok: bool) -> None:
    raw = json.dumps({"handler": handler})
    if ok:
        assert parse_policy(raw, handlers=registered).handler == handler
    else:
        with pytest.raises(PolicyError, match=f"{handler!r} is not registered"):
            parse_policy(raw, handlers=registered)


def test_import_path_is_rejected_even_if_registered_under_that_name() -> None:
    with pytest.raises(PolicyError, match="not a handler name"):
        parse_policy('{"handler": "os.system"}', handlers=["os.system"])


def test_to_json_round_trips() -> None:
    p = parse_policy({"min_workers": 0, "max_workers": 3, "target_rps_per_worker": 1.5,
                      "no_scale_in_windows": [{"start": "22:00", "end": "02:00", "days": [4]}]})
    assert parse_policy(p.to_json()) == p


def test_policy_is_frozen() -> None:
    with pytest.raises(ValueError, match="frozen"):
        TurnsPolicy().concurrency = 3  # type: ignore[misc]


# --- parse_assignments ------------------------------------------------------------------

@pytest.mark.parametrize(
    ("pairs", "expected"),
    [
        (["concurrency=4"], {"concurrency": 4}),
        (["admission_threshold=0.9"], {"admission_threshold": 0.9}),
        (["handler=sleep"], {"handler": "sleep"}),  # not JSON: kept as text
        (['handler="sleep"'], {"handler": "sleep"}),
        (["users_per_instance=none"], {"users_per_instance": None}),
        (["users_per_instance=None"], {"users_per_instance": None}),
        (["users_per_instance=null"], {"users_per_instance": None}),
        (["users_per_instance="], {"users_per_instance": None}),
        (['handler_options={"sleep_ms": 5}'], {"handler_options": {"sleep_ms": 5}}),
        (['no_scale_in_windows=[{"start":"09:00","end":"17:00"}]'],
         {"no_scale_in_windows": [{"start": "09:00", "end": "17:00"}]}),
        (["handler=a=b"], {"handler": "a=b"}),  # only the first '=' splits
        (["min_workers=0", "max_workers=2"], {"min_workers": 0, "max_workers": 2}),
        (["concurrency=1", "concurrency=2"], {"concurrency": 2}),  # the last one wins
        ([], {}),
    ],
)
def test_parse_assignments(pairs: list[str], expected: dict[str, Any]) -> None:
    assert parse_assignments(pairs) == expected


@pytest.mark.parametrize(
    ("pairs", "error"),
    [
        (["concurrency"], "expected key=value"),
        (["=4"], "expected key=value"),
        ([""], "expected key=value"),
        (["nope=1"], "unknown policy field 'nope'"),
        (["Concurrency=1"], "unknown policy field"),
    ],
)
def test_parse_assignments_rejects(pairs: list[str], error: str) -> None:
    with pytest.raises(PolicyError, match=error):
        parse_assignments(pairs)


# --- updated ----------------------------------------------------------------------------

def test_updated_applies_changes_and_keeps_the_rest() -> None:
    base = parse_policy({"max_workers": 10, "target_rps_per_worker": 3.0})
    new = updated(base, parse_assignments(["min_workers=2", "users_per_instance=none"]))
    assert (new.min_workers, new.max_workers, new.scaling.users_per_instance) == (2, 10, None)
    assert new.scaling.target_rps_per_worker == 3.0
    assert base.min_workers == 1  # the original is untouched


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"min_workers": 9}, "min_workers (9) > max_workers (8)"),
        ({"reception_threshold": 0.9}, "reception_threshold (0.9) > admission_threshold (0.8)"),
        ({"handler": "os.system"}, "not a handler name"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_updated_validates_the_whole(changes: dict[str, Any], error: str) -> None:
    with pytest.raises(PolicyError) as info:
        updated(TurnsPolicy(), changes)
    assert error in str(info.value)


def test_updated_checks_the_registry() -> None:
    with pytest.raises(PolicyError, match="not registered"):
        updated(TurnsPolicy(), {"handler": "llm"}, handlers=["echo"])
    assert updated(TurnsPolicy(), {"handler": "llm"}, handlers=["echo", "llm"]).handler == "llm"


def test_updated_with_windows_round_trips() -> None:
    base = parse_policy({"no_scale_in_windows": [{"start": "09:00", "end": "17:00", "days": [1]}]})
    assert updated(base, {}) == base


# --- TimeWindow ------------------------------------------------------------------------

MON, TUE, WED, THU, FRI, SAT, SUN = range(7)


def hm(h: int, m: int = 0) -> int:
    return h * 60 + m


@pytest.mark.parametrize(
    ("start", "end", "days", "weekday", "minute", "inside"),
    [
        # a day window: start inclusive, end exclusive
        ("09:00", "17:00", (), WED, hm(9), True),
        ("09:00", "17:00", (), WED, hm(16, 59), True),
        ("09:00", "17:00", (), WED, hm(17), False),
        ("09:00", "17:00", (), WED, hm(8, 59), False),
        ("09:00", "17:00", (MON, FRI), FRI, hm(12), True),
        ("09:00", "17:00", (MON, FRI), SAT, hm(12), False),
        # wrapping past midnight: the part after midnight belongs to the day it started
        ("22:00", "02:00", (), MON, hm(23), True),
        ("22:00", "02:00", (), TUE, hm(1, 59), True),
        ("22:00", "02:00", (), TUE, hm(2), False),
        ("22:00", "02:00", (), TUE, hm(21, 59), False),
        ("22:00", "02:00", (), TUE, hm(12), False),
        ("22:00", "02:00", (FRI,), FRI, hm(22), True),
        ("22:00", "02:00", (FRI,), SAT, hm(1), True),
        ("22:00", "02:00", (FRI,), FRI, hm(1), False),  # that is Thursday night's window
        ("22:00", "02:00", (FRI,), SAT, hm(23), False),
        ("22:00", "02:00", (SUN,), MON, hm(0, 30), True),  # Sunday night wraps to Monday
        ("22:00", "02:00", (MON,), MON, hm(0, 30), False),
        # edges
        ("00:00", "23:59", (), SUN, hm(0), True),
        ("00:00", "23:59", (), SUN, hm(23, 59), False),
        ("23:00", "00:00", (), SUN, hm(23, 30), True),
        ("23:00", "00:00", (), MON, hm(0), False),
        ("10:00", "10:00", (), MON, hm(10), False),  # empty window
    ],
)
def test_time_window_contains(start: str, end: str, days: tuple[int, ...], weekday: int, minute: int,
                              inside: bool) -> None:
    assert TimeWindow(start=start, end=end, days=days).contains(weekday, minute) is inside


@pytest.mark.parametrize(
    "body",
    [
        {"start": "9:00", "end": "10:00"},
        {"start": "09:00", "end": "10:0"},
        {"start": "25:00", "end": "10:00"},
        {"start": "09:00", "end": "10:00", "days": [-1]},
        {"start": "09:00", "end": "10:00", "days": [7]},
        {"start": "09:00"},
    ],
)
def test_time_window_rejects(body: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TimeWindow.model_validate(body)
