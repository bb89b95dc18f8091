"""A deferral: background work a handler asks for, committed with its turn.

A handler calls ``ctx.defer(name, *args, **kwargs)``; the worker writes one outbox entry per
deferral in the turn's atomic commit (``turn_commit.lua``), and the relay (``fleet relay``)
moves it into an RQ queue under :func:`job_id`, a name fixed by the user, the turn id and the
index, so that RQ holds it once however often the relay retries.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, field_validator

from protocol.ids import validate_token, validate_user_id
from protocol.models import _Model

MAX_DEFERRAL_BYTES = 64 * 1024  # one deferral's encoded size: an outbox entry stays small
MAX_DEFERRALS = 32  # per turn
JOB_ENTRY = "worker.jobs.run"  # the function of every RQ job Fleet enqueues (worker/jobs.py)
RESULT_TTL_S = 86_400  # RQ keeps a done job's hash this long: the relay's duplicate check needs it
_JOB_NAME_RE = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
_QUEUE_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_PLAIN_DEPTH = 16


class Deferral(_Model):
    """One job a turn asked for: a registered job name with plain-data arguments."""

    name: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    queue: str
    delay_s: NonNegativeFloat = 0.0
    user: str
    turn_id: str
    index: NonNegativeInt
    retry_max: NonNegativeInt = 0
    retry_interval_s: list[NonNegativeInt] = Field(default_factory=list)
    job_timeout_s: PositiveInt | None = None  # its rq tier's (the relay sets it); None: RQ's default
    ts: float = 0.0  # commit time, unix seconds: a delay counts from it

    _name = field_validator("name")(lambda v: validate_job_name(v))
    _queue = field_validator("queue")(lambda v: validate_queue(v))
    _user = field_validator("user")(lambda v: validate_user_id(v))
    _turn_id = field_validator("turn_id")(lambda v: validate_token(v, "turn id"))

    @field_validator("args", "kwargs")
    @classmethod
    def _plain(cls, v: Any) -> Any:
        check_plain(v)
        return v

    @property
    def job_id(self) -> str:
        return job_id(self.user, self.turn_id, self.index)


def validate_job_name(name: object) -> str:
    """A job name: 1-64 of ``a-z 0-9 _ . -``, starting with a letter."""
    if not isinstance(name, str) or not _JOB_NAME_RE.fullmatch(name):
        raise ValueError(f"invalid job name {str(name)[:80]!r}: use 1-64 of a-z 0-9 _ . -, "
                         "starting with a letter")
    return name


def validate_queue(queue: object) -> str:
    """An RQ queue name Fleet writes to: 1-32 of ``a-z 0-9 _ -``."""
    if not isinstance(queue, str) or not _QUEUE_RE.fullmatch(queue):
        raise ValueError(f"invalid queue {str(queue)[:40]!r}: use 1-32 of a-z 0-9 _ -")
    return queue


def check_plain(value: Any, depth: int = 0) -> None:
    """Raise ValueError unless ``value`` is plain data: None, bool, int, finite float, str,
    and lists / string-keyed dicts of them (what msgpack and JSON both carry unchanged)."""
    if depth > _PLAIN_DEPTH:
        raise ValueError("job arguments are nested too deep")
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("job arguments hold a float that is not finite")
        return
    if isinstance(value, list | tuple):
        for item in value:
            check_plain(item, depth + 1)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise ValueError("job argument dicts must have string keys")
            check_plain(item, depth + 1)
        return
    raise ValueError(f"job arguments must be plain data, not {type(value).__name__}")


def job_id(user: str, turn_id: str, index: int) -> str:
    """RQ's job id of a turn's ``index``-th deferral: the same on every retry of the relay.

    RQ allows letters, digits, ``_`` and ``-`` only, and a turn id is unique per user only, so
    the user and turn id are hashed (SHA-256, 128 bits kept) and the index is spelled out."""
    digest = hashlib.sha256(f"{user}\0{turn_id}".encode()).hexdigest()[:32]
    return f"fleet-{digest}-{index}"
