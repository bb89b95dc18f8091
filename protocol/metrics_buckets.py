"""The bucket bounds of the turn histograms a worker reports (queue wait, handler, end-to-end).

Defined once here, so that every worker's bucket counts line up and the commander can add
them: a report carries one count per bucket (not cumulative across buckets), the last one
for values over the top bound (Prometheus' ``+Inf``). The bounds are part of the wire
contract: changing them needs a new ``PROTOCOL_VERSION``, since a report whose counts do not
have ``len(TURN_BUCKETS) + 1`` entries does not validate.
"""

from __future__ import annotations

from bisect import bisect_left

# seconds: from a fast handler's 5 ms to a minute in the queue
TURN_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BUCKET_COUNT = len(TURN_BUCKETS) + 1  # the counts per histogram: the bounds and the overflow


def bucket_of(seconds: float, bounds: tuple[float, ...] = TURN_BUCKETS) -> int:
    """The index of the bucket ``seconds`` falls in: the first bound it does not exceed
    (Prometheus' ``le``), or ``len(bounds)`` above the top one."""
    return bisect_left(bounds, seconds)
