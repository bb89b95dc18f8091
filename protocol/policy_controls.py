"""A policy's ``controls``: what users of the HPA, KEDA, Knative and Karpenter rely on.

- ``ScaleBehavior`` / ``RateRule``: per-direction rate limits, like the HPA's ``behavior``.
- ``Fallback``: KEDA's ``fallback``: what to do once observations keep failing.
- ``ScheduledBounds``: a floor and/or cap by the clock (cron expressions in a time zone), like
  KEDA's cron scaler.
- ``DisruptionBudget``: how much of a tier may drain at once, like Karpenter's budgets.
- ``TimeWindow``: a daily UTC window with no scale-in (a change freeze).

Cron expressions are checked with ``croniter`` (the library RQ's scheduler uses too); time
zones are IANA names read with ``zoneinfo``.
"""

from __future__ import annotations

import re
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

FROZEN = ConfigDict(extra="forbid", frozen=True)  # every policy model: no unknown key, immutable
_MAX_PERIOD_S = 1800.0  # the HPA's own limit on periodSeconds
_HHMM_RE = re.compile(r"([01]\d|2[0-3]):[0-5]\d")


class RateRule(BaseModel):
    """At most ``value`` workers, or ``value`` % of the count at the period's start, per ``period_s``."""

    model_config = FROZEN
    type: Literal["workers", "percent"] = Field(
        description="`workers`: `value` is a worker count; `percent`: a percentage of the count at the "
                    "period's start")
    value: PositiveInt = Field(le=10_000, description="how much change the rule allows per period")
    period_s: float = Field(gt=0.0, le=_MAX_PERIOD_S, description="the period the rule counts changes over")


class ScaleBehavior(BaseModel):
    """The rate limits of one direction; no rules means no limit."""

    model_config = FROZEN
    rules: tuple[RateRule, ...] = Field((), description="the rate rules of this direction")
    select: Literal["max", "min", "disabled"] = Field(
        "max", description="`max`: the rule that allows the most change; `min`: the least; "
                           "`disabled`: no change in this direction at all")


class Fallback(BaseModel):
    """What to do once ``after`` observations in a row have failed (KEDA's ``fallback``)."""

    model_config = FROZEN
    after: PositiveInt = Field(3, le=1_000, description="failed observations in a row before the fallback")
    action: Literal["hold", "fixed"] = Field(
        "hold", description="`hold`: keep the count; `fixed`: go up to `workers` (never down)")
    workers: NonNegativeInt | None = Field(None, le=10_000, description="the count of a `fixed` fallback")

    @model_validator(mode="after")
    def _fixed_has_a_count(self) -> Fallback:
        if self.action == "fixed" and self.workers is None:
            raise ValueError("a fixed fallback needs workers")
        if self.action == "hold" and self.workers is not None:
            raise ValueError("workers is for the fixed fallback only")
        return self


def check_zone(name: str) -> str:
    """An IANA time zone name, or ``ValueError``."""
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r} (an IANA name, e.g. UTC or Europe/Paris)") from None
    return name


class ScheduledBounds(BaseModel):
    """A floor and/or a cap in force from each ``start`` fire to the next ``end`` fire: "min 10 on
    weekdays 09:00-18:00" is ``{"start": "0 9 * * 1-5", "end": "0 18 * * 1-5", "min_workers": 10,
    "timezone": "Europe/Paris"}``."""

    model_config = FROZEN
    start: str = Field(description="a 5-field cron expression: when the bounds come into force")
    end: str = Field(description="a 5-field cron expression: when they stop")
    timezone: str = Field("UTC", description="the IANA time zone the cron expressions are read in")
    min_workers: NonNegativeInt | None = Field(None, le=10_000, description="the floor while in force")
    max_workers: PositiveInt | None = Field(None, le=10_000, description="the cap while in force")
    name: str = Field("", max_length=60, description="how the ledger names it (else its expressions)")

    @field_validator("start", "end")
    @classmethod
    def _cron(cls, v: str) -> str:
        if len(v.split()) != 5 or not croniter.is_valid(v):
            raise ValueError(f"{v!r} is not a 5-field cron expression (minute hour day month weekday)")
        return v

    @field_validator("timezone")
    @classmethod
    def _zone(cls, v: str) -> str:
        return check_zone(v)

    @model_validator(mode="after")
    def _some_bound(self) -> ScheduledBounds:
        if self.min_workers is None and self.max_workers is None:
            raise ValueError("a schedule sets min_workers, max_workers or both")
        if self.min_workers is not None and self.max_workers is not None \
                and self.min_workers > self.max_workers:
            raise ValueError(f"schedule min_workers ({self.min_workers}) > max_workers ({self.max_workers})")
        return self

    def label(self) -> str:
        """How the ledger names it."""
        return self.name or f"{self.start} .. {self.end} {self.timezone}"


class DisruptionBudget(BaseModel):
    """At most ``workers``, or ``percent`` of the tier's workers (rounded up), draining at once."""

    model_config = FROZEN
    workers: NonNegativeInt | None = Field(None, le=10_000, description="at most this many draining at once")
    percent: float | None = Field(None, ge=0.0, le=100.0,
                                  description="at most this percentage of the tier, rounded up")

    @model_validator(mode="after")
    def _one_of(self) -> DisruptionBudget:
        if (self.workers is None) == (self.percent is None):
            raise ValueError("a disruption budget sets exactly one of workers and percent")
        return self


class TimeWindow(BaseModel):
    """A daily UTC window, e.g. a change freeze: ``{"start": "09:00", "end": "17:00"}``; ``end``
    before ``start`` wraps past midnight."""

    model_config = FROZEN
    start: str = Field(description="HH:MM, 24 h, UTC")
    end: str = Field(description="HH:MM, 24 h, UTC (before `start`: the window wraps past midnight)")
    days: tuple[int, ...] = Field((), description="0 (Monday) .. 6 (Sunday); empty: every day")

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


class Controls(BaseModel):
    """How the commander may change a tier's workers: rate limits, the fallback, schedules, pauses,
    the disruption budget, change freezes, draining and recycling."""

    model_config = FROZEN
    scale_up: ScaleBehavior = Field(ScaleBehavior(), description="rate limits of scale-up (the HPA's "
                                    "`behavior`); no rules: no limit beyond `max_step_up`")
    scale_down: ScaleBehavior = Field(ScaleBehavior(), description="rate limits of scale-in; "
                                      "`select: disabled` forbids scale-in")
    fallback: Fallback | None = Field(None, description="what to do after failed observations in a "
                                      "row; null: none (scale-in still waits for good observations)")
    schedules: tuple[ScheduledBounds, ...] = Field((), max_length=32, description="floors and caps by "
                                                   "the clock (cron expressions in a time zone)")
    paused: bool = Field(False, description="hold the worker count as it is")
    paused_scale_in: bool = Field(False, description="never scale in (scale-up goes on)")
    disruption_budget: DisruptionBudget | None = Field(None, description="at most this much of the "
                                                       "tier draining at once; null: no limit")
    no_scale_in_windows: tuple[TimeWindow, ...] = Field((), description="daily UTC windows with no "
                                                        "scale-in (change freezes)")
    drain_timeout_s: PositiveFloat = Field(30.0, le=3_600, description="a retiring worker is killed "
                                           "after draining this long")
    pending_timeout_s: PositiveFloat = Field(
        120.0, le=86_400, description="a worker waiting this long for a place to run (Kubernetes: a "
                                      "Pending pod) is recorded once as `no-capacity` in the ledger; it "
                                      "still counts as starting")
    max_protection_s: float = Field(3_600.0, ge=0.0, le=86_400, description="the longest a handler may "
                                    "protect its worker from scale-in (turns tiers)")
    max_worker_age_s: PositiveFloat | None = Field(
        None, le=30 * 86_400, description="recycle a worker past this age: a replacement starts first, "
                                          "then the old one drains; null: never")
    max_turns_per_worker: PositiveInt | None = Field(
        None, le=10**9, description="recycle a worker once it served this many turns (turns tiers); "
                                    "null: never")
