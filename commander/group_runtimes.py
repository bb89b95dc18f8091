"""The group runtimes this commander allows: its own configuration, never the policy's.

A policy's group refers to a runtime by name (``Group.runtime``); what that name runs, an
interpreter path for the ``process`` runtime or an image for the ``kubernetes`` one, is only
ever read from the commander's setting ``group_runtimes`` (``FLEET_COMMANDER_GROUP_RUNTIMES``,
JSON: ``{"py312": {"python": "/opt/py312/bin/python"}, "gpu": {"image": "registry/x:1.2"}}``).
So whoever may write a policy in Redis can choose among the operator's runtimes, never name a
binary or an image of their own. :func:`resolve` says what a group's name allows here, or why
the group cannot start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.groups import Group, validate_runtime_name

RuntimeField = Literal["python", "image"]
_WHAT = {"python": "interpreter (`python`) for the process runtime",
         "image": "image (`image`) for the kubernetes runtime"}


class GroupRuntime(BaseModel):
    """One allowed group runtime: an interpreter for the process runtime, an image for the
    kubernetes one (or both, so one name serves on either)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    python: str | None = Field(None, description="the absolute path of an interpreter (a virtualenv "
                               "with Fleet and the handler installed)")
    image: str | None = Field(None, min_length=1, max_length=512, description="a container image")

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\x00" in v or len(v) > 1024):
            raise ValueError(f"{v[:80]!r} is not an absolute interpreter path")
        return v

    @model_validator(mode="after")
    def _something(self) -> GroupRuntime:
        if self.python is None and self.image is None:
            raise ValueError("a group runtime gives a `python`, an `image`, or both")
        return self


def check_names(runtimes: Mapping[str, GroupRuntime]) -> dict[str, GroupRuntime]:
    """``runtimes`` if every name is a valid runtime name (as a policy would write it), else raise."""
    for name in runtimes:
        validate_runtime_name(name)
    return dict(runtimes)


def resolve(runtimes: Mapping[str, GroupRuntime], tier: str, group: Group,
            need: RuntimeField) -> tuple[str | None, str | None]:
    """(what ``group``'s runtime gives for ``need``, why the group cannot start). ``(None,
    None)``: the group names no runtime (it runs as its tier does)."""
    if group.runtime is None:
        return None, None
    entry = runtimes.get(group.runtime)
    if entry is None:
        known = ", ".join(sorted(runtimes)) or "none"
        return None, (f"group {group.name} of tier {tier} names runtime {group.runtime!r}, which "
                      f"this commander does not allow (its FLEET_COMMANDER_GROUP_RUNTIMES names: "
                      f"{known})")
    value = entry.python if need == "python" else entry.image
    if value is None:
        return None, (f"group {group.name} of tier {tier}: runtime {group.runtime!r} gives no "
                      f"{_WHAT[need]}")
    return value, None
