"""The worker's turn counts since it started, as its occupancy reports carry them: the
cumulative ``counters`` (turns, errors, handler seconds: the commander's rates) and the
``turn_stats`` (``protocol.models.TurnStats``: results, retries, dead letters, lost lanes and
three duration histograms). The commander adds every worker's stats into ``/metrics``
(``commander.turn_metrics``): workers come and go and may not be reachable by a scraper, and
the commander reads every report anyway. No clock here: the job passes the durations."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from protocol.metrics_buckets import BUCKET_COUNT, bucket_of
from protocol.models import Counters, RedisErrorKind, TurnHistogram, TurnStats

Result = Literal["ok", "error", "dup", "stale", "expired", "cancelled"]
Duration = Literal["queue_wait", "handler", "latency"]


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * BUCKET_COUNT
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)  # a submitter's clock ahead of ours: no negative wait
        self.counts[bucket_of(seconds)] += 1
        self.sum += seconds

    def frozen(self) -> TurnHistogram:
        if not any(self.counts):
            return TurnHistogram()  # nothing observed: no counts on the wire
        return TurnHistogram(counts=tuple(self.counts), sum=self.sum)


class TurnTally:
    """Cumulative turn counts of one worker; ``counters()`` and ``stats()`` are what its next
    report carries."""

    def __init__(self, redis_errors: Mapping[RedisErrorKind, int] | None = None) -> None:
        self.redis_errors = redis_errors if redis_errors is not None else {}  # live: stats() copies it
        self.turns = 0  # turns served here (answered or rejected)
        self.errors = 0  # failed handler attempts and rejected turns
        self.handler_seconds = 0.0  # of handler calls that ended
        self.results: dict[Result, int] = {"ok": 0, "error": 0, "dup": 0, "stale": 0, "expired": 0,
                                           "cancelled": 0}
        self.retries = 0
        self.dead_letters = 0
        self.delivery_limit = 0  # notifications dead-lettered and acked at max_deliveries
        self.fenced = 0
        self.durations: dict[Duration, _Histogram] = {
            "queue_wait": _Histogram(), "handler": _Histogram(), "latency": _Histogram()}

    def served(self, result: Result) -> None:
        """A turn this worker committed, by what the commit found."""
        self.results[result] += 1

    def observe(self, duration: Duration, seconds: float) -> None:
        """One observation of a duration."""
        self.durations[duration].observe(seconds)

    def counters(self, running_s: float = 0.0) -> Counters:
        """The counters, with ``running_s`` handler seconds of turns still running.

        Counting a turn's time only when it ends would put a long turn's seconds all in one
        report interval; counted as it runs, the delta between two reports is the exact
        time-averaged slot use in between."""
        return Counters(turns=self.turns, errors=self.errors,
                        handler_seconds=self.handler_seconds + running_s)

    def stats(self) -> TurnStats:
        """The counts so far, for a report."""
        res, h = self.results, self.durations
        return TurnStats(ok=res["ok"], error=res["error"], dup=res["dup"], stale=res["stale"],
                         expired=res["expired"], cancelled=res["cancelled"],
                         retries=self.retries, dead_letters=self.dead_letters, fenced=self.fenced,
                         delivery_limit=self.delivery_limit,
                         queue_wait=h["queue_wait"].frozen(), handler=h["handler"].frozen(),
                         latency=h["latency"].frozen(), redis_errors=dict(self.redis_errors))
