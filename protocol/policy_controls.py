"""The policy's controls from HPA, KEDA, Knative and Karpenter (DESIGN §5), validated here.

- ``ScaleBehavior`` / ``RateRule``: per-direction rate limits, like the HPA's ``behavior``:
  each rule allows ``value`` workers (``workers``) or ``value`` % of the count at the start of
  the period (``percent``) per ``period_s``; ``select`` takes the rule that allows the most
  change (``max``), the least (``min``), or forbids that direction (``disabled``).
- ``Fallback``: KEDA's ``fallback``: after ``after`` failed observations in a row, ``hold``
  the count or go up to ``workers`` (``fixed``); Fleet never scales in on missing data.
- ``ScheduledBounds``: a floor and/or cap in force from each ``start`` to the next ``end``
  (cron expressions, in ``timezone``), like KEDA's cron scaler: "min 10 on weekdays
  09:00-18:00" is ``{"start": "0 9 * * 1-5", "end": "0 18 * * 1-5", "min_workers": 10,
  "timezone": "Europe/Paris"}``.
- ``DisruptionBudget``: at most ``workers`` (or ``percent`` of the tier, rounded up) draining
  at once, like Karpenter's disruption budgets.
- ``ScaleInHold``: how long an idle worker's capacity is kept (the derived scale-in hold; see
  ``commander.holdtime``).

Cron expressions are checked with ``croniter`` (pallets-eco; the library RQ's scheduler uses
too); time zones are IANA names read with ``zoneinfo``.
"""

from __future__ import annotations

from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    field_validator,
    model_validator,
)

_MAX_PERIOD_S = 1800.0  # the HPA's own limit on periodSeconds


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RateRule(_Frozen):
    """At most ``value`` workers, or ``value`` % of the count at the period's start, per ``period_s``."""

    type: Literal["workers", "percent"]
    value: PositiveInt = Field(le=10_000)
    period_s: float = Field(gt=0.0, le=_MAX_PERIOD_S)


class ScaleBehavior(_Frozen):
    """The rate limits of one direction; no rules means no limit (beyond ``max_step_up`` up, when set)."""

    rules: tuple[RateRule, ...] = ()
    select: Literal["max", "min", "disabled"] = "max"


class Fallback(_Frozen):
    """What to do once ``after`` observations in a row have failed (KEDA's ``fallback``)."""

    after: PositiveInt = Field(3, le=1_000)
    action: Literal["hold", "fixed"] = "hold"
    workers: NonNegativeInt | None = Field(None, le=10_000)

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


class ScheduledBounds(_Frozen):
    """A floor and/or a cap in force from each ``start`` fire to the next ``end`` fire."""

    start: str
    end: str
    timezone: str = "UTC"
    min_workers: NonNegativeInt | None = Field(None, le=10_000)
    max_workers: PositiveInt | None = Field(None, le=10_000)
    name: str = Field("", max_length=60)

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


class DisruptionBudget(_Frozen):
    """At most ``workers``, or ``percent`` of the tier's workers (rounded up), draining at once."""

    workers: NonNegativeInt | None = Field(None, le=10_000)
    percent: float | None = Field(None, ge=0.0, le=100.0)

    @model_validator(mode="after")
    def _one_of(self) -> DisruptionBudget:
        if (self.workers is None) == (self.percent is None):
            raise ValueError("a disruption budget sets exactly one of workers and percent")
        return self


class ScaleInHold(_Frozen):
    """Bounds of the derived scale-in hold (``scale_down_stabilization_s: null``)."""

    min_s: float = Field(15.0, ge=0.0, le=86_400)
    max_s: float = Field(1_800.0, ge=0.0, le=86_400)
    unmeasured_s: float = Field(300.0, ge=0.0, le=86_400)  # before any start has been measured

    @model_validator(mode="after")
    def _ordered(self) -> ScaleInHold:
        if self.min_s > self.max_s:
            raise ValueError(f"scale-in hold min_s ({self.min_s:g}) > max_s ({self.max_s:g})")
        return self
