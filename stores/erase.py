"""Erasing a user: every key of ``fleet:u:{U}:``, fenced against a turn in flight, and a line
in the ledger that says who erased which user id, and when (never the data).

The keys with fixed names (``keys.user_key_names``) and whatever else a ``SCAN`` finds under the
user's prefix (the reply lists, named by turn id) go in one call of ``user_delete.lua``. The lane
is erased in that same step, so a worker serving a turn of the user then finds its lane gone
when it commits: its write is fenced, nothing of the turn is written back, and with the inbox
gone nothing is left to retry. A reply list a commit wrote between the ``SCAN`` and the call is
found by its turn id in the done-set the call read, and erased by a second call (a commit
after the first call is fenced: no later write is possible).

The call checks that the caller's ACL may ``DEL`` each key: the ``fleet-operator`` role may;
the ``fleet-client`` role, which can write an inbox but delete nothing, cannot.
"""

from __future__ import annotations

import getpass
import socket
from dataclasses import dataclass
from typing import Any

from protocol import keys
from protocol.codec import as_str, encode
from protocol.ids import validate_user_id
from protocol.models import LedgerEvent
from stores.functions import Function
from stores.ledger import EVENTS_MAXLEN
from stores.roundtrips import Op, Single, is_async, operation

SCAN_COUNT = 1_000  # keys per SCAN step of the user's prefix
ERASE_TIER = "-"  # the ledger entry's tier: an erasure is of no tier


@dataclass(frozen=True)
class Erased:
    """What an erasure removed: the user, how many keys existed, the ledger entry's id."""

    user: str
    keys: int
    ledger_id: str

    def to_json(self) -> dict[str, Any]:
        return {"user": self.user, "keys": self.keys, "ledger_id": self.ledger_id}


def who() -> str:
    """The operator an erasure is recorded under: the OS user and host of this process."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER (a container's uid)
        name = "unknown"
    return f"{name}@{socket.gethostname()}"


def connection_user(r: Any) -> str:
    """The Redis user ``r`` connects as (``default`` when its URL names none)."""
    pool = getattr(r, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if kwargs is None and hasattr(r, "get_connection_kwargs"):  # a Cluster client
        kwargs = r.get_connection_kwargs()
    name = (kwargs or {}).get("username")
    return name if isinstance(name, str) and name else "default"


def _scan(r: Any, match: str) -> Any:
    """Every key ``match`` finds (on a Cluster, on every node); an awaitable on an asyncio client."""
    if is_async(r):
        async def collect() -> list[Any]:
            return [k async for k in r.scan_iter(match=match, count=SCAN_COUNT)]
        return collect()
    return list(r.scan_iter(match=match, count=SCAN_COUNT))


def _delete(keys_: list[str], prefix: str) -> Single:
    return Single(lambda r: Function(r, "user_delete")(keys=keys_, args=[prefix]))


def _ledger_event(user: str, erased: int, by: str, role: str, now: float) -> LedgerEvent:
    return LedgerEvent(ts=now, tier=ERASE_TIER, epoch=0, commander=by, action="user-deleted",
                       reason=f"user {user} erased ({erased} keys)",
                       why={"user": user, "by": by, "role": role, "keys": erased})


@operation
def delete_user(user: str, by: str, role: str, now: float) -> Op[Erased]:
    """Erase every key of ``user`` (see the module docstring) and record it in the ledger as
    done by ``by`` (an OS user, :func:`who`) connected as ``role`` (the Redis user) at ``now``."""
    user = validate_user_id(user)
    prefix = keys.user_prefix(user)
    found = [as_str(k) for k in (yield Single(lambda r: _scan(r, prefix + "*")))]
    first = list(dict.fromkeys([*keys.user_key_names(user), *found]))
    erased, ids = yield _delete(first, prefix)
    late = [k for k in (keys.reply(user, as_str(i)) for i in ids if _is_token(as_str(i)))
            if k not in first]
    count = int(erased)
    if late:
        again, _ = yield _delete(late, prefix)
        count += int(again)
    event = _ledger_event(user, count, by, role, now)
    fields = {"m": encode(event), "tier": ERASE_TIER}
    entry = yield Single(lambda r: r.xadd(keys.EVENTS, fields, maxlen=EVENTS_MAXLEN, approximate=True))
    return Erased(user, count, as_str(entry))


def _is_token(turn_id: str) -> bool:
    """Whether ``turn_id`` can name a reply key (a done-set member someone wrote by hand may not)."""
    try:
        keys.reply("x", turn_id)
    except ValueError:
        return False
    return True
