"""The trace model shared by ``fleet replay`` and the simulator: requests -> users' turns.

Most published traces (the Azure LLM conversation trace: ``TIMESTAMP, ContextTokens,
GeneratedTokens``) have no user or conversation id and no service time. This module derives
both, deterministically (seeded); reading other formats is ``sim.scaling.tracefile``'s job.

**Users.** Requests are taken in time order. A conversation has a geometric number of turns
(``P(n) = p (1-p)^(n-1)``, ``p = 1 / mean_turns``, mean 3.5 by default). After one of its
turns arrives at ``t`` with service time ``s``, the conversation waits for its user to read
the reply and think: it becomes *eligible* at ``t + s + think``, ``think = think_min_s +
Exp(mean think_mean_s - think_min_s)`` (20 s mean, 2 s minimum). Each request of the trace
goes to the conversation that has been eligible the longest; when none is eligible, it opens
a new conversation. One conversation is one user (``u000042``). So the trace's arrival times
are kept exactly; a user's turns are in order and never overlap unless the fleet's wait is
longer than the think time. A trace that names its users (a ``user`` column) keeps them: the
think-time model is not used, and a user's turns may then arrive while one is in service.

**Service time** (the stand-in model call, slept by the ``sleep`` handler)::

    service_ms = service_scale * (overhead_ms + ContextTokens / prefill_tokens_per_ms
                                  + GeneratedTokens * decode_ms_per_token)

with 50 ms overhead, prefill at 5 tokens/ms and decode at 25 ms/token (an A100-class
70B model, as in the Splitwise paper that published the trace). The trace's means (1,155
context, 211 generated tokens) give a mean call of about 5.6 s; ``service_scale`` scales it.
``TraceModel.service`` picks another model (``sim.scaling.service``: constant, log-normal,
Pareto), for traces without lengths or to try heavy tails.

**Speed-up.** ``speed_up(turns, k)`` divides arrival and service times by ``k``, the same
for the replay and for the simulator it is compared with.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from sim.scaling.service import ServiceModel

__all__ = ["Request", "TraceModel", "TraceTurn", "assign_users", "load_turns", "read_trace",
           "service_ms", "service_times", "speed_up", "window"]


@dataclass(frozen=True, slots=True)
class Request:
    """One row of the trace; ``ts`` is unix seconds (UTC)."""

    ts: float
    context_tokens: int
    generated_tokens: int
    user: str | None = None  # when the trace names its users


@dataclass(frozen=True, slots=True)
class TraceTurn:
    """One turn of one user: ``at`` seconds after the trace (or slice) start, ``service_s`` long."""

    index: int  # position in time order, 0-based, within its list
    at: float
    user: str
    turn: int  # 0-based position in its conversation
    service_s: float
    context_tokens: int = 0
    generated_tokens: int = 0


@dataclass(frozen=True)
class TraceModel:
    """The constants that turn requests into users' turns (see the module docstring)."""

    mean_turns: float = 3.5
    think_mean_s: float = 20.0
    think_min_s: float = 2.0
    overhead_ms: float = 50.0
    prefill_tokens_per_ms: float = 5.0
    decode_ms_per_token: float = 25.0
    service_scale: float = 1.0
    seed: int = 7
    service: ServiceModel = field(default_factory=ServiceModel)

    def __post_init__(self) -> None:
        if self.mean_turns < 1:
            raise ValueError("mean_turns must be >= 1")
        if self.think_min_s < 0 or self.think_mean_s < self.think_min_s:
            raise ValueError("need 0 <= think_min_s <= think_mean_s")
        if self.service_scale <= 0 or self.prefill_tokens_per_ms <= 0 or self.decode_ms_per_token < 0:
            raise ValueError("service constants must be positive")


def read_trace(path: str | Path) -> list[Request]:
    """The requests of a trace file, sorted by time, its columns found by their usual names
    (``sim.scaling.tracefile`` reads any other layout). Raises ``ValueError`` on a bad row."""
    from sim.scaling.tracefile import TraceSource, read_trace_file  # (it imports Request from here)

    return read_trace_file(TraceSource(Path(path))).requests


def service_ms(context_tokens: int, generated_tokens: int, model: TraceModel) -> float:
    """The stand-in model call's duration in ms by the token formula (always > 0)."""
    raw = (model.overhead_ms + max(0, context_tokens) / model.prefill_tokens_per_ms
           + max(0, generated_tokens) * model.decode_ms_per_token)
    return max(1.0, model.service_scale * raw)


def service_times(requests: Sequence[Request], model: TraceModel) -> list[float]:
    """Every request's service time in seconds, by ``model.service`` (seeded, in order)."""
    if model.service.needs_lengths:
        return [service_ms(r.context_tokens, r.generated_tokens, model) / 1000.0 for r in requests]
    rng = random.Random(f"service-{model.seed}")
    return [max(0.001, model.service_scale * model.service.draw_s(rng)) for _ in requests]


def _turns_in_conversation(rng: random.Random, mean_turns: float) -> int:
    if mean_turns <= 1:
        return 1
    p = 1.0 / mean_turns
    u = 1.0 - rng.random()  # (0, 1]
    return 1 + int(math.log(u) / math.log(1.0 - p))


def _think_s(rng: random.Random, model: TraceModel) -> float:
    extra = model.think_mean_s - model.think_min_s
    return model.think_min_s + (rng.expovariate(1.0 / extra) if extra > 0 else 0.0)


def assign_users(requests: Sequence[Request], model: TraceModel | None = None) -> list[TraceTurn]:
    """Give every request a user and a turn number (see the module docstring); ``at`` is
    relative to the first request."""
    model = model or TraceModel()
    rng = random.Random(model.seed)
    if not requests:
        return []
    services = service_times(requests, model)
    if all(r.user is not None for r in requests):
        return _named_users(requests, services)
    t0 = requests[0].ts
    waiting: list[tuple[float, int]] = []  # (eligible at, conversation) heap
    left: dict[int, int] = {}  # conversation -> turns still to come
    done: dict[int, int] = {}  # conversation -> turns so far
    turns = []
    for i, req in enumerate(requests):
        at = req.ts - t0
        if waiting and waiting[0][0] <= at:
            _, conv = heapq.heappop(waiting)
        else:
            conv = len(done)
            left[conv], done[conv] = _turns_in_conversation(rng, model.mean_turns), 0
        service = services[i]
        turns.append(TraceTurn(i, at, f"u{conv:06d}", done[conv], service, req.context_tokens,
                               req.generated_tokens))
        done[conv] += 1
        left[conv] -= 1
        if left[conv] > 0:
            heapq.heappush(waiting, (at + service + _think_s(rng, model), conv))
    return turns


def _named_users(requests: Sequence[Request], services: list[float]) -> list[TraceTurn]:
    """Turns of a trace that names its users: its users, numbered in arrival order."""
    t0, seen = requests[0].ts, dict[str, int]()
    out = []
    for i, (req, service) in enumerate(zip(requests, services, strict=True)):
        user = str(req.user)
        n = seen.get(user, 0)
        seen[user] = n + 1
        out.append(TraceTurn(i, req.ts - t0, user, n, service, req.context_tokens, req.generated_tokens))
    return out


def window(turns: Iterable[TraceTurn], start: float = 0.0, duration: float | None = None,
           limit: int | None = None) -> list[TraceTurn]:
    """Turns arriving in ``[start, start + duration)``, at most ``limit``, re-timed from ``start``
    and re-indexed from 0."""
    end = math.inf if duration is None else start + duration
    picked = [t for t in turns if start <= t.at < end]
    if limit is not None:
        picked = picked[:max(0, limit)]
    return [replace(t, index=i, at=t.at - start) for i, t in enumerate(picked)]


def speed_up(turns: Iterable[TraceTurn], k: float) -> list[TraceTurn]:
    """Arrivals and service times divided by ``k`` (k > 1 replays faster than real time)."""
    if k <= 0:
        raise ValueError("speed must be positive")
    return [replace(t, at=t.at / k, service_s=t.service_s / k) for t in turns]


def load_turns(path: str | Path, model: TraceModel | None = None, start: float = 0.0,
               duration: float | None = None, limit: int | None = None) -> list[TraceTurn]:
    """Read the trace, assign users over the whole of it, then cut the slice."""
    return window(assign_users(read_trace(path), model), start, duration, limit)
