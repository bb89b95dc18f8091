"""What a Redis error is (``error_kind``), and how a process tells of them (``RedisErrors``).

Every loop of every Fleet process retries the errors of ``stores.retry.TRANSIENT`` — Redis
away, or answering an error reply — with its backoff, and tells ``RedisErrors`` of each failure
and of each success. An error reply is never a reason to exit: ``BUSY`` (a script running too
long), ``NOPERM`` (an ACL refuses a command), ``READONLY`` (a replica, after a failover),
``MASTERDOWN``, ``LOADING``, ``NOSCRIPT`` (or a missing function or library), a Cluster in
motion, or any other, all mend with time or an operator's hand, and the work waits for them:
a turn whose step failed stays in its inbox with its notification pending, and is retried by
the normal path (its lane's renewal, the reclaim, the commander's takeover).

``RedisErrors`` logs a kind once when it starts (a WARNING naming where and the error), counts
every occurrence (``counts``, and ``counted`` for a Prometheus counter), and logs once when
every loop that met it has succeeded again ("Redis answers again after 12 s of BUSY"): a
Redis refusing for an hour writes two lines, not one per retry.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoPermissionError,
    NoScriptError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.models import RedisErrorKind

# the most specific first: redis-py's LOADING is a ConnectionError, MASTERDOWN a CLUSTERDOWN
_BY_CLASS: tuple[tuple[type[BaseException], RedisErrorKind], ...] = (
    (BusyLoadingError, "loading"), (NoPermissionError, "noperm"), (ReadOnlyError, "readonly"),
    (MasterDownError, "masterdown"), (NoScriptError, "noscript"), (TryAgainError, "tryagain"),
    (ClusterDownError, "clusterdown"), (AskError, "moved"),  # (MOVED is an AskError)
    (RedisTimeoutError, "timeout"), (TimeoutError, "timeout"),
    (RedisConnectionError, "connection"), (OSError, "connection"),
    (RedisClusterException, "clusterdown"),  # no node for a slot: the cluster is between topologies
)
_BY_CODE: dict[str, RedisErrorKind] = {
    "BUSY": "busy", "NOPERM": "noperm", "READONLY": "readonly", "MASTERDOWN": "masterdown",
    "LOADING": "loading", "NOSCRIPT": "noscript", "TRYAGAIN": "tryagain", "CLUSTERDOWN": "clusterdown",
    "MOVED": "moved", "ASK": "moved"}
# a pipeline's error says which command failed before the reply: "... caused error: BUSY ..."
_CODE = re.compile(r"(?:^|caused error: )([A-Z]+) ")
_MISSING_CODE = re.compile(r"\b(function|library)\b.*\bnot found\b", re.IGNORECASE)


def error_kind(exc: BaseException) -> RedisErrorKind:
    """The kind of a Redis, network or Cluster error (``other`` for one not known here)."""
    for cls, kind in _BY_CLASS:
        if isinstance(exc, cls):
            return kind
    text = str(exc)
    code = getattr(exc, "status_code", None)  # redis-py >= 8: the reply's first word
    if not isinstance(code, str):
        found = _CODE.search(text)
        code = found.group(1) if found else ""
    if code in _BY_CODE:
        return _BY_CODE[code]
    if _MISSING_CODE.search(text):  # "ERR Function not found", "ERR Library 'x' not found"
        return "noscript"
    return "other"


class RedisErrors:
    """One process's Redis errors: each kind logged once until it clears, every one counted.

    ``failed(where, exc)`` after a loop's Redis step failed, ``answered(where)`` after it
    succeeded (cheap when nothing failed). ``where`` names the loop. Thread-safe: the commander
    calls it from its loop and its monitor's threads."""

    def __init__(self, log: logging.Logger, counted: Callable[[RedisErrorKind], None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.log = log
        self.counts: dict[RedisErrorKind, int] = {}
        self._counted = counted
        self._clock = clock if clock is not None else time.monotonic  # (the simulator's, in a simulation)
        self._lock = threading.Lock()
        self._open: dict[RedisErrorKind, tuple[float, set[str]]] = {}  # kind -> (since, loops meeting it)

    def failed(self, where: str, exc: BaseException) -> RedisErrorKind:
        """Count ``exc`` (met by the loop ``where``); log its kind if it is new. Its kind."""
        kind = error_kind(exc)
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            new = kind not in self._open
            if new:
                self._open[kind] = (self._clock(), set())
            self._open[kind][1].add(where)
        if self._counted is not None:
            self._counted(kind)
        if new:
            said = " ".join(str(exc).split())[:300]
            self.log.warning("Redis error %s (%s: %s: %s); backing off and retrying, logged again when "
                             "it clears", kind.upper(), where, type(exc).__name__, said)
        return kind

    def answered(self, where: str) -> None:
        """The loop ``where`` reached Redis: a kind no loop meets any longer is over (logged)."""
        if not self._open:
            return
        over: list[tuple[RedisErrorKind, float]] = []
        with self._lock:
            for kind, (since, loops) in list(self._open.items()):
                loops.discard(where)
                if not loops:
                    del self._open[kind]
                    over.append((kind, since))
        for kind, since in over:
            self.log.info("Redis answers again after %.0f s of %s", self._clock() - since, kind.upper())
