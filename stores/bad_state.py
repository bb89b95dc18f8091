"""Bad entries in shared state: what a reader skipped, and why.

Redis is shared and may hold anything: a member no tier can have in ``fleet:tiers``, a registry
entry whose ids fail validation, a hash where a string is expected (``WRONGTYPE``), JSON that
is not. A reader skips such an entry and tells a :class:`BadState` of it (:meth:`BadState.note`),
which warns once per entry (its kind, key and member), counts every meeting (``counted``: the
commander's ``fleet_state_errors_total{kind}``) and keeps the entries it met, so ``fleet status``
can name them. A process never exits because of one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from redis.exceptions import ResponseError

# what the entry is: a member of the tier set, a registry entry, a commander's entry, a policy
# key, an occupancy report, a user's pin, a tier's saved decide state, a tier's pool set; and a
# tier's pass (or a whole pass) that raised on what it read
BadKind = Literal["tier", "registry", "commander", "policy", "report", "pin", "decide_state", "pool",
                  "pressure", "tier_pass", "pass"]
REMEMBERED = 1024  # entries kept (warned about) at most: random garbage cannot grow a process


@dataclass(frozen=True)
class BadEntry:
    """One bad entry: its kind, its key (for ``tier_pass`` the tier, for ``pass`` "pass"), the
    member (hash field, set member, stream entry id, the error's type; empty for the whole key)
    and why it was skipped."""

    kind: BadKind
    key: str
    member: str = ""
    reason: str = ""

    def as_json(self) -> dict[str, Any]:
        """Plain data (``fleet status --json``)."""
        return asdict(self)


class BadState:
    """The bad entries one process (or one reading, as ``fleet status``) met: each warned about
    once, every meeting counted. Thread-safe (the commander's monitor reads from threads)."""

    def __init__(self, log: logging.Logger | None = None,
                 counted: Callable[[BadKind], None] | None = None) -> None:
        self.log = log
        self.counted = counted
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str, str], BadEntry] = {}  # oldest first

    def note(self, kind: BadKind, key: str, member: object = "", reason: object = "",
             exc_info: BaseException | None = None) -> None:
        """An entry was skipped: warn if it is new, count it."""
        entry = BadEntry(kind, key, shown(member), shown(reason, 300))
        ident = (kind, key, entry.member)
        with self._lock:
            new = ident not in self._seen
            self._seen.pop(ident, None)
            self._seen[ident] = entry
            while len(self._seen) > REMEMBERED:
                del self._seen[next(iter(self._seen))]
        if self.counted is not None:
            self.counted(kind)
        if new and self.log is not None:
            where = f"{key} {entry.member!r}" if entry.member else key
            self.log.warning("skipped a bad %s entry (%s): %s; warned once, counted in "
                             "fleet_state_errors_total", kind, where, entry.reason, exc_info=exc_info)

    @property
    def entries(self) -> list[BadEntry]:
        """The entries met, oldest first (at most ``REMEMBERED``)."""
        with self._lock:
            return list(self._seen.values())


def shown(value: object, limit: int = 80) -> str:
    """A member or a reason as printable text of at most ``limit`` characters."""
    text = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
    text = " ".join(text.split()) if isinstance(value, BaseException) else text
    return text if len(text) <= limit else text[: limit - 1] + "…"


def wrong_type(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis' ``WRONGTYPE`` reply: the key holds another type than the command's."""
    return isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc)[:64]


def readable(reply: Any, empty: Any = None) -> Any:
    """A reply of a pipeline run with ``raise_on_error=False``: ``empty`` if the key was of
    another type (``WRONGTYPE``); another error (Redis refusing, away) is raised."""
    if isinstance(reply, Exception):
        reject_wrong_type(reply)
        return empty
    return reply


def reject_wrong_type(exc: BaseException) -> str:
    """Why a key of the wrong type is skipped; raises ``exc`` again if it is another error."""
    if not wrong_type(exc):
        raise exc
    return "the key holds another type (WRONGTYPE)"


LOG = logging.getLogger("fleet.state")
DEFAULT = BadState(LOG)  # for readers given no BadState: a warning once per entry in this process
