"""The tier policy (DESIGN §5): JSON in ``fleet:policy:<tier>``, validated before it is used.

An invalid policy is never applied: ``parse_policy`` raises ``PolicyError`` with a one-line
reason, and the caller keeps the last good one (``stores.policies``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from protocol.deferral import validate_queue
from protocol.groups import Group, RolloutGuard, check_groups, group_overrides
from protocol.policy_controls import DisruptionBudget, Fallback, ScaleBehavior, ScaleInHold, ScheduledBounds

_HANDLER_RE = re.compile(r"[a-z][a-z0-9_]{0,39}")
_HHMM_RE = re.compile(r"([01]\d|2[0-3]):[0-5]\d")
MAX_REPLICA_ACKS = 8
MAX_REPLICA_ACK_TIMEOUT_MS = 2_000
MAX_RETRIES = 100  # an rq tier's retry_max, and its retry_interval_s entries
MAX_RETRY_INTERVAL_S = 86_400  # a day between two retries of a job
Fraction = float  # (0, 1], enforced by Field(gt=0, le=1)


class PolicyError(ValueError):
    """A policy that may not be applied; the message says why in one line."""


class TimeWindow(BaseModel):
    """A daily UTC window, e.g. a change freeze: ``{"start": "09:00", "end": "17:00"}``.

    ``days`` are 0=Monday..6=Sunday (all days when empty). ``end`` before ``start`` wraps
    past midnight.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    start: str
    end: str
    days: tuple[int, ...] = ()

    @field_validator("start", "end")
    @classmethod
    def _hhmm(cls, v: str) -> str:
        if not _HHMM_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not HH:MM (24h, UTC)")
        return v

    @field_validator("days")
    @classmethod
    def _days(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < 0 or d > 6 for d in v):
            raise ValueError("days are 0 (Monday) .. 6 (Sunday)")
        return v

    def contains(self, weekday: int, minute_of_day: int) -> bool:
        """Whether a UTC (weekday, minute) falls inside the window."""
        start = int(self.start[:2]) * 60 + int(self.start[3:])
        end = int(self.end[:2]) * 60 + int(self.end[3:])
        if start <= end:
            inside, day = start <= minute_of_day < end, weekday
        elif minute_of_day >= start:
            inside, day = True, weekday
        else:  # after midnight of a wrapping window: it belongs to the previous day
            inside, day = minute_of_day < end, (weekday - 1) % 7
        return inside and (not self.days or day in self.days)


class Policy(BaseModel):
    """How one tier runs and scales. ``None`` disables an optional signal."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # what runs
    handler: str = "echo"
    handler_options: dict[str, float | int | str | bool] = Field(default_factory=dict)
    concurrency: PositiveInt = Field(8, le=1024)
    max_attempts: PositiveInt = Field(3, le=100)
    # how many
    min_workers: NonNegativeInt = Field(1, le=10_000)
    max_workers: PositiveInt = Field(8, le=10_000)
    target_buffer: NonNegativeInt = Field(0, le=1_000)
    # the most workers one pass may start; None: the step is sized by the measured load alone
    # (commander.scaleup), within max_workers and the scale_up rate rules
    max_step_up: PositiveInt | None = Field(None, le=1_000)
    # signals (None = disabled)
    users_per_instance: PositiveFloat | None = 100.0
    active_window_s: PositiveFloat = Field(60.0, le=86_400)
    target_backlog_per_worker: PositiveFloat | None = 16.0
    target_rps_per_worker: PositiveFloat | None = None
    # how long a waiting turn may wait for a slot the running workers will free before the tier
    # needs more workers (the backlog those slots start within this time asks for none)
    target_wait_s: PositiveFloat = Field(0.5, le=60.0)
    # occupancy
    admission_threshold: float = Field(0.8, gt=0.0, le=1.0)
    reception_threshold: float = Field(0.5, gt=0.0, le=1.0)
    compaction_margin: float = Field(1.5, ge=1.0, le=100.0)
    memory_limit_mb: PositiveFloat | None = None
    # timing: the scale-in hold is derived from the measured start cost (commander.holdtime)
    # unless set here in seconds
    scale_down_stabilization_s: float | None = Field(None, ge=0.0, le=86_400)
    scale_in_hold: ScaleInHold = ScaleInHold()
    drain_timeout_s: PositiveFloat = Field(30.0, le=3_600)
    # a worker that has waited this long for a place to run (kubernetes: a Pending pod) is
    # recorded once as "no-capacity" in the ledger; it still counts as starting (no retry)
    pending_timeout_s: PositiveFloat = Field(120.0, le=86_400)
    report_interval_s: PositiveFloat = Field(5.0, le=300)
    no_scale_in_windows: tuple[TimeWindow, ...] = ()
    # what users of HPA, KEDA, Knative and Karpenter rely on (protocol.policy_controls)
    scale_up: ScaleBehavior = ScaleBehavior()
    scale_down: ScaleBehavior = ScaleBehavior()
    fallback: Fallback | None = None
    schedules: tuple[ScheduledBounds, ...] = Field((), max_length=32)
    paused: bool = False
    paused_scale_in: bool = False
    disruption_budget: DisruptionBudget | None = None
    max_protection_s: float = Field(3_600.0, ge=0.0, le=86_400)  # the longest a handler may protect
    max_worker_age_s: PositiveFloat | None = Field(None, le=30 * 86_400)
    max_turns_per_worker: PositiveInt | None = Field(None, le=10**9)
    # durability against asynchronous replication (docs/ARCHITECTURE.md, "Failover: what Fleet
    # promises"): after the submit (the client), the lane acquire and the turn commit, WAIT
    # until this many replicas have the write, or replica_ack_timeout_ms. 0: no WAIT is sent.
    replica_acks: int = 0
    replica_ack_timeout_ms: int = 100
    # the tier's ready stream spread over this many streams (keys.ready(tier, k)), by user
    ready_shards: PositiveInt = Field(1, le=64)
    # what the tier's workers are (issue 16): "turns", Fleet's workers serving users' turns; or
    # "rq", RQ workers (``worker.rq.rq_worker``) running deferred jobs from the RQ ``queues`` (empty:
    # the queue named like the tier), scaled on queue length. An rq worker runs one job at a
    # time: ``concurrency`` and the handler do not apply to it
    kind: Literal["turns", "rq"] = "turns"
    queues: tuple[str, ...] = Field((), max_length=16)
    # blue/green and canary (protocol.groups): each group a pool of its own; () = one pool, the tier
    groups: tuple[Group, ...] = Field((), max_length=8)
    canary: str | None = None  # the group under rollout (``fleet rollout``), judged by rollout_guard
    rollout_guard: RolloutGuard | None = None  # None: no automatic abort
    # an rq tier's retries of a failed job (RQ's ``Retry``), for the jobs of its queues: they
    # override the job's registration (``@job(retry_max=…, retry_interval_s=…)``); None: the
    # registration's. The intervals are seconds before each retry (the last one repeats)
    retry_max: int | None = Field(None, ge=0, le=MAX_RETRIES)
    retry_interval_s: tuple[int, ...] | None = Field(None, max_length=MAX_RETRIES)
    # an rq tier's job timeout (RQ's ``job_timeout``: a job running longer is stopped and fails,
    # then is retried if it has retries left); None: RQ's default, 180 s. At most drain_timeout_s:
    # a retired RQ worker finishes its job within its drain
    job_timeout_s: int | None = Field(None, ge=1, le=3_600)

    @field_validator("handler")
    @classmethod
    def _handler_name(cls, v: str) -> str:
        if not _HANDLER_RE.fullmatch(v):
            raise ValueError(
                f"{v!r} is not a handler name (registered names are lowercase words, "
                "never import paths)"
            )
        return v

    @field_validator("queues")
    @classmethod
    def _queue_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            validate_queue(name)
        if len(set(v)) != len(v):
            raise ValueError("a queue is named twice")
        return v

    @field_validator("retry_interval_s")
    @classmethod
    def _retry_intervals(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        for interval in v or ():
            if not 0 <= interval <= MAX_RETRY_INTERVAL_S:
                raise ValueError(f"{interval} s is not a retry interval: 0 .. {MAX_RETRY_INTERVAL_S}")
        return v

    @model_validator(mode="after")
    def _rq_retries(self) -> Policy:
        if self.kind != "rq" and (self.retry_max is not None or self.retry_interval_s is not None):
            raise ValueError("retry_max and retry_interval_s apply only to an rq tier (kind=rq)")
        if self.retry_interval_s is not None and self.retry_max is None:
            raise ValueError("retry_interval_s needs retry_max (the number of retries)")
        if self.job_timeout_s is not None:
            if self.kind != "rq":
                raise ValueError("job_timeout_s applies only to an rq tier (kind=rq)")
            if self.job_timeout_s > self.drain_timeout_s:
                raise ValueError(f"job_timeout_s {self.job_timeout_s} is over drain_timeout_s "
                                 f"{self.drain_timeout_s:g}: a retired RQ worker must be able to "
                                 "finish its job")
        return self

    def rq_queues(self, tier: str) -> tuple[str, ...]:
        """The RQ queues an rq tier's workers consume, in priority order."""
        return self.queues or (tier,)

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

    @model_validator(mode="after")
    def _bounds(self) -> Policy:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) > max_workers ({self.max_workers})")
        if self.reception_threshold > self.admission_threshold:
            raise ValueError(
                f"reception_threshold ({self.reception_threshold}) > admission_threshold "
                f"({self.admission_threshold})"
            )
        for sched in self.schedules:
            if sched.min_workers is not None and sched.min_workers > self.max_workers:
                raise ValueError(f"schedule {sched.label()!r}: min_workers ({sched.min_workers}) > "
                                 f"max_workers ({self.max_workers})")
        if self.fallback is not None and self.fallback.workers is not None \
                and self.fallback.workers > self.max_workers:
            raise ValueError(f"fallback workers ({self.fallback.workers}) > max_workers ({self.max_workers})")
        check_groups(self.groups, self.canary)
        for group in self.groups:  # each group's pool must run on a valid policy of its own
            self.for_group(group.name)
        return self

    def for_group(self, name: str) -> Policy:
        """The policy the pool of group ``name`` runs on: the tier's, with the group's fields
        applied (raises ValueError naming the group if that is invalid, KeyError if no such group)."""
        group = next((g for g in self.groups if g.name == name), None)
        if group is None:
            raise KeyError(name)
        try:
            return Policy.model_validate(group_overrides(group, self.model_dump()))
        except ValidationError as exc:
            raise ValueError(f"group {name}: {_one_line(exc)}") from None

    def weights(self) -> tuple[tuple[str, float], ...]:
        """The groups' (name, weight) in order: what ``protocol.groups.assign`` takes."""
        return tuple((g.name, g.weight) for g in self.groups)

    def group_handler(self, name: str | None) -> str:
        """The handler the pool of group ``name`` runs (the tier's for None or an unknown group)."""
        group = next((g for g in self.groups if g.name == name), None)
        return group.handler if group is not None and group.handler is not None else self.handler

    def to_json(self) -> str:
        """Canonical JSON, as stored in the policy key."""
        return self.model_dump_json()


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "policy"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return " ".join("; ".join(parts).split())  # field names come from input: keep one line


def parse_policy(raw: str | bytes | Mapping[str, Any], handlers: Iterable[str] | None = None,
                 group: str | None = None) -> Policy:
    """Validate a policy from JSON (or a mapping); check the handler against ``handlers``: the
    handler of ``group`` (a reader of that group's pool runs only that one), else the tier's."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, huge ints, nesting
            raise PolicyError(f"not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(raw, Mapping):
        raise PolicyError(f"a policy is a JSON object, got {type(raw).__name__}")
    try:
        policy = Policy.model_validate(dict(raw))
    except ValidationError as exc:
        raise PolicyError(_one_line(exc)) from None
    if handlers is not None:
        known = sorted(set(handlers))
        name = policy.group_handler(group)
        if name not in known:
            where = f"group {group}: handler" if group and policy.groups else "handler"
            raise PolicyError(f"{where}: {name!r} is not registered (known: {', '.join(known)})")
    return policy


def parse_assignments(pairs: Iterable[str]) -> dict[str, Any]:
    """Turn CLI ``key=value`` words into a dict; values are JSON when they parse, else text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise PolicyError(f"expected key=value, got {pair!r}")
        if key not in Policy.model_fields:
            raise PolicyError(f"unknown policy field {key!r} (fields: {', '.join(Policy.model_fields)})")
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


def updated(policy: Policy, changes: Mapping[str, Any], handlers: Iterable[str] | None = None) -> Policy:
    """Return ``policy`` with ``changes`` applied, validated as a whole."""
    merged = policy.model_dump(mode="json")
    merged.update(changes)
    return parse_policy(merged, handlers)
