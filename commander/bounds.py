"""Time-based bounds of a tier: scheduled floors and caps (cron + time zone), no-scale-in windows.

A ``ScheduledBounds`` entry is in force from a ``start`` fire to the next ``end`` fire, both
cron expressions read in the entry's time zone (``croniter`` over ``zoneinfo``, so daylight
saving time moves the fires with the wall clock). At ``now`` it is in force when its latest
start fire at or before ``now`` is later than its latest end fire. The tier's floor is the
highest of ``min_workers`` and the floors in force, its cap the lowest of ``max_workers`` and
the caps in force; a floor above the cap is lowered to the cap (the cap is the hard limit).

Pure: ``now`` (unix seconds) is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from zoneinfo import ZoneInfo

from croniter import croniter

from protocol.policy import ScaleRules
from protocol.policy_controls import ScheduledBounds

_DAY_S = 86_400
_EPOCH_WEEKDAY = 3  # 1970-01-01 was a Thursday (Monday = 0)


@dataclass(frozen=True, slots=True)
class Bounds:
    """The tier's floor and cap at one moment, and which schedules set them."""

    floor: int
    cap: int
    floor_by: str = "min_workers"
    cap_by: str = "max_workers"


@lru_cache(maxsize=256)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


def last_fire(expr: str, zone: str, now: float) -> float:
    """The unix time of ``expr``'s latest fire at or before ``now``, in ``zone``."""
    base = datetime.fromtimestamp(now + 1e-3, _zone(zone))  # a fire exactly at now counts
    fire: datetime = croniter(expr, base).get_prev(datetime)
    return fire.timestamp()


def in_force(schedule: ScheduledBounds, now: float) -> bool:
    """Whether ``schedule`` holds at ``now``: its last start is later than its last end."""
    return last_fire(schedule.start, schedule.timezone, now) > last_fire(schedule.end, schedule.timezone, now)


def tier_bounds(policy: ScaleRules, now: float) -> Bounds:
    """The floor and cap at ``now``: the policy's, raised or lowered by the schedules in force."""
    floor, cap, floor_by, cap_by = policy.min_workers, policy.max_workers, "min_workers", "max_workers"
    for schedule in policy.controls.schedules:
        if not in_force(schedule, now):
            continue
        if schedule.min_workers is not None and schedule.min_workers > floor:
            floor, floor_by = schedule.min_workers, f"schedule {schedule.label()}"
        if schedule.max_workers is not None and schedule.max_workers < cap:
            cap, cap_by = schedule.max_workers, f"schedule {schedule.label()}"
    if floor > cap:
        floor, floor_by = cap, cap_by
    return Bounds(floor, cap, floor_by, cap_by)


def utc_weekday_minute(now: float) -> tuple[int, int]:
    """(weekday 0=Monday, minute of day) of a unix time, in UTC."""
    seconds = int(now // 1)
    days, second_of_day = divmod(seconds, _DAY_S)
    return (days + _EPOCH_WEEKDAY) % 7, second_of_day // 60


def in_no_scale_in_window(policy: ScaleRules, now: float) -> bool:
    """Whether ``now`` falls inside one of the policy's no-scale-in windows."""
    if not policy.controls.no_scale_in_windows:
        return False
    weekday, minute = utc_weekday_minute(now)
    return any(w.contains(weekday, minute) for w in policy.controls.no_scale_in_windows)
