"""Hard traffic, generated and seeded: the shapes an autoscaler is judged on beyond one trace.

Every kind is a (possibly modulated) Poisson process of requests with LLM-like lengths, so the
token service model of ``sim.scaling.trace`` turns it into turns like the Azure trace's (mean
call about 5.5 s). A seed fixes every arrival and length (``random.Random(f"{kind}-{seed}")``).

- ``mmpp``: on/off bursts, a two-state Markov-modulated Poisson process: 2/s off, 12/s on;
  off periods exponential with mean 180 s, on periods with mean 45 s;
- ``diurnal``: a day compressed into the run, ``0.5 + 8.5 (1 - cos(2 pi t / T)) / 2``: from a
  night of 0.5/s to a peak of 9/s at half time and back;
- ``flash``: 3/s, and at a third of the run a flash crowd: x10 (30/s) within one second, held
  120 s, then back to 3/s exponentially (time constant 60 s);
- ``leak``: a slow leak, from 1/s rising linearly to 9/s at the end, by about 0.13/s a minute
  (small enough to hide inside a tolerance band);
- ``heavy``: a steady 7/s with heavy-tailed lengths: output tokens Pareto (alpha 1.2, at least
  30, at most 8,000), so a few turns run minutes.

Lengths (all kinds): input tokens log-normal (median 800, sigma 0.9, 1..16,000); output tokens
log-normal (median 150, sigma 0.8, 1..2,000), or the Pareto of ``heavy``. Non-homogeneous
rates are drawn by thinning (Lewis and Shedler) against the kind's highest rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from datetime import UTC, datetime

from sim.scaling.trace import Request
from sim.scaling.tracefile import Trace

KINDS = ("mmpp", "diurnal", "flash", "leak", "heavy")
DEFAULT_START = datetime(2024, 1, 8, 0, 0, tzinfo=UTC).timestamp()  # a Monday, 00:00 UTC
RateFn = Callable[[float], float]


def _diurnal(duration: float) -> tuple[RateFn, float]:
    def rate(t: float) -> float:
        return 0.5 + 8.5 * (1.0 - math.cos(2.0 * math.pi * t / duration)) / 2.0
    return rate, 9.0


def _flash(duration: float) -> tuple[RateFn, float]:
    at, hold, tau, base, peak = duration / 3.0, 120.0, 60.0, 3.0, 30.0

    def rate(t: float) -> float:
        if t < at:
            return base
        if t < at + 1.0:
            return base + (peak - base) * (t - at)  # x10 within one second
        if t < at + 1.0 + hold:
            return peak
        return base + (peak - base) * math.exp(-(t - at - 1.0 - hold) / tau)
    return rate, peak


def _leak(duration: float) -> tuple[RateFn, float]:
    def rate(t: float) -> float:
        return 1.0 + 8.0 * t / duration
    return rate, 9.0


def _steady(value: float) -> tuple[RateFn, float]:
    return (lambda t: value), value


def _thinned(rng: random.Random, rate: RateFn, peak: float, duration: float) -> list[float]:
    """Arrival offsets of a Poisson process of intensity ``rate(t) <= peak`` on [0, duration)."""
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() * peak < rate(t):
            out.append(t)


def _mmpp(rng: random.Random, duration: float) -> list[float]:
    """On/off bursts: exponential sojourns, a homogeneous Poisson process within each."""
    out: list[float] = []
    t, on = 0.0, False
    while t < duration:
        stay = rng.expovariate(1.0 / (45.0 if on else 180.0))
        end, rate = min(duration, t + stay), 12.0 if on else 2.0
        at = t
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                break
            out.append(at)
        t, on = end, not on
    return out


def _lognormal_int(rng: random.Random, median: float, sigma: float, high: int) -> int:
    return max(1, min(high, int(round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


def _pareto_int(rng: random.Random, low: float, alpha: float, high: int) -> int:
    return max(1, min(high, int(low / (1.0 - rng.random()) ** (1.0 / alpha))))


def arrivals(kind: str, rng: random.Random, duration: float) -> list[float]:
    """The arrival offsets of one kind (see the table above)."""
    if kind == "mmpp":
        return _mmpp(rng, duration)
    shapes: dict[str, tuple[RateFn, float]] = {
        "diurnal": _diurnal(duration), "flash": _flash(duration), "leak": _leak(duration),
        "heavy": _steady(7.0)}
    if kind not in shapes:
        raise ValueError(f"unknown traffic kind {kind!r} (kinds: {', '.join(KINDS)})")
    rate, peak = shapes[kind]
    return _thinned(rng, rate, peak, duration)


def generate(kind: str, seed: int = 7, duration_s: float = 3600.0, start: float = DEFAULT_START) -> Trace:
    """A seeded trace of ``kind`` lasting ``duration_s``, its first second at ``start`` (unix)."""
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    rng = random.Random(f"{kind}-{seed}")
    offsets = arrivals(kind, rng, duration_s)
    requests = []
    for t in offsets:
        context = _lognormal_int(rng, 800.0, 0.9, 16_000)
        generated = _pareto_int(rng, 30.0, 1.2, 8_000) if kind == "heavy" \
            else _lognormal_int(rng, 150.0, 0.8, 2_000)
        requests.append(Request(start + t, context, generated))
    how = f"generated: {kind}, seed {seed}, {duration_s:g} s"
    return Trace(f"gen-{kind}-s{seed}", requests, True, how)


def parse_generated(spec: str) -> tuple[str, int, float | None]:
    """``gen:KIND[:SEED[:DURATION_S]]`` -> (kind, seed, duration or None)."""
    parts = spec.split(":")
    if parts[0] != "gen" or len(parts) < 2 or len(parts) > 4 or parts[1] not in KINDS:
        raise ValueError(f"{spec!r}: expected gen:KIND[:SEED[:DURATION_S]] with KIND one of "
                         f"{', '.join(KINDS)}")
    try:
        seed = int(parts[2]) if len(parts) > 2 else 7
        duration = float(parts[3]) if len(parts) > 3 else None
    except ValueError:
        raise ValueError(f"{spec!r}: the seed is an integer, the duration a number") from None
    return parts[1], seed, duration


def write_csv(trace: Trace, path: str) -> None:
    """The trace in the Azure layout (``TIMESTAMP`` ISO UTC, ``ContextTokens``, ``GeneratedTokens``)."""
    with open(path, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for r in trace.requests:
            stamp = datetime.fromtimestamp(r.ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            f.write(f"{stamp},{r.context_tokens},{r.generated_tokens}\n")
