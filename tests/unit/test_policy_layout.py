"""protocol.policy's layout: a kind per tier, each with only its fields in sections; names that
reach a field (dotted paths, unique last names, the flat layout's keys); and the flat policies
stored before the kinds, read through protocol.policy_legacy."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from protocol.policy import (
    PolicyError,
    RqPolicy,
    TurnsPolicy,
    field_paths,
    field_values,
    parse_assignments,
    parse_policy,
    resolve,
    rq_policy,
    turns_policy,
    updated,
)
from protocol.policy_legacy import FLAT_KEYS, RQ, TURNS, flat_view, get_path

# what `fleet:policy:{T}` holds for a tier on the defaults, as the flat model wrote it
FLAT_DEFAULTS: dict[str, Any] = json.loads(
    '{"handler":"echo","handler_options":{},"concurrency":8,"max_attempts":3,"min_workers":1,'
    '"max_workers":8,"target_buffer":0,"max_step_up":null,"users_per_instance":100.0,'
    '"active_window_s":60.0,"target_backlog_per_worker":16.0,"target_rps_per_worker":null,'
    '"target_wait_s":0.5,"admission_threshold":0.8,"reception_threshold":0.5,"compaction_margin":1.5,'
    '"memory_limit_mb":null,"scale_down_stabilization_s":null,'
    '"scale_in_hold":{"min_s":15.0,"max_s":1800.0,"unmeasured_s":300.0},"drain_timeout_s":30.0,'
    '"pending_timeout_s":120.0,"report_interval_s":5.0,"no_scale_in_windows":[],'
    '"scale_up":{"rules":[],"select":"max"},"scale_down":{"rules":[],"select":"max"},"fallback":null,'
    '"schedules":[],"paused":false,"paused_scale_in":false,"disruption_budget":null,'
    '"max_protection_s":3600.0,"max_worker_age_s":null,"max_turns_per_worker":null,"replica_acks":0,'
    '"replica_ack_timeout_ms":100,"ready_shards":1,"kind":"turns","queues":[],"groups":[],"canary":null,'
    '"rollout_guard":null,"retry_max":null,"retry_interval_s":null,"job_timeout_s":null}')

# a value other than the default for every flat key, valid where the key has a place
FLAT_SAMPLES: dict[str, Any] = {
    "kind": "turns", "handler": "sleep", "handler_options": {"sleep_ms": 5}, "concurrency": 4,
    "max_attempts": 5, "min_workers": 2, "max_workers": 12, "ready_shards": 4, "target_buffer": 2,
    "max_step_up": 3, "users_per_instance": 50.0, "active_window_s": 30.0,
    "target_backlog_per_worker": 8.0, "target_rps_per_worker": 2.5, "target_wait_s": 1.0,
    "admission_threshold": 0.9, "reception_threshold": 0.6, "compaction_margin": 2.0,
    "memory_limit_mb": 512.0, "scale_down_stabilization_s": 60.0,
    "scale_in_hold": {"min_s": 5.0, "max_s": 600.0, "unmeasured_s": 60.0}, "report_interval_s": 2.0,
    "scale_up": {"rules": [{"type": "workers", "value": 2, "period_s": 60.0}], "select": "min"},
    "scale_down": {"rules": [], "select": "disabled"},
    "fallback": {"after": 5, "action": "fixed", "workers": 2},
    "schedules": [{"start": "0 9 * * 1-5", "end": "0 18 * * 1-5", "timezone": "UTC", "min_workers": 2,
                   "max_workers": None, "name": "office"}],
    "paused": True, "paused_scale_in": True, "disruption_budget": {"workers": 1, "percent": None},
    "no_scale_in_windows": [{"start": "09:00", "end": "17:00", "days": [0, 1]}], "drain_timeout_s": 60.0,
    "pending_timeout_s": 300.0, "max_protection_s": 600.0, "max_worker_age_s": 86_400.0,
    "max_turns_per_worker": 1000, "replica_acks": 1, "replica_ack_timeout_ms": 250,
    "groups": [{"name": "blue", "handler": None, "handler_options": None, "runtime": None,
                "deployment": None, "weight": 90.0, "min_workers": None, "max_workers": None,
                "scaling": {}},
               {"name": "green", "handler": "sleep", "handler_options": None, "runtime": None,
                "deployment": None, "weight": 10.0, "min_workers": 0, "max_workers": 2, "scaling": {}}],
    "canary": "green",
    "rollout_guard": {"window_s": 60.0, "error_rate_margin": 0.1, "latency_margin": None, "min_turns": 10},
    "queues": ["writeback", "eval"], "retry_max": 3, "retry_interval_s": [1, 5], "job_timeout_s": 45,
}


def test_the_flat_table_has_every_key_of_the_flat_policy() -> None:
    assert set(FLAT_KEYS) == set(FLAT_DEFAULTS) == set(FLAT_SAMPLES) and len(FLAT_KEYS) == 44


@pytest.mark.parametrize(("kind", "index", "model"), [("turns", TURNS, TurnsPolicy), ("rq", RQ, RqPolicy)])
def test_every_flat_key_lands_on_the_same_value_at_its_new_path(kind: str, index: int,
                                                               model: type[BaseModel]) -> None:
    """A stored flat policy (every key present) with each key that has a place in the kind set."""
    mine = {k: v for k, v in FLAT_SAMPLES.items() if FLAT_KEYS[k][index] is not None and k != "kind"}
    policy = parse_policy({**FLAT_DEFAULTS, **mine, "kind": kind})
    assert isinstance(policy, model)
    nested = json.loads(policy.to_json())
    for key, value in mine.items():
        path = FLAT_KEYS[key][index]
        assert path is not None
        assert get_path(nested, tuple(path.split("."))) == value, key
    assert parse_policy(policy.to_json()) == policy  # written back nested, read the same


def test_a_flat_key_with_no_place_in_the_kind_is_dropped_as_the_flat_model_ignored_it() -> None:
    """An rq tier's stored policy carries the turns keys, whatever their values."""
    turns_only = {k: v for k, v in FLAT_SAMPLES.items() if FLAT_KEYS[k][RQ] is None}
    policy = parse_policy({**FLAT_DEFAULTS, **turns_only, "kind": "rq"})
    assert policy == RqPolicy()
    assert parse_policy({**FLAT_DEFAULTS, "queues": ["q"]}) == TurnsPolicy()  # (ignored on turns too)


def test_a_flat_key_beside_the_sections_sets_its_field_over_them() -> None:
    """``{**policy_json, "paused": true}``: the flat key is the later edit."""
    nested = json.loads(turns_policy(target_buffer=2, paused=True).to_json())
    assert parse_policy({**nested, "target_buffer": 1}) == turns_policy(target_buffer=1, paused=True)
    raw = {"target_buffer": 1, "scaling": {"users_per_instance": None}}
    assert parse_policy(raw) == turns_policy(target_buffer=1, users_per_instance=None)
    assert raw == {"target_buffer": 1, "scaling": {"users_per_instance": None}}  # the input is left as it was


def test_each_kind_has_only_its_fields() -> None:
    turns_only = {"handler", "concurrency", "durability", "rollout", "ready_shards"}
    assert not turns_only & set(RqPolicy.model_fields)
    assert not {"queues", "jobs"} & set(TurnsPolicy.model_fields)
    for raw, error in [({"kind": "rq", "durability": {}}, "durability: Extra inputs"),
                       ({"jobs": {"retry_max": 1}}, "jobs: Extra inputs"),
                       ({"kind": "rq", "scaling": {"users_per_instance": 5}}, "scaling.users_per_instance"),
                       ({"kind": "rq", "jobs": {"timeout_s": 60}}, "jobs.timeout_s 60 is over")]:
        with pytest.raises(PolicyError, match=error):
            parse_policy(raw)


def test_every_field_has_a_description() -> None:
    missing = []
    for model in (TurnsPolicy, RqPolicy):
        for path in field_paths(model):
            node: Any = model
            for part in path[:-1]:
                node = _inner(node.model_fields[part].annotation)
            if not node.model_fields[path[-1]].description:
                missing.append(".".join(path))
    assert not missing, missing


def _inner(annotation: Any) -> Any:
    import typing

    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    raise AssertionError(annotation)


# --- names ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("model", "name", "path"), [
    (TurnsPolicy, "controls.paused", "controls.paused"),
    (TurnsPolicy, "paused", "controls.paused"),
    (TurnsPolicy, "admission_threshold", "scaling.occupancy.admission_threshold"),
    (TurnsPolicy, "occupancy.memory_limit_mb", "scaling.occupancy.memory_limit_mb"),
    (TurnsPolicy, "min_s", "scaling.scale_in_hold.min_s"),
    (TurnsPolicy, "scale_down.select", "controls.scale_down.select"),
    (TurnsPolicy, "rollout_guard", "rollout.guard"),  # a flat layout name
    (TurnsPolicy, "guard", "rollout.guard"),
    (TurnsPolicy, "groups", "rollout.groups"),
    (TurnsPolicy, "max_workers", "max_workers"),
    (RqPolicy, "retry_max", "jobs.retry_max"),
    (RqPolicy, "job_timeout_s", "jobs.timeout_s"),
    (RqPolicy, "target_backlog_per_worker", "scaling.target_backlog_per_worker"),
])
def test_a_field_is_reached_by_path_unique_name_or_flat_key(model: type[TurnsPolicy] | type[RqPolicy],
                                                            name: str, path: str) -> None:
    assert resolve(model, name) == path


@pytest.mark.parametrize(("model", "name", "error"), [
    (TurnsPolicy, "select", "'select' is ambiguous: controls.scale_up.select or controls.scale_down.select"),
    (TurnsPolicy, "workers", "ambiguous: controls.fallback.workers or controls.disruption_budget.workers"),
    (TurnsPolicy, "nope", "unknown policy field 'nope' (names: "),
    (TurnsPolicy, "pausd", "unknown policy field 'pausd' (did you mean paused"),
    (TurnsPolicy, "queues", "queues is not a field of a turns tier's policy"),
    (RqPolicy, "concurrency", "concurrency is not a field of an rq tier's policy"),
])
def test_an_unknown_ambiguous_or_foreign_name_is_one_line_listing_candidates(
        model: type[TurnsPolicy] | type[RqPolicy], name: str, error: str) -> None:
    with pytest.raises(PolicyError) as info:
        resolve(model, name)
    assert error in str(info.value) and "\n" not in str(info.value)


def test_every_flat_key_still_names_its_field() -> None:
    """So every documented ``fleet policy set T key=value`` keeps working."""
    for key, (turns, rq) in FLAT_KEYS.items():
        if turns is not None:
            assert resolve(TurnsPolicy, key) == turns
        if rq is not None:
            assert resolve(RqPolicy, key) == rq


def test_set_by_name_keeps_the_rest() -> None:
    base = turns_policy(scale_down={"rules": [{"type": "workers", "value": 1, "period_s": 60}]})
    new = updated(base, parse_assignments(["paused=true", "controls.paused_scale_in=true",
                                           "scale_down.select=disabled", "min_s=5"]))
    assert isinstance(new, TurnsPolicy)
    assert new.controls.paused and new.controls.paused_scale_in
    assert new.controls.scale_down.select == "disabled" and len(new.controls.scale_down.rules) == 1
    assert new.scaling.scale_in_hold.min_s == 5 and new.scaling.scale_in_hold.max_s == 1800
    with pytest.raises(PolicyError, match="ambiguous"):
        updated(base, {"select": "min"})
    assert updated(base, {"after": 4}).controls.fallback is not None  # a null model is made


def test_changing_the_kind_keeps_what_both_kinds_have() -> None:
    turns = turns_policy(handler="sleep", max_workers=5, target_buffer=2, paused=True,
                         admission_threshold=0.9)
    rq = updated(turns, parse_assignments(["kind=rq", "queues=[\"a\"]", "retry_max=2"]))
    assert rq == rq_policy(max_workers=5, target_buffer=2, paused=True, queues=("a",), retry_max=2)
    back = updated(rq, {"kind": "turns"})
    assert back == turns_policy(max_workers=5, target_buffer=2, paused=True)


def test_parse_assignments_takes_a_name_of_either_kind() -> None:
    assert parse_assignments(["queues=[\"a\"]", "paused=1"]) == {"queues": ["a"], "paused": 1}
    with pytest.raises(PolicyError, match="unknown policy field 'bogus'"):
        parse_assignments(["bogus=1"])


def test_field_values_open_the_sections_for_policy_get() -> None:
    values = dict(field_values(turns_policy(after=4)))
    assert values["controls.fallback.after"] == 4 and values["controls.disruption_budget"] is None
    assert values["max_workers"] == 8 and "scaling" not in values


# --- what decide judges, and what a lenient reader sees ------------------------------------------
def test_an_rq_tier_is_judged_one_job_per_worker_without_users() -> None:
    rules = rq_policy(target_buffer=1, max_workers=3).scale_rules()
    assert (rules.concurrency, rules.max_workers, rules.scaling.target_buffer) == (1, 3, 1)
    assert rules.scaling.users_per_instance is None
    assert RqPolicy().rollout.groups == ()


def test_a_lenient_reader_sees_the_flat_names_in_either_layout() -> None:
    nested = json.loads(turns_policy(replica_acks=2, ready_shards=4, groups=[{"name": "a", "weight": 1}])
                        .to_json())
    flat = flat_view(nested)
    assert (flat["replica_acks"], flat["ready_shards"], flat["groups"][0]["name"]) == (2, 4, "a")
    assert flat_view({"replica_acks": 1})["replica_acks"] == 1
    assert flat_view({"durability": "garbage"}) == {"durability": "garbage"}


def test_a_group_sets_its_fields_by_any_name() -> None:
    policy = turns_policy(target_buffer=1, groups=[
        {"name": "blue", "weight": 1},
        {"name": "green", "weight": 1, "scaling": {"target_buffer": 3, "controls.paused": True,
                                                   "replica_acks": 1}}])
    green = policy.for_group("green")
    assert (green.scaling.target_buffer, green.controls.paused, green.durability.replica_acks) == (3, True, 1)
    assert policy.for_group("blue").scaling.target_buffer == 1
    for name in ("rollout_guard", "rollout.canary", "ready_shards", "kind"):
        with pytest.raises(PolicyError, match=f"scaling may not set {name}"):
            turns_policy(groups=[{"name": "a", "weight": 1, "scaling": {name: None}}])
