"""Stop a turn (``Fleet.cancel``): the cancel's record, then word to the worker running it.

Two steps. First ``turn_cancel.lua``, in the user's slot: it finds the turn after the user's
cursor and records the cancel in the user's state hash (``cancel:<entry>``), or says the turn
was answered already (the done-set) or is not known. That record is what decides: the worker
reads it with the turn (a queued turn is answered ``cancelled`` without running, a retry after
a crash too) and the commit checks it atomically (a cancelled turn is committed only as
``cancelled``), so a turn gets exactly one reply whatever the timing.

Then, for promptness, the worker that holds the user's lane (``<worker>|<token>``) is told on
its cancels stream (``fleet:w:{<worker>}:cancels``, another slot: a second step on a Cluster),
which it reads with its control stream in one blocking ``XREAD``: it stops the handler at once (an async
handler's task is cancelled, a sync handler's ``ctx.cancel_flag`` set). Only when the turn is
the first after the cursor, the one the holder may be running: a later turn is reached through
the commit before it, which reads the record. A lost or late word costs promptness only: the
handler runs on, and its commit is refused and replaced by the cancelled reply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from protocol import keys
from protocol.codec import CodecError, as_str, decode, encode
from protocol.ids import InvalidId, validate_token, validate_user_id
from protocol.models import Control, Reply, ReplyStatus
from stores.functions import Function
from stores.roundtrips import Op, Single, operation

CANCELS_MAXLEN = 64  # entries a worker's cancels stream keeps (approximately)
_REPLY_PEEK_BYTES = 4 * 1024 * 1024  # an unread reply read this far for its status


@dataclass(frozen=True)
class Cancel:
    """What a cancel did: ``cancelled`` (recorded; ``worker``: the lane's holder, told to stop
    the turn now, or None when no worker runs it yet), ``answered`` (nothing done: the turn was
    answered already; ``status`` its reply's, when still unread) or ``unknown`` (no such turn
    queued, running or recently answered)."""

    user: str
    turn_id: str
    outcome: Literal["cancelled", "answered", "unknown"]
    status: ReplyStatus | None = None
    worker: str | None = None

    def __str__(self) -> str:
        if self.outcome == "cancelled":
            told = f"; worker {self.worker} told to stop it" if self.worker else ""
            return f"turn {self.turn_id} cancelled{told}"
        if self.outcome == "answered":
            return f"turn {self.turn_id} already answered" + (f" ({self.status})" if self.status else "")
        return (f"turn {self.turn_id} of {self.user} is not known: not queued, not running and not "
                f"among the user's recently answered turns")


class CancelRefused(ValueError):
    """The user's keys hold the wrong type: nothing was recorded."""


@operation
def cancel_turn(user: str, turn_id: str) -> Op[Cancel]:
    """Cancel ``user``'s turn ``turn_id`` (see the module docstring)."""
    user, turn_id = validate_user_id(user), validate_token(turn_id, "turn id")
    k = keys.user_keys(user)
    now = time.time()
    res = yield Single(lambda r: Function(r, "turn_cancel")(
        keys=[k.state, k.inbox, k.done, k.reply(turn_id)], args=[turn_id, int(now * 1000)]))
    kind = as_str(res[0])
    if kind == "wrongtype":
        flat = [as_str(x) for x in res[2]]
        raise CancelRefused(f"user {user}'s keys cannot be used: " + "; ".join(
            f"{flat[i + 1]} is a {flat[i + 2]}, not a {flat[i + 3]}" for i in range(0, len(flat), 4)))
    if kind == "answered":
        return Cancel(user, turn_id, "answered", _status(res[1]))
    if kind != "cancelled":
        return Cancel(user, turn_id, "unknown")
    entry, first = as_str(res[1]), int(res[2]) == 1
    worker = _holder((yield Single(lambda r: r.get(k.lane)))) if first else None
    if worker is not None:
        word = Control(kind="cancel", ts=now, user=user, turn_id=turn_id, entry=entry)
        yield Single(lambda r: r.xadd(keys.cancels(worker), {"m": encode(word)}, maxlen=CANCELS_MAXLEN,
                                      approximate=True))
    return Cancel(user, turn_id, "cancelled", worker=worker)


def _holder(lane: bytes | str | None) -> str | None:
    """The worker id of a lane's value ``<worker>|<token>`` (None: no lane, or not a valid id)."""
    worker, sep, token = as_str(lane or b"", errors="replace").rpartition("|")
    try:
        return validate_token(worker, "worker id") if sep and token.isdigit() else None
    except InvalidId:
        return None


def _status(raw: bytes | str) -> ReplyStatus | None:
    """The status of an unread reply as pushed (msgpack, or JSON for a plain turn); None if there
    is none or it does not decode."""
    data = raw.encode() if isinstance(raw, str) else raw
    if not data:
        return None
    try:
        if data[:1] == b"{":
            return Reply.model_validate_json(data[:_REPLY_PEEK_BYTES]).status
        return decode(Reply, data, max_bytes=_REPLY_PEEK_BYTES).status
    except (CodecError, ValueError):
        return None
