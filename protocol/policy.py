"""The tier policy: JSON in ``fleet:policy:{<tier>}``, validated before it is used.

A policy is one of two kinds, told apart by ``kind``: a :class:`TurnsPolicy` (the default: Fleet's
workers serving users' turns) or an :class:`RqPolicy` (RQ workers running deferred jobs). Each
holds only its own fields, related ones grouped in sections (``scaling``, ``controls``, ...).
Every field has a description; ``docs/reference.md`` is generated from them (``fleet.reference``).

An invalid policy is never applied: ``parse_policy`` raises ``PolicyError`` with a one-line
reason, and the caller keeps the last good one (``stores.policies``). Policies stored in the
flat layout of before the kinds are read through ``protocol.policy_legacy``.

A field is named by its dotted path (``controls.paused``) or, where it is unique in its kind, by
its last name alone (``paused``); the flat layout's names are accepted too (``rollout_guard``).
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from protocol import policy_legacy
from protocol.deferral import validate_queue
from protocol.groups import Rollout
from protocol.policy_controls import FROZEN, Controls

_HANDLER_RE = re.compile(r"[a-z][a-z0-9_]{0,39}")
MAX_REPLICA_ACKS = 8
MAX_REPLICA_ACK_TIMEOUT_MS = 2_000
MAX_RETRIES = 100  # an rq tier's jobs.retry_max, and its jobs.retry_interval_s entries
MAX_RETRY_INTERVAL_S = 86_400  # a day between two retries of a job


class PolicyError(ValueError):
    """A policy that may not be applied; the message says why in one line."""


# --- fields both kinds have --------------------------------------------------------------
MinWorkers = Annotated[NonNegativeInt, Field(le=10_000, description=(
    "the fewest workers the tier keeps; 0 scales it to zero (work waits, parked, for a worker)"))]
MaxWorkers = Annotated[PositiveInt, Field(le=10_000, description="the most workers the tier may have")]
TargetBuffer = Annotated[NonNegativeInt, Field(le=1_000, description=(
    "warm idle workers kept on top of the busy ones"))]
MaxStepUp = Annotated[PositiveInt | None, Field(le=1_000, description=(
    "the most workers one pass may start; null: as many as the measured load asks (within "
    "`max_workers` and the scale-up rate rules)"))]
TargetBacklog = Annotated[PositiveFloat | None, Field(description=(
    "waiting turns (an rq tier: queued jobs) per worker; null disables this signal"))]
TargetRps = Annotated[PositiveFloat | None, Field(description=(
    "turns (an rq tier: jobs) per second per worker; null disables this signal"))]
TargetWait = Annotated[PositiveFloat, Field(le=60.0, description=(
    "how long waiting work may wait for a slot the running workers free before the tier needs "
    "more workers"))]
StabilizationS = Annotated[float | None, Field(ge=0.0, le=86_400, description=(
    "a fixed scale-in hold in seconds; null: derived from what a worker costs to start "
    "(see `scale_in_hold`)"))]


class ScaleInHold(BaseModel):
    """Bounds of the scale-in hold derived from the measured start cost (``commander.holdtime``)."""

    model_config = FROZEN
    min_s: float = Field(15.0, ge=0.0, le=86_400, description="the shortest derived hold")
    max_s: float = Field(1_800.0, ge=0.0, le=86_400, description="the longest derived hold")
    unmeasured_s: float = Field(300.0, ge=0.0, le=86_400, description="the hold before any start has "
                                "been measured")

    @model_validator(mode="after")
    def _ordered(self) -> ScaleInHold:
        if self.min_s > self.max_s:
            raise ValueError(f"scale-in hold min_s ({self.min_s:g}) > max_s ({self.max_s:g})")
        return self


HoldBounds = Annotated[ScaleInHold, Field(description=(
    "the bounds of the derived scale-in hold, and the hold before any start was measured"))]


# --- a turns tier ---------------------------------------------------------------------------
class OccupancyRules(BaseModel):
    """How a worker's occupancy (the max of its cpu, memory and slot use) is judged."""

    model_config = FROZEN
    admission_threshold: float = Field(0.8, gt=0.0, le=1.0, description="the occupancy under which a "
                                       "worker takes new work")
    reception_threshold: float = Field(0.5, gt=0.0, le=1.0, description="the same for the tier's first "
                                       "(reception) worker while others exist")
    compaction_margin: float = Field(1.5, ge=1.0, le=100.0, description="headroom, in admission "
                                     "thresholds, before workers are consolidated")
    memory_limit_mb: PositiveFloat | None = Field(None, description="a worker's memory limit, read into "
                                                  "its occupancy; null: memory is not a component")

    @model_validator(mode="after")
    def _ordered(self) -> OccupancyRules:
        if self.reception_threshold > self.admission_threshold:
            raise ValueError(f"reception_threshold ({self.reception_threshold}) > admission_threshold "
                             f"({self.admission_threshold})")
        return self


class Scaling(BaseModel):
    """The signals that size a turns tier, and the timing of scale-in."""

    model_config = FROZEN
    target_buffer: TargetBuffer = 0
    max_step_up: MaxStepUp = None
    users_per_instance: PositiveFloat | None = Field(100.0, description="active users one worker "
                                                     "should serve; null disables this signal")
    active_window_s: PositiveFloat = Field(60.0, le=86_400, description="how recent a turn makes its "
                                           "user active")
    target_backlog_per_worker: TargetBacklog = 16.0
    target_rps_per_worker: TargetRps = None
    target_wait_s: TargetWait = 0.5
    occupancy: OccupancyRules = Field(OccupancyRules(), description="how a worker's occupancy is judged")
    scale_down_stabilization_s: StabilizationS = None
    scale_in_hold: HoldBounds = ScaleInHold()
    report_interval_s: PositiveFloat = Field(5.0, le=300, description="how often a worker reports its "
                                             "occupancy")


class Durability(BaseModel):
    """What the tier's writes keep, and for how long. The WAIT after a turn's writes, against
    asynchronous replication: after the submit, the lane acquire and the turn commit, wait until
    ``replica_acks`` replicas have the write, or ``replica_ack_timeout_ms``. How long an idle
    user's data is kept (``retention_days``), and how much the dead letters may hold."""

    model_config = FROZEN
    retention_days: float = Field(0.0, ge=0, le=36_500, description="expire a user's keys this many "
                                  "days after the user's last turn (each commit and submit sets the "
                                  "expiry again); 0: kept until erased (`fleet user delete`)")
    dead_letter_max_bytes: int = Field(64 * 1024 * 1024, ge=1024, le=1 << 40, description="the "
                                       "oldest dead letters are trimmed while the tier's hold more "
                                       "bytes than this (and more than 100,000 entries)")
    replica_acks: int = Field(0, description=f"replicas that must have each write: 0 (no WAIT is sent) "
                              f".. {MAX_REPLICA_ACKS}")
    replica_ack_timeout_ms: int = Field(100, description=f"the longest a WAIT holds the user's lane: 1 "
                                        f".. {MAX_REPLICA_ACK_TIMEOUT_MS} ms")

    @property
    def retention_ms(self) -> int:
        """``retention_days`` in milliseconds (0: kept until erased)."""
        return round(self.retention_days * 86_400_000)

    @field_validator("replica_acks")
    @classmethod
    def _replica_acks(cls, v: int) -> int:
        if not 0 <= v <= MAX_REPLICA_ACKS:
            raise ValueError(f"{v} is not a replica count: 0 (no WAIT) .. {MAX_REPLICA_ACKS}")
        return v

    @field_validator("replica_ack_timeout_ms")
    @classmethod
    def _replica_ack_timeout(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"{v} ms: at least 1 (Redis' WAIT with timeout 0 blocks for ever, "
                             "holding the user's lane)")
        if v > MAX_REPLICA_ACK_TIMEOUT_MS:
            raise ValueError(f"{v} ms: at most {MAX_REPLICA_ACK_TIMEOUT_MS} (a WAIT holds the user's "
                             "lane, whose lease is a few seconds; two WAITs per turn)")
        return v


# what a group may not set in its ``scaling``: what runs and its bounds (the group's own fields),
# and what belongs to the tier as a whole
_NOT_PER_GROUP = frozenset({"kind", "handler", "handler_options", "min_workers", "max_workers",
                            "ready_shards", "rollout"})


class TurnsPolicy(BaseModel):
    """A turns tier: Fleet's workers serving users' turns."""

    model_config = FROZEN
    kind: Literal["turns"] = Field("turns", description="`turns` (the default) or `rq`")
    handler: str = Field("echo", description="the registered handler the tier's workers run (a name, "
                         "never an import path)")
    handler_options: dict[str, float | int | str | bool] = Field(
        default_factory=dict, description="options for the handler; a turn's `meta` overrides them")
    concurrency: PositiveInt = Field(8, le=1024, description="users served at once by one worker")
    max_attempts: PositiveInt = Field(3, le=100, description="handler attempts (crashes included) "
                                      "before a turn is dead-lettered")
    max_deliveries: PositiveInt = Field(5, le=100, description="deliveries of a notification (the first "
                                        "and each reclaim) before one whose serving fails again is "
                                        "dead-lettered with its error and acked")
    min_workers: MinWorkers = 1
    max_workers: MaxWorkers = 8
    ready_shards: PositiveInt = Field(1, le=64, description="the tier's ready stream spread over this "
                                      "many streams, by user (for Redis Cluster)")
    scaling: Scaling = Field(Scaling(), description="the signals that size the tier, and scale-in timing")
    controls: Controls = Field(Controls(), description="rate limits, fallback, schedules, pauses, "
                               "budgets, draining and recycling")
    durability: Durability = Field(Durability(), description="the WAIT for replicas after each write")
    rollout: Rollout = Field(Rollout(), description="groups (blue/green, canary) and the rollout "
                             "between them")

    @field_validator("handler")
    @classmethod
    def _handler_name(cls, v: str) -> str:
        if not _HANDLER_RE.fullmatch(v):
            raise ValueError(
                f"{v!r} is not a handler name (registered names are lowercase words, "
                "never import paths)"
            )
        return v

    @model_validator(mode="after")
    def _bounds(self) -> TurnsPolicy:
        check_bounds(self.min_workers, self.max_workers, self.controls)
        for group in self.rollout.groups:  # each group's pool must run on a valid policy of its own
            bad = sorted(name for name in group.scaling
                         if _path_of(TurnsPolicy, name, group.name)[0] in _NOT_PER_GROUP)
            if bad:
                raise ValueError(f"group {group.name}: scaling may not set {', '.join(bad)} "
                                 "(set them on the group itself)")
            self.for_group(group.name)
        return self

    def for_group(self, name: str) -> TurnsPolicy:
        """The policy the pool of group ``name`` runs on: the tier's, with the group's fields
        applied (raises ValueError naming the group if that is invalid, KeyError if no such group)."""
        group = next((g for g in self.rollout.groups if g.name == name), None)
        if group is None:
            raise KeyError(name)
        fields = self.model_dump(exclude={"rollout"})
        for own in ("handler", "handler_options", "min_workers", "max_workers"):
            if getattr(group, own) is not None:
                fields[own] = getattr(group, own)
        for key, value in group.scaling.items():
            policy_legacy.set_path(fields, _path_of(TurnsPolicy, key, name), value)
        try:
            return TurnsPolicy.model_validate(fields)
        except ValidationError as exc:
            raise ValueError(f"group {name}: {_one_line(exc)}") from None

    def group_handler(self, name: str | None) -> str:
        """The handler the pool of group ``name`` runs (the tier's for None or an unknown group)."""
        group = next((g for g in self.rollout.groups if g.name == name), None)
        return group.handler if group is not None and group.handler is not None else self.handler

    def with_weights(self, weights: Iterable[tuple[str, float]], canary: str | None = None) -> TurnsPolicy:
        """This policy with its groups' weights replaced by ``weights`` (and the canary, when
        given), validated as a whole (raises PolicyError)."""
        new = dict(weights)
        doc = self.model_dump(mode="json")
        doc["rollout"]["groups"] = [{**g, "weight": new.get(g["name"], g["weight"])}
                                    for g in doc["rollout"]["groups"]]
        if canary is not None:
            doc["rollout"]["canary"] = canary
        return as_turns(parse_policy(doc))  # (of the dump's kind: turns)

    def scale_rules(self) -> ScaleRules:
        """What ``decide`` judges the tier by."""
        return ScaleRules(self.min_workers, self.max_workers, self.concurrency, self.scaling, self.controls)

    def to_json(self) -> str:
        """Canonical JSON, as stored in the policy key."""
        return self.model_dump_json()


# --- an rq tier -----------------------------------------------------------------------------
class RqScaling(BaseModel):
    """The signals that size an rq tier (one job per worker), and the timing of scale-in."""

    model_config = FROZEN
    target_buffer: TargetBuffer = 0
    max_step_up: MaxStepUp = None
    target_backlog_per_worker: TargetBacklog = 16.0
    target_rps_per_worker: TargetRps = None
    target_wait_s: TargetWait = 0.5
    scale_down_stabilization_s: StabilizationS = None
    scale_in_hold: HoldBounds = ScaleInHold()


class Jobs(BaseModel):
    """What an rq tier sets for the jobs of its queues, over each job's registration
    (``@job(retry_max=..., retry_interval_s=...)``)."""

    model_config = FROZEN
    retry_max: int | None = Field(None, ge=0, le=MAX_RETRIES, description="how many times a failed job "
                                  "is retried (RQ's `Retry`); null: the job's registration's")
    retry_interval_s: tuple[int, ...] | None = Field(None, max_length=MAX_RETRIES, description="with "
                                                     "`retry_max`: seconds before each retry (the last "
                                                     "one repeats)")
    timeout_s: int | None = Field(None, ge=1, le=3_600, description="seconds a job may run before it is "
                                  "stopped and fails (at most `controls.drain_timeout_s`, so a retired "
                                  "worker finishes its job within its drain); null: RQ's default, 180 s")

    @field_validator("retry_interval_s")
    @classmethod
    def _retry_intervals(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        for interval in v or ():
            if not 0 <= interval <= MAX_RETRY_INTERVAL_S:
                raise ValueError(f"{interval} s is not a retry interval: 0 .. {MAX_RETRY_INTERVAL_S}")
        return v

    @model_validator(mode="after")
    def _intervals_need_retries(self) -> Jobs:
        if self.retry_interval_s is not None and self.retry_max is None:
            raise ValueError("retry_interval_s needs retry_max (the number of retries)")
        return self


class RqPolicy(BaseModel):
    """An rq tier: RQ workers (``worker.rq.rq_worker``) running deferred jobs from RQ queues, one at a
    time, scaled on the queues' length."""

    model_config = FROZEN
    kind: Literal["rq"] = Field("rq", description="`rq`")
    queues: tuple[str, ...] = Field((), max_length=16, description="the RQ queues its workers consume, in "
                                    "priority order; empty: the queue named like the tier")
    min_workers: MinWorkers = 1
    max_workers: MaxWorkers = 8
    scaling: RqScaling = Field(RqScaling(), description="the signals that size the tier, and scale-in "
                               "timing")
    controls: Controls = Field(Controls(), description="rate limits, fallback, schedules, pauses, "
                               "budgets, draining and recycling")
    jobs: Jobs = Field(Jobs(), description="retries and timeout of the jobs of its queues")

    @field_validator("queues")
    @classmethod
    def _queue_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            validate_queue(name)
        if len(set(v)) != len(v):
            raise ValueError("a queue is named twice")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> RqPolicy:
        check_bounds(self.min_workers, self.max_workers, self.controls)
        timeout, drain = self.jobs.timeout_s, self.controls.drain_timeout_s
        if timeout is not None and timeout > drain:
            raise ValueError(f"jobs.timeout_s {timeout} is over controls.drain_timeout_s {drain:g}: a "
                             "retired RQ worker must be able to finish its job")
        return self

    def rq_queues(self, tier: str) -> tuple[str, ...]:
        """The RQ queues the tier's workers consume, in priority order."""
        return self.queues or (tier,)

    @property
    def rollout(self) -> Rollout:
        """No groups: an rq tier is one pool (so code that walks a tier's pools reads both kinds)."""
        return _NO_ROLLOUT

    def scale_rules(self) -> ScaleRules:
        """What ``decide`` judges the tier by: one job per worker, and no turns-only signal."""
        scaling = Scaling.model_validate({**{name: getattr(self.scaling, name) for name in
                                             RqScaling.model_fields}, "users_per_instance": None})
        return ScaleRules(self.min_workers, self.max_workers, 1, scaling, self.controls, queue_driven=True)

    def to_json(self) -> str:
        """Canonical JSON, as stored in the policy key."""
        return self.model_dump_json()


_NO_ROLLOUT = Rollout()
Policy = Annotated[TurnsPolicy | RqPolicy, Field(discriminator="kind")]
KINDS: dict[str, type[TurnsPolicy] | type[RqPolicy]] = {"turns": TurnsPolicy, "rq": RqPolicy}


@dataclass(frozen=True)
class ScaleRules:
    """What ``decide`` judges a tier (or a group's pool) by, whatever its kind."""

    min_workers: int
    max_workers: int
    concurrency: int  # slots per worker: an rq worker runs one job at a time
    scaling: Scaling
    controls: Controls
    # the queue is the only trouble signal (an rq tier): a worker busy with its one job asks
    # for no other while nothing waits
    queue_driven: bool = False


def as_turns(policy: TurnsPolicy | RqPolicy) -> TurnsPolicy:
    """The policy a Fleet worker runs: a turns tier's as it is; on an rq tier (whose workers are
    RQ's: a Fleet worker there is left from before the kind changed, or started by hand), the
    default turns policy within the tier's bounds and controls."""
    if isinstance(policy, TurnsPolicy):
        return policy
    return TurnsPolicy(min_workers=policy.min_workers, max_workers=policy.max_workers,
                       controls=policy.controls)


def check_bounds(min_workers: int, max_workers: int, controls: Controls) -> None:
    """The bounds agree with each other and with the controls that name a count."""
    if min_workers > max_workers:
        raise ValueError(f"min_workers ({min_workers}) > max_workers ({max_workers})")
    for sched in controls.schedules:
        if sched.min_workers is not None and sched.min_workers > max_workers:
            raise ValueError(f"schedule {sched.label()!r}: min_workers ({sched.min_workers}) > "
                             f"max_workers ({max_workers})")
    fallback = controls.fallback
    if fallback is not None and fallback.workers is not None and fallback.workers > max_workers:
        raise ValueError(f"fallback workers ({fallback.workers}) > max_workers ({max_workers})")


# --- names and paths ------------------------------------------------------------------------
def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds directly (also when it may be null); None for anything else (a
    list of models too)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for arg in typing.get_args(annotation) if union else (annotation,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def field_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every field a name can reach in ``model``, depth first: the sections and what is in them,
    and the fields of a model-valued field (``controls.fallback.after``); not into lists."""
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        yield path
        inner = _model_of(info.annotation)
        if inner is not None:
            yield from field_paths(inner, path)


@functools.cache
def _all_paths(model: type[BaseModel]) -> tuple[tuple[str, ...], ...]:
    return tuple(field_paths(model))


def _candidates(model: type[BaseModel], head: str) -> list[tuple[str, ...]]:
    return [p for p in _all_paths(model) if p[-1] == head]


def _path_of(model: type[TurnsPolicy] | type[RqPolicy], name: str, where: str = "") -> tuple[str, ...]:
    """The path ``name`` names in ``model``: a dotted path from the top, a unique last name
    (``paused``), or a flat layout key, each optionally followed by ``.field``s. An unknown name is
    left at the top (validation refuses it there). Raises PolicyError for an ambiguous name or a
    flat key with no place in this kind."""
    head, *tail = name.split(".")
    if head in model.model_fields:
        return (head, *tail)
    found = _candidates(model, head)
    if len(found) > 1:
        raise PolicyError(f"{'group ' + where + ': ' if where else ''}{head!r} is ambiguous: "
                          f"{' or '.join('.'.join(p) for p in found)}")
    if found:
        return (*found[0], *tail)
    if head in policy_legacy.FLAT_KEYS:
        rq = model is RqPolicy
        flat = policy_legacy.flat_path(head, policy_legacy.RQ if rq else policy_legacy.TURNS)
        if flat is None:
            raise PolicyError(f"{head} is not a field of {'an rq' if rq else 'a turns'} tier's policy")
        return (*flat.split("."), *tail)
    return (head, *tail)


def short_names(model: type[BaseModel]) -> list[str]:
    """The names a field of ``model`` is known by alone: its top-level fields, and each last name
    that is unique in it (``paused`` for ``controls.paused``)."""
    last = [p[-1] for p in _all_paths(model)]
    return sorted({n for n in last if last.count(n) == 1} | set(model.model_fields))


def resolve(policy: TurnsPolicy | RqPolicy | type[TurnsPolicy] | type[RqPolicy], name: str) -> str:
    """The dotted path ``name`` names in a policy of that kind; PolicyError for an unknown,
    ambiguous or inapplicable name, listing the candidates."""
    model = policy if isinstance(policy, type) else type(policy)
    path = _path_of(model, name)
    known = {".".join(p) for p in _all_paths(model)}
    if ".".join(path) not in known and path[0] not in model.model_fields:
        close = difflib.get_close_matches(name, sorted(set(short_names(model)) | known), n=5)
        hint = f"did you mean {', '.join(close)}?" if close else f"names: {', '.join(short_names(model))}"
        raise PolicyError(f"unknown policy field {name!r} ({hint})")
    return ".".join(path)


def field_values(policy: TurnsPolicy | RqPolicy) -> list[tuple[str, Any]]:
    """Every field of ``policy`` as (dotted path, JSON value), the sections and model values
    opened (``controls.fallback.after``; a null one shows as itself), in the model's order."""
    def walk(doc: Mapping[str, Any], model: type[BaseModel], prefix: str) -> Iterator[tuple[str, Any]]:
        for name, info in model.model_fields.items():
            inner, value = _model_of(info.annotation), doc[name]
            if inner is not None and isinstance(value, dict):
                yield from walk(value, inner, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", value
    return list(walk(policy.model_dump(mode="json"), type(policy), ""))


# --- reading and changing -------------------------------------------------------------------
def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "policy"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return " ".join("; ".join(parts).split())  # field names come from input: keep one line


def _kind_of(raw: Mapping[str, Any]) -> type[TurnsPolicy] | type[RqPolicy]:
    kind = raw.get("kind", "turns")
    model = KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise PolicyError(f"kind: {str(kind)[:40]!r} is not a tier kind ({', '.join(KINDS)})")
    return model


@dataclass(frozen=True)
class KnownHandlers:
    """The handler names a reader can load (iterated like any ``handlers``), and why each
    handler it cannot is unavailable (its entry point failed to import) or not installed (an
    optional handler whose extra is missing): a policy naming one is refused with that error."""

    names: Iterable[str]
    unavailable: Mapping[str, str]
    not_installed: Mapping[str, str] = field(default_factory=dict)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)


def parse_policy(raw: str | bytes | Mapping[str, Any], handlers: Iterable[str] | None = None,
                 group: str | None = None) -> TurnsPolicy | RqPolicy:
    """Validate a policy from JSON (or a mapping), in either layout; check the handler against
    ``handlers``: the handler of ``group`` (a reader of that group's pool runs only that one),
    else the tier's."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, huge ints, nesting
            raise PolicyError(f"not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(raw, Mapping):
        raise PolicyError(f"a policy is a JSON object, got {type(raw).__name__}")
    model = _kind_of(raw)
    kind = policy_legacy.RQ if model is RqPolicy else policy_legacy.TURNS
    flat = any(k not in model.model_fields and k in policy_legacy.FLAT_KEYS for k in raw)
    try:
        policy: TurnsPolicy | RqPolicy = model.model_validate(
            policy_legacy.from_flat(raw, kind, model.model_fields) if flat else raw)
    except ValidationError as exc:
        raise PolicyError(_one_line(exc)) from None
    except ValueError as exc:
        raise PolicyError(" ".join(str(exc).split())) from None
    if handlers is not None and isinstance(policy, TurnsPolicy):
        known = sorted(set(handlers))
        name = policy.group_handler(group)
        if name not in known:
            where = f"group {group}: handler" if group and policy.rollout.groups else "handler"
            why = (handlers.unavailable.get(name) or handlers.not_installed.get(name)
                   if isinstance(handlers, KnownHandlers) else None)
            if why is not None:
                raise PolicyError(f"{where}: {name!r} cannot be loaded here: {why}")
            raise PolicyError(f"{where}: {name!r} is not registered (known: {', '.join(known)})")
    return policy


def turns_policy(base: TurnsPolicy | None = None, /, **fields: Any) -> TurnsPolicy:
    """``base`` (the defaults when None) with ``fields`` set by name (any name ``resolve`` takes:
    ``paused=True``, ``scaling.target_buffer=2``), validated as a whole."""
    policy = updated(base or TurnsPolicy(), fields)
    if not isinstance(policy, TurnsPolicy):
        raise PolicyError(f"kind: {policy.kind!r}, not a turns policy")
    return policy


def rq_policy(base: RqPolicy | None = None, /, **fields: Any) -> RqPolicy:
    """``base`` (the defaults when None) with ``fields`` set by name (``retry_max=3``), validated."""
    policy = updated(base or RqPolicy(), fields)
    if not isinstance(policy, RqPolicy):
        raise PolicyError(f"kind: {policy.kind!r}, not an rq policy")
    return policy


def parse_assignments(pairs: Iterable[str]) -> dict[str, Any]:
    """Turn CLI ``name=value`` words into a dict; values are JSON when they parse, else text. A name
    must name a field of some kind (``updated`` resolves it against the policy's)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise PolicyError(f"expected key=value, got {pair!r}")
        _known_somewhere(key)
        if value.lower() in ("none", "null", ""):
            out[key] = None
            continue
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
        except (ValueError, RecursionError) as exc:  # huge ints, deep nesting
            raise PolicyError(f"{key}: unreadable value ({type(exc).__name__})") from None
    return out


def _known_somewhere(name: str) -> None:
    """Raise PolicyError unless ``name`` names a field of a turns or an rq policy."""
    error: PolicyError | None = None
    for model in KINDS.values():
        try:
            resolve(model, name)
            return
        except PolicyError as exc:
            error = error or exc
    assert error is not None
    raise error


def _carried(policy: TurnsPolicy | RqPolicy, model: type[BaseModel]) -> dict[str, Any]:
    """The fields of ``policy`` that ``model`` has too (a tier that changes its kind keeps them)."""
    def keep(doc: dict[str, Any], into: type[BaseModel]) -> dict[str, Any]:
        out = {}
        for name, value in doc.items():
            if name not in into.model_fields:
                continue
            inner = _model_of(into.model_fields[name].annotation)
            out[name] = keep(value, inner) if inner is not None and isinstance(value, dict) else value
        return out
    carried = keep(policy.model_dump(mode="json"), model)
    carried.pop("kind", None)
    return carried


def updated(policy: TurnsPolicy | RqPolicy, changes: Mapping[str, Any],
            handlers: Iterable[str] | None = None) -> TurnsPolicy | RqPolicy:
    """Return ``policy`` with ``changes`` (name -> value; any name ``resolve`` takes) applied,
    validated as a whole. Changing ``kind`` keeps the fields both kinds have."""
    model = _kind_of({"kind": changes.get("kind", policy.kind)})
    doc = policy.model_dump(mode="json") if model is type(policy) else _carried(policy, model)
    for name, value in changes.items():
        policy_legacy.set_path(doc, tuple(resolve(model, name).split(".")), value)
    return parse_policy(doc, handlers)
