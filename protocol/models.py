"""Message models: validated once at the boundary, trusted inside."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from protocol.ids import validate_tier, validate_token, validate_user_id
from protocol.metrics_buckets import BUCKET_COUNT

MAX_TEXT_CHARS = 32_000
_ENTRY_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")  # a stream entry id


WorkerState = Literal["starting", "ready", "draining"]  # a worker's state, as its reports say


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Turn(_Model):
    """One user message submitted to a tier."""

    turn_id: str
    user: str
    tier: str = "chat"
    text: str = Field(max_length=MAX_TEXT_CHARS)
    ts: float = Field(description="submit time, unix seconds")
    meta: dict[str, Any] = Field(default_factory=dict)
    reply_fmt: Literal["msgpack", "json"] = "msgpack"
    # streamed: what the handler emits goes to the turn's reply stream (keys.stream), closed by an
    # 'end' entry written with the reply, so a reader of the stream alone learns the turn ended
    stream: bool = False
    # unix seconds after which nobody waits for the reply: a worker that reaches the turn later
    # answers it ``expired`` without calling the handler (None: no limit)
    deadline: float | None = Field(None, gt=0, allow_inf_nan=False)

    _turn_id = field_validator("turn_id")(lambda v: validate_token(v, "turn id"))
    _user = field_validator("user")(lambda v: validate_user_id(v))
    _tier = field_validator("tier")(lambda v: validate_tier(v))

    @model_serializer(mode="wrap")
    def _plain_turn_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A turn not streamed and without a deadline is encoded without ``stream`` and
        ``deadline``: its bytes are what they were before them (as cheap, and readable by a worker
        that does not know the fields)."""
        body: dict[str, Any] = handler(self)
        if not self.stream:
            body.pop("stream", None)
        if body.get("deadline", 0) is None:
            del body["deadline"]
        return body


ReplyStatus = Literal["ok", "error", "cancelled", "expired"]


class Reply(_Model):
    """What the submitter gets back: exactly one per accepted turn. ``status`` says how it ended:
    answered (``ok``), failed (``error``), stopped by its user (``cancelled``) or reached after
    its deadline (``expired``); ``ok`` is true for the first only."""

    turn_id: str
    user: str
    ok: bool
    status: ReplyStatus = "ok"
    text: str = ""
    error: str | None = None
    worker: str = ""
    ts: float = 0.0
    attempts: int = 1
    context: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _status_of_ok(cls, data: Any) -> Any:
        # a reply that does not say its status (older workers', and failures built without one)
        if isinstance(data, dict) and "status" not in data:
            return {**data, "status": "ok" if data.get("ok") else "error"}
        return data


class SessionEntry(_Model):
    """One answered turn as the session keeps it; ``cut`` if its reply was stopped midway (what
    was streamed by then)."""

    turn_id: str
    entry: str  # inbox stream id: the order of submission
    text: str
    reply: str
    ts: float
    cut: bool = False


class MemoryItem(_Model):
    """An episodic memory. Ranked by ``stores.memory.score``."""

    id: str
    text: str
    importance: float = Field(gt=0.0, le=1.0)
    ts: float


Importance = Annotated[float, Field(gt=0.0, le=1.0)]


class HandlerResult(_Model):
    """What a handler returns: the reply and the writes it asks for."""

    text: str
    memories: list[tuple[str, Importance]] = Field(default_factory=list)  # (text, importance in (0, 1])
    profile: dict[str, str] = Field(default_factory=dict)


class Slots(_Model):
    busy: NonNegativeInt
    total: NonNegativeInt
    queue_depth: NonNegativeInt = 0


class Counters(_Model):
    turns: NonNegativeInt = 0
    errors: NonNegativeInt = 0
    handler_seconds: NonNegativeFloat = 0.0


class TurnHistogram(_Model):
    """Observations of one duration since the worker started: a count per bucket of
    ``protocol.metrics_buckets.TURN_BUCKETS`` (not cumulative across buckets; the last one is
    over the top bound) and their sum. No counts at all: nothing observed yet."""

    counts: tuple[NonNegativeInt, ...] = ()
    sum: NonNegativeFloat = 0.0

    @field_validator("counts")
    @classmethod
    def _one_per_bucket(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if v and len(v) != BUCKET_COUNT:
            raise ValueError(f"expected {BUCKET_COUNT} bucket counts, got {len(v)}")
        return v

    @property
    def count(self) -> int:
        return sum(self.counts)


# What a Redis error is, as ``stores.redis_errors.error_kind`` tells it: the error reply's code
# (BUSY, NOPERM, READONLY, ...; NOSCRIPT also for a missing function or library), a
# connection or timeout error, or ``other``. The label of ``fleet_*_redis_errors_total``.
RedisErrorKind = Literal["busy", "noperm", "readonly", "masterdown", "loading", "noscript", "tryagain",
                         "clusterdown", "moved", "connection", "timeout", "other"]
REDIS_ERROR_KINDS: tuple[RedisErrorKind, ...] = (
    "busy", "noperm", "readonly", "masterdown", "loading", "noscript", "tryagain", "clusterdown", "moved",
    "connection", "timeout", "other")


class TurnStats(_Model):
    """A worker's turn counts, cumulative since it started (they only grow while it lives).

    Results: ``ok`` answered, ``error`` answered with an error (dead-lettered), ``dup`` found
    answered already, ``stale`` a commit that found the entry committed, ``expired`` answered
    as reached after its deadline, ``cancelled`` answered as stopped by its user (neither
    dead-lettered: both are normal ends of a turn). ``retries``: handler
    calls of an attempt after the first; ``dead_letters``: entries it wrote to the dead
    letters (turns and bad notifications); ``fenced``: lanes it lost to another worker (a
    fenced write, or a renewal that found the lane gone); ``delivery_limit``: notifications it
    dead-lettered and acked at the tier's ``max_deliveries`` (among its ``dead_letters``).
    Histograms: ``queue_wait`` submit to the first attempt's handler start, ``handler`` every
    handler call, ``latency`` submit to the commit of the reply. ``redis_errors``: the errors
    Redis answered it, by kind (every loop's, not only its turns').
    """

    ok: NonNegativeInt = 0
    error: NonNegativeInt = 0
    dup: NonNegativeInt = 0
    stale: NonNegativeInt = 0
    expired: NonNegativeInt = 0
    cancelled: NonNegativeInt = 0
    retries: NonNegativeInt = 0
    dead_letters: NonNegativeInt = 0
    fenced: NonNegativeInt = 0
    delivery_limit: NonNegativeInt = 0
    queue_wait: TurnHistogram = TurnHistogram()
    handler: TurnHistogram = TurnHistogram()
    latency: TurnHistogram = TurnHistogram()
    # (a factory: a plain ``{}`` default is deep-copied by pydantic on every report without one)
    redis_errors: dict[RedisErrorKind, NonNegativeInt] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _without_zeros(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Zero counts and empty histograms stay off the wire (every report carries these):
        they are the defaults, so they decode the same."""
        body: dict[str, Any] = handler(self)
        fields = type(self).model_fields
        return {k: v for k, v in body.items()
                if getattr(self, k) != fields[k].get_default(call_default_factory=True)}


TURN_RESULTS = ("ok", "error", "dup", "stale", "expired", "cancelled")  # the result fields of TurnStats
TURN_COUNTERS = ("retries", "dead_letters", "fenced", "delivery_limit")  # its other counters
TURN_HISTOGRAMS = ("queue_wait", "handler", "latency")  # and its histograms


class OccupancyReport(_Model):
    """Raw quantities a worker reports every ``report_interval``. No judgement."""

    worker: str
    tier: str
    ts: float
    state: WorkerState
    users: NonNegativeInt
    active_users: NonNegativeInt
    slots: Slots
    cpu: float | None = None
    rss: NonNegativeInt
    counters: Counters
    load: tuple[float, float, float]
    turn_stats: TurnStats = Field(default_factory=TurnStats)  # absent from older workers' reports
    # a handler's scale-in protection (TurnContext.protect): not to be retired before this time
    protected_until: float | None = None


class Control(_Model):
    """A command on a worker's control stream: ``drain`` (with its ``reason``), or ``cancel``
    the turn ``turn_id`` of ``user`` (inbox entry ``entry``) if it runs there (``Fleet.cancel``)."""

    kind: Literal["drain", "cancel"]
    ts: float
    reason: str = ""
    user: str = ""
    turn_id: str = ""
    entry: str = ""

    @model_validator(mode="after")
    def _names_its_turn(self) -> Control:
        if self.kind == "cancel":
            validate_user_id(self.user)
            validate_token(self.turn_id, "turn id")
            if not _ENTRY_ID.fullmatch(self.entry):
                raise ValueError(f"not a stream entry id: {self.entry[:40]!r}")
        return self

    @model_serializer(mode="wrap")
    def _without_empty(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The fields a command does not use stay off the wire: a drain reads as it always did."""
        body: dict[str, Any] = handler(self)
        return {k: v for k, v in body.items() if not (k in ("user", "turn_id", "entry") and not v)}


class LedgerEvent(_Model):
    """One entry of the scaling ledger ``fleet:events``: what changed, and why (or why not)."""

    ts: float
    tier: str
    epoch: int
    commander: str
    action: Literal["scale-up", "scale-down", "reclaim-idle", "consolidate", "recycle", "policy-rejected",
                    "policy-applied", "leader", "worker-exited", "hold", "renotified",
                    # the runtime would not act (kubernetes: an HPA or a ScaledObject owns the
                    # Deployment, or no single Deployment is the tier's); a worker waited for a
                    # place to run past the policy's pending_timeout_s; the runtime removed
                    # another worker than the victim named (a Pending pod goes first)
                    "refused", "no-capacity", "substituted",
                    # groups (protocol.groups): the weights changed (``fleet rollout``, a policy
                    # edit); the rollout guard set the canary's weight to 0; a group's interpreter
                    # cannot run its handler / can again; a pool no group of the policy names
                    "rollout", "rollout-abort", "group-rejected", "group-accepted", "group-removed",
                    # kubernetes: the runtime made a group's Deployment from a copy of its tier's;
                    # deleted it once the group was gone for good; could not delete it
                    "deployment-created", "deployment-deleted", "deployment-kept",
                    # process: a live process a run record or a registry entry names does not
                    # carry this host's spawn proof: not adopted, never signalled
                    "unproven-process",
                    # an operator erased a user's data (`fleet user delete`): who and which user
                    "user-deleted"]
    from_count: int = 0
    to_count: int = 0
    victims: list[str] = Field(default_factory=list)
    spawned: list[str] = Field(default_factory=list)
    reason: str = ""
    why: dict[str, Any] = Field(default_factory=dict)


class CommanderInfo(_Model):
    """A commander process's entry in ``fleet:commanders``."""

    commander: str
    pid: int
    host: str
    started: float
    role: Literal["leader", "standby"] = "standby"
    epoch: int = 0
    metrics: str = ""  # the address of its /metrics, if served
    seen: float = 0.0  # when it last wrote this entry (every pass, or every standby poll)
    crash_loop: dict[str, str] = {}  # pools whose workers keep exiting at start -> the last error

    @model_serializer(mode="wrap")
    def _without_empty_loops(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``crash_loop`` stays off the wire when empty: readers that predate it still decode."""
        body: dict[str, Any] = handler(self)
        return {k: v for k, v in body.items() if not (k == "crash_loop" and not v)}


RENEW_INTERVAL_S = 1.5  # the workers' default seconds between renewals (lanes, claims, heartbeat)
EXIT_STUCK = 70  # a worker's exit code when its event loop was stuck (``worker.watchdog``)


def exit_meaning(code: int | None) -> str:
    """How a worker's exit code reads in a log line or a ledger entry: "code 70 (its event loop
    was stuck)", "code 1"; "an unknown code" for None."""
    if code is None:
        return "an unknown code"
    return f"code {code} (its event loop was stuck)" if code == EXIT_STUCK else f"code {code}"



class WorkerInfo(_Model):
    """A worker's entry in the registry ``fleet:workers``."""

    worker: str
    tier: str
    pid: int
    host: str
    started: float
    runtime: str = "process"
    handlers: list[str] = []  # the handler names it can load (policy set warns if none has one)
    handler_errors: dict[str, str] = {}  # handlers whose entry point failed to load: name -> error
    renew_interval_s: float = RENEW_INTERVAL_S  # how often it claims its jobs' notifications again
    pod: str | None = None  # in Kubernetes: its pod's name (the worker id, unless one was given)
    node: str | None = None  # ... and the node it runs on (also its ``host``)

    @model_serializer(mode="wrap")
    def _without_placement(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``pod`` and ``node`` stay off the wire when unset, and ``handler_errors`` when empty: a
        process worker's entry is the same as before they existed, so readers that predate them
        still decode it."""
        body: dict[str, Any] = handler(self)
        return {k: v for k, v in body.items()
                if not (k in ("pod", "node") and v is None) and not (k == "handler_errors" and not v)}
