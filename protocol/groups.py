"""Groups of a tier: blue/green and canary, each a runtime version in a pool of its own.

A turns tier's policy may declare ``rollout.groups``. Each names a handler (and its options), how
its workers start (``runtime``: the name of a runtime the commander's own configuration
allows, an interpreter for the process runtime or an image for the Kubernetes one; or, on
Kubernetes, an existing ``deployment``), a traffic ``weight`` and its own
``min_workers``/``max_workers``; any other policy field of the tier may be set for the group in
``scaling``, the rest is inherited. Users are assigned
stickily: a stable hash of the user id against the cumulative weights (:func:`assign`), unless
pinned.

A group's workers form the *pool* ``<tier>.<group>`` (:func:`pool_name`): its ready streams,
active set, pressure stream, starting gauge and decide state are keyed by the pool, so the
commander observes, decides and acts per pool with the same ``decide()``. ``.`` is no tier
character, so a pool never names a tier.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

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

from protocol.ids import InvalidId, validate_tier

_GROUP_RE = re.compile(r"[a-z][a-z0-9_-]{0,15}")
_RUNTIME_RE = re.compile(r"[a-z][a-z0-9_.-]{0,39}")
POOL_SEP = "."
MAX_GROUPS = 8
HASH_SPACE = 10_000  # a user's point on the weight line: 0 .. HASH_SPACE - 1 (0.01 % steps)


def validate_group(name: object) -> str:
    """Return ``name`` if it is a valid group name (1-16 of a-z 0-9 _ -, a letter first), else raise."""
    if not isinstance(name, str) or not _GROUP_RE.fullmatch(name):
        raise InvalidId(f"invalid group {str(name)[:40]!r}: use 1-16 of a-z 0-9 _ -, starting with a letter")
    return name


def validate_runtime_name(name: object) -> str:
    """Return ``name`` if it is a valid group runtime name (1-40 of a-z 0-9 _ . -, a letter
    first), else raise ValueError."""
    if not isinstance(name, str) or not _RUNTIME_RE.fullmatch(name):
        raise ValueError(f"invalid runtime name {str(name)[:40]!r}: use 1-40 of a-z 0-9 _ . -, starting "
                         "with a letter")
    return name


def pool_name(tier: str, group: str = "") -> str:
    """The pool of ``group`` in ``tier`` (``chat.green``); the tier itself when ``group`` is empty."""
    validate_tier(tier)
    return f"{tier}{POOL_SEP}{validate_group(group)}" if group else tier


def split_pool(pool: str) -> tuple[str, str]:
    """``chat.green`` -> (``chat``, ``green``); ``chat`` -> (``chat``, ``""``). Raises InvalidId."""
    tier, sep, group = pool.partition(POOL_SEP)
    validate_tier(tier)
    if sep:
        validate_group(group)
    return tier, group


def validate_pool(pool: object) -> str:
    """Return ``pool`` if it is a tier name or ``<tier>.<group>``, else raise InvalidId."""
    if not isinstance(pool, str):
        raise InvalidId(f"invalid pool: a string, got {type(pool).__name__}")
    split_pool(pool)
    return pool


class Group(BaseModel):
    """One group of a tier: what it runs, how its workers start, its share and its bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="1-16 of a-z 0-9 _ -, starting with a letter; its pool is `<tier>.<name>`")
    handler: str | None = Field(None, description="the handler its workers run; null: the tier's")
    handler_options: dict[str, float | int | str | bool] | None = Field(
        None, description="its handler's options; null: the tier's")
    runtime: str | None = Field(None, description="the name of a group runtime the commander allows "
                                "(its FLEET_COMMANDER_GROUP_RUNTIMES): the interpreter its workers run "
                                "(process runtime) or the image of a Deployment made from a copy of the "
                                "tier's (Kubernetes runtime); null: the tier's")
    deployment: str | None = Field(None, max_length=253, description="Kubernetes runtime: an existing "
                                   "Deployment that runs the group")
    weight: float = Field(0.0, ge=0.0, le=1_000_000.0, description="its share of the users (relative "
                          "to the other groups' weights)")
    min_workers: NonNegativeInt | None = Field(None, le=10_000, description="its floor; null: the tier's")
    max_workers: PositiveInt | None = Field(None, le=10_000, description="its cap; null: the tier's")
    scaling: dict[str, Any] = Field(default_factory=dict, description="any other policy field for this "
                                    "group only, by name or dotted path (`{\"concurrency\": 2}`); the "
                                    "rest is the tier's")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        try:
            return validate_group(v)
        except InvalidId as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="before")
    @classmethod
    def _no_code_named(cls, data: Any) -> Any:
        """A group names a runtime; an interpreter or an image in the policy itself is refused
        (a null one, as policies written before runtimes hold, is dropped)."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in ("python", "image") or v is not None}
            for key in ("python", "image"):
                if key in data:
                    raise ValueError(
                        f"group {str(data.get('name'))[:16]}: `{key}` may not be given in a policy "
                        f"(whoever writes policies would choose "
                        f"what runs): name a runtime the commander allows instead, `runtime: "
                        f"<name>`, from its FLEET_COMMANDER_GROUP_RUNTIMES")
        return data

    @field_validator("runtime")
    @classmethod
    def _runtime(cls, v: str | None) -> str | None:
        return None if v is None else validate_runtime_name(v)


class RolloutGuard(BaseModel):
    """The automatic abort of a rollout: the canary's weight goes to 0 when, over the last
    ``window_s``, its error rate exceeds the other groups' by more than ``error_rate_margin``
    (absolute: 0.05 = five points), or its mean handler latency exceeds theirs by more than
    ``latency_margin`` (relative: 0.5 = 50 % slower). No verdict before both sides served
    ``min_turns`` turns in the window."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    window_s: PositiveFloat = Field(120.0, le=86_400, description="the window the canary is judged over")
    error_rate_margin: float | None = Field(0.05, ge=0.0, le=1.0, description="abort when the canary's "
                                            "error rate exceeds the others' by more (absolute); null: not "
                                            "judged on errors")
    latency_margin: float | None = Field(0.5, ge=0.0, le=100.0, description="abort when the canary's mean "
                                         "handler time exceeds the others' by more (relative); null: not "
                                         "judged on latency")
    min_turns: PositiveInt = Field(20, le=1_000_000, description="no verdict before both sides served this "
                                   "many turns in the window")


class Rollout(BaseModel):
    """A tier's groups (blue/green and canary, each a pool of its own) and the rollout between them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    groups: tuple[Group, ...] = Field((), max_length=MAX_GROUPS, description="the tier's groups; empty: "
                                      "one pool, the tier")
    canary: str | None = Field(None, description="the group under rollout (set by `fleet rollout`), "
                               "judged by `guard`")
    guard: RolloutGuard | None = Field(None, description="the automatic abort of a failing canary; null: "
                                       "none")
    epoch: int = Field(0, ge=0, description="the weights' version: +1 at each change of the weights "
                       "(written by `write_policy`); a user's group is chosen once per epoch")

    @model_validator(mode="after")
    def _as_a_whole(self) -> Rollout:
        check_groups(self.groups, self.canary)
        return self

    def weights(self) -> tuple[tuple[str, float], ...]:
        """The groups' (name, weight) in order: what :func:`assign` takes."""
        return tuple((g.name, g.weight) for g in self.groups)


def check_groups(groups: Sequence[Group], canary: str | None) -> None:
    """The rules a tier's groups follow as a whole; raises ValueError with the first broken one."""
    if not groups:
        if canary is not None:
            raise ValueError(f"canary {canary!r} names a group, but the tier has none")
        return
    if len(groups) > MAX_GROUPS:
        raise ValueError(f"{len(groups)} groups: at most {MAX_GROUPS}")
    names = [g.name for g in groups]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"group names must be unique: {', '.join(dup)} repeated")
    if not any(g.weight > 0 for g in groups):
        raise ValueError("at least one group needs a weight > 0 (else no user has a group)")
    if canary is not None and canary not in names:
        raise ValueError(f"canary {canary!r} is not one of the groups ({', '.join(names)})")


# --- sticky assignment (pure) ------------------------------------------------------------
def user_point(user: str) -> int:
    """The user's fixed point on the weight line, 0 .. HASH_SPACE - 1: BLAKE2b of the id (the
    same in every process and version; never Python's salted ``hash()``)."""
    digest = hashlib.blake2b(user.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % HASH_SPACE


def assign(user: str, weights: Sequence[tuple[str, float]], pin: str | None = None,
           unavailable: frozenset[str] = frozenset()) -> str:
    """The group of ``user``: its pin if that group exists and is available, else the group
    whose slice of the cumulative weights holds the user's point.

    Groups in ``unavailable`` (rejected: their workers cannot start) count as weight 0. The
    slices keep their order, so raising the last group's weight from 5 to 10 (of 100) moves
    only the users whose point lies between the two thresholds. With no available weight
    left, the first available group serves everyone; with none available, the first group
    (its turns wait in their inboxes).
    """
    names = [name for name, _ in weights]
    if not names:
        raise ValueError("no groups to assign from")
    if pin is not None and pin in names and pin not in unavailable:
        return pin
    live = [(name, w if name not in unavailable else 0.0) for name, w in weights]
    total = sum(w for _, w in live)
    if total <= 0:
        return next((n for n in names if n not in unavailable), names[0])
    point = user_point(user) * total / HASH_SPACE
    edge = 0.0
    for name, weight in live:
        edge += weight
        if point < edge and weight > 0:
            return name
    return next(name for name, w in reversed(live) if w > 0)  # (rounding at the very top)


GroupRecord = tuple[str, int]  # a user's group and the epoch of the weights it was chosen by


def settle(user: str, weights: Sequence[tuple[str, float]], epoch: int, pin: str | None,
           unavailable: frozenset[str], record: GroupRecord | None) -> tuple[str, GroupRecord | None]:
    """The group of ``user``'s next turn by one reader's view (``weights`` of ``epoch``), and the
    record of it kept for the user (a new one when it differs from ``record``).

    The user keeps its recorded group while the record is of this epoch or a newer one (a reader
    with an older view follows it, even to a group it does not know yet); it is chosen again
    (:func:`assign`) only by a newer epoch, or when its group is gone or unavailable. So a weight
    change moves a user at most once, at a turn boundary, however the readers' views of it are
    interleaved. A pin wins over both, and leaves the record as it is."""
    names = {name for name, _ in weights}
    if pin is not None and pin in names and pin not in unavailable:
        return pin, record
    if record is not None:
        group, at = record
        if group not in unavailable and (at > epoch or (at == epoch and group in names)):
            return group, record
    group = assign(user, weights, None, unavailable)
    return group, (group, epoch)


def rollout_weights(weights: Sequence[tuple[str, float]], group: str, percent: float,
                    rejected: frozenset[str] = frozenset()) -> tuple[tuple[str, float], ...]:
    """The weights after ``fleet rollout T group --weight percent``: ``group`` gets ``percent`` of
    100, the others share the rest in proportion to their weights now (equally if they are all
    0); ``rejected`` groups (their workers cannot start) get none of it, unless no other is left.
    The total stays 100, so only the users between the old and new thresholds move (a
    proportional rescale of all weights moves nobody: :func:`assign` scales points by the total).
    """
    names = [n for n, _ in weights]
    if group not in names:
        raise ValueError(f"no group {group!r} (groups: {', '.join(names)})")
    if not 0 <= percent <= 100:
        raise ValueError(f"weight {percent} is not a percentage (0..100)")
    others = [(n, w) for n, w in weights if n != group]
    if any(n not in rejected for n, _ in others):
        others = [(n, w) for n, w in others if n not in rejected]
    rest = 100.0 - percent
    if not others:
        if percent <= 0:
            raise ValueError(f"{group} is the only group: its weight cannot go to 0")
        return ((group, 100.0),)
    total = sum(w for _, w in others)
    share = {n: rest * w / total if total > 0 else rest / len(others) for n, w in others}
    return tuple((n, round(float(percent), 6) if n == group else round(share.get(n, 0.0), 6))
                 for n in names)
