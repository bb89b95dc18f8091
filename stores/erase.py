"""Erasing a user: every key of ``fleet:u:{U}:``, fenced against a turn in flight, and a line
in the ledger that says who erased which user id, and when (never the data). The user's entries
in the tiers' dead letters are deleted too.

The keys with fixed names (``keys.user_key_names``) and whatever else a ``SCAN`` finds under the
user's prefix (the reply lists and reply streams, named by turn id) go in one call of
``user_delete.lua``. The lane is erased in that same step, so a worker serving a turn of the
user then finds its lane gone when it commits: its write is fenced, nothing of the turn is
written back, and with the inbox gone nothing is left to retry. A reply list (or reply stream)
a commit wrote between the ``SCAN`` and the call is found by its turn id in the done-set the
call read, and erased by a second call (a commit after the first call is fenced: no later write
is possible).

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
from protocol.ids import validate_tier, validate_user_id
from protocol.models import LedgerEvent
from stores.deadletters import entry_bytes, trim_call
from stores.functions import Function
from stores.ledger import EVENTS_MAXLEN
from stores.replies import raw_rows
from stores.roundtrips import Op, Pipelined, Single, is_async, operation

SCAN_COUNT = 1_000  # keys per SCAN step of the user's prefix
DEAD_PAGE = 500  # dead letters read per round trip when erasing a user's
ERASE_TIER = "-"  # the ledger entry's tier: an erasure is of no tier


@dataclass(frozen=True)
class Erased:
    """What an erasure removed: the user, how many keys existed, how many dead letters were the
    user's, the ledger entry's id."""

    user: str
    keys: int
    dead_letters: int
    ledger_id: str

    def to_json(self) -> dict[str, Any]:
        return {"user": self.user, "keys": self.keys, "dead_letters": self.dead_letters,
                "ledger_id": self.ledger_id}


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


def _ledger_event(user: str, erased: int, by: str, role: str, now: float, dead: int) -> LedgerEvent:
    return LedgerEvent(ts=now, tier=ERASE_TIER, epoch=0, commander=by, action="user-deleted",
                       reason=f"user {user} erased ({erased} keys, {dead} dead letters)",
                       why={"user": user, "by": by, "role": role, "keys": erased, "dead_letters": dead})


@operation
def erase_dead_letters(user: str) -> Op[int]:
    """Delete ``user``'s entries from every tier's dead letters (those of the tiers' set and of
    every policy key); how many. Each tier's stream is read ``DEAD_PAGE`` entries at a time."""
    user = validate_user_id(user)
    members = yield Single(lambda r: r.smembers(keys.TIERS))
    policy_keys = yield Single(lambda r: _scan(r, keys.POLICY_PREFIX + "{*}"))
    removed = 0
    for tier in sorted(_tier_names(members, policy_keys)):
        removed += yield from _erase_from(tier, user)
    return removed


def _tier_names(members: Any, policy_keys: Any) -> set[str]:
    names = {as_str(m, errors="replace") for m in members or ()}
    head = keys.POLICY_PREFIX + "{"
    names |= {as_str(k)[len(head):-1] for k in policy_keys or () if as_str(k).startswith(head)}
    out = set()
    for name in names:
        try:
            out.add(validate_tier(name))
        except ValueError:  # a member no tier can have: skipped
            continue
    return out


def _erase_from(tier: str, user: str) -> Op[int]:
    """Delete ``user``'s dead letters of ``tier`` (and count their bytes out of the tier's count)."""
    start, removed = "-", 0
    while True:
        page = raw_rows((yield _page(tier, start)))
        mine = [(as_str(i), f) for i, f in page if f.get(b"user") == user.encode()]
        if mine:
            yield _drop(tier, [i for i, _ in mine], sum(entry_bytes(f) for _, f in mine))
            removed += len(mine)
        if len(page) < DEAD_PAGE:
            return removed
        start = "(" + as_str(page[-1][0])


def _page(tier: str, start: str) -> Single:
    return Single(lambda r: r.xrange(keys.dead(tier), start, "+", count=DEAD_PAGE))


def _drop(tier: str, ids: list[str], size: int) -> Pipelined:
    """``XDEL`` of ``ids`` and their ``size`` bytes out of the tier's count (one slot: the tier's)."""
    def queue(pipe: Any) -> None:
        pipe.xdel(keys.dead(tier), *ids)
        pipe.execute_command(*trim_call(tier, -size))
    return Pipelined(queue, transaction=True)


@operation
def delete_user(user: str, by: str, role: str, now: float) -> Op[Erased]:
    """Erase every key of ``user`` and the user's dead letters (see the module docstring), and
    record it in the ledger as done by ``by`` (an OS user, :func:`who`) connected as ``role``
    (the Redis user) at ``now``."""
    user = validate_user_id(user)
    prefix = keys.user_prefix(user)
    found = [as_str(k) for k in (yield Single(lambda r: _scan(r, prefix + "*")))]
    first = list(dict.fromkeys([*keys.user_key_names(user), *found]))
    erased, ids = yield _delete(first, prefix)
    late = [k for i in ids if _is_token(as_str(i))
            for k in (keys.reply(user, as_str(i)), keys.stream(user, as_str(i))) if k not in first]
    count = int(erased)
    if late:
        again, _ = yield _delete(late, prefix)
        count += int(again)
    dead = yield from erase_dead_letters.steps(user)
    event = _ledger_event(user, count, by, role, now, dead)
    fields = {"m": encode(event), "tier": ERASE_TIER}
    entry = yield Single(lambda r: r.xadd(keys.EVENTS, fields, maxlen=EVENTS_MAXLEN, approximate=True))
    return Erased(user, count, dead, as_str(entry))


def _is_token(turn_id: str) -> bool:
    """Whether ``turn_id`` can name a reply key (a done-set member someone wrote by hand may not)."""
    try:
        keys.reply("x", turn_id)
    except ValueError:
        return False
    return True
