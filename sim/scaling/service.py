"""Service-time models: how long a turn's handler (the model call) runs, in seconds.

- ``tokens`` (the default): ``overhead_ms + in / prefill_tokens_per_ms + out * decode_ms_per_token``,
  times ``service_scale``, from the request's lengths (``sim.scaling.trace.service_ms``);
- ``const:S``: every turn ``S`` seconds;
- ``lognormal:MEDIAN,SIGMA[,CAP]``: ``MEDIAN * exp(SIGMA * N(0, 1))`` seconds, at most ``CAP``;
- ``pareto:MIN,ALPHA[,CAP]``: ``MIN / U^(1/ALPHA)`` seconds (heavy-tailed: infinite variance
  for ``ALPHA <= 2``), at most ``CAP``.

The random ones draw from their own ``random.Random`` seeded from the trace model's seed, in
request order, so a seed fixes every service time. ``service_scale`` multiplies all of them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

ServiceKind = Literal["tokens", "const", "lognormal", "pareto"]
_ARITY = {"tokens": (0, 0), "const": (1, 1), "lognormal": (2, 3), "pareto": (2, 3)}


@dataclass(frozen=True)
class ServiceModel:
    """One of the models above with its numbers (``a``, ``b``, ``cap_s``)."""

    kind: ServiceKind = "tokens"
    a: float = 0.0  # const: seconds; lognormal: median s; pareto: minimum s
    b: float = 0.0  # lognormal: sigma; pareto: alpha
    cap_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind == "const" and self.a <= 0:
            raise ValueError("const:S needs S > 0")
        if self.kind in ("lognormal", "pareto") and (self.a <= 0 or self.b <= 0):
            raise ValueError(f"{self.kind} needs two positive numbers")
        if self.cap_s is not None and self.cap_s <= 0:
            raise ValueError("the cap must be positive")

    @property
    def needs_lengths(self) -> bool:
        """Whether it reads the requests' input and output lengths."""
        return self.kind == "tokens"

    def spec(self) -> str:
        """The model as written on the command line."""
        if self.kind == "tokens":
            return "tokens"
        nums = [self.a] if self.kind == "const" else [self.a, self.b]
        if self.cap_s is not None:
            nums.append(self.cap_s)
        return f"{self.kind}:" + ",".join(f"{n:g}" for n in nums)

    def draw_s(self, rng: random.Random) -> float:
        """One service time of a random or constant model (not ``tokens``)."""
        if self.kind == "const":
            value = self.a
        elif self.kind == "lognormal":
            value = self.a * math.exp(self.b * rng.gauss(0.0, 1.0))
        elif self.kind == "pareto":
            value = self.a / (1.0 - rng.random()) ** (1.0 / self.b)
        else:
            raise ValueError("the tokens model reads lengths; it draws nothing")
        return value if self.cap_s is None else min(value, self.cap_s)


def parse_service(text: str) -> ServiceModel:
    """``tokens``, ``const:2``, ``lognormal:2,1.2``, ``pareto:0.5,1.5,600`` -> ``ServiceModel``."""
    kind, _, rest = text.strip().partition(":")
    if kind not in _ARITY:
        raise ValueError(f"{text!r}: a service model is one of {', '.join(_ARITY)}")
    try:
        nums = [float(x) for x in rest.split(",")] if rest else []
    except ValueError:
        raise ValueError(f"{text!r}: the numbers after ':' do not parse") from None
    low, high = _ARITY[kind]
    if not low <= len(nums) <= high:
        raise ValueError(f"{text!r}: {kind} takes {low}..{high} numbers")
    cap = nums[2] if len(nums) == 3 else None
    return ServiceModel(kind, nums[0] if nums else 0.0, nums[1] if len(nums) > 1 else 0.0, cap)  # type: ignore[arg-type]
