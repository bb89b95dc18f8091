"""One user as an operator looks at it (``fleet user U``, the monitor's user page), and the users
active now in a tier with their usage counters (the monitor's population).

Every read is bounded, and says where its bound may hide something:

- the user's keys (lane, cursor, inbox, session, usage) are one user slot: one pipelined round
  trip, then the inbox after the cursor (up to ``INBOX_SCAN`` entries; beyond, the inbox's
  length, an upper bound since a committed entry is deleted from it);
- a pending notification: on each ready shard of each tier (a tier's shard 0 and every other
  that exists), the ``PENDING_SCAN`` oldest delivered-but-unacked entries (``XPENDING``, then
  each one read by id) and the ``UNDELIVERED_SCAN`` first entries after the group's
  last-delivered id are checked for the user; a tier where either bound was reached is listed
  in ``pending_partial`` (a notification further on would not be seen);
- dead letters: the newest ``DEAD_SCAN`` of each tier are read and the user's kept;
- the turn in progress (the lane held): the first inbox entry after the cursor, its attempt, and
  what its reply stream holds of the text so far (the ``STREAM_SCAN`` first entries).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, cast

import redis

from protocol import keys
from protocol.codec import CodecError, as_str, decode, decode_valid
from protocol.ids import validate_tier, validate_user_id
from protocol.models import SessionEntry, Turn
from stores.backlog import existing_shards, workers_group
from stores.deadletters import DeadLetterRow, dead_letter_rows
from stores.policies import list_tiers
from stores.replies import bytes_list, hash_reply, raw_rows

INBOX_SCAN = 1_000
PENDING_SCAN = 1_000
UNDELIVERED_SCAN = 1_000
DEAD_SCAN = 1_000
STREAM_SCAN = 1_000
TURN_PEEK_BYTES = 1024 * 1024  # an inbox entry larger than this is not decoded for its text
USAGE_FIELDS = ("turns", "errors", "chars_in", "chars_out", "handler_ms")


@dataclass(frozen=True)
class TurnInProgress:
    """The turn a worker serves now: its inbox ``entry``, ``turn_id`` and ``text`` (as its entry
    holds them; '' when they do not decode), its ``attempt`` (0 if not counted yet), and the text
    its reply stream holds so far (after the last restart; '' for a turn not streamed)."""

    entry: str
    turn_id: str
    text: str
    attempt: int
    streamed: str


@dataclass(frozen=True)
class UserView:
    """What ``fleet user U`` and the monitor's user page show of one user."""

    user: str
    lane_holder: str | None  # the worker id holding the lane, None if free
    lane_token: int | None  # its fencing token
    lane_ttl_ms: int  # the lane's remaining TTL (0 when free)
    cursor: str  # the last inbox entry done, '' if none
    inbox_after_cursor: int  # turns queued after the cursor (see inbox_exact)
    inbox_exact: bool  # False: over INBOX_SCAN, the count is the inbox's length (an upper bound)
    session: list[SessionEntry]  # the last session entries, oldest first
    pending: list[str]  # tiers with an undelivered or unacked notification for the user
    pending_partial: list[str]  # tiers whose scan reached its bound (see the module docstring)
    usage: dict[str, int]  # the per-user counters of keys.usage
    dead_letters: list[DeadLetterRow]  # the user's, among the newest DEAD_SCAN of each tier
    tiers: list[str] = field(default_factory=list)  # the tiers looked at
    in_progress: TurnInProgress | None = None  # the turn being served (the lane held), if any

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["session"] = [e.model_dump(mode="json") for e in self.session]
        out["dead_letters"] = [d.to_json() for d in self.dead_letters]
        return out


def inspect_user(r: redis.Redis, user: str, *, tiers: list[str] | None = None,
                 session_n: int = 10) -> UserView:
    """Everything the user page shows of ``user``; ``tiers`` None: every tier the fleet knows
    (``fleet:tiers`` and the policy keys). Raises InvalidId for a bad user id or tier."""
    user = validate_user_id(user)
    tiers = sorted(set(list_tiers(r)) | {"chat"}) if tiers is None else [validate_tier(t) for t in tiers]
    lane, ttl, cursor, session, usage, length = _user_keys(r, user, max(0, session_n))
    holder, token = lane_parts(lane)
    after, exact, first = _inbox_after(r, user, cursor, length)
    pending, partial = _pending(r, user, tiers)
    dead = [row for tier in tiers for row in dead_letter_rows(r, tier, DEAD_SCAN, user)]
    current = _in_progress(r, user, *first) if holder and first is not None else None
    return UserView(user=user, lane_holder=holder, lane_token=token, lane_ttl_ms=max(0, ttl) if holder else 0,
                    cursor=cursor, inbox_after_cursor=after, inbox_exact=exact, session=session,
                    pending=pending, pending_partial=partial, usage=usage, dead_letters=dead, tiers=tiers,
                    in_progress=current)


def lane_parts(raw: Any) -> tuple[str | None, int | None]:
    """The holder and fencing token of a lane value ``<worker>|<token>`` (None, None if free)."""
    if not raw:
        return None, None
    worker, _, token = as_str(raw, errors="replace").rpartition("|")
    if not worker:
        return as_str(raw, errors="replace"), None
    return worker, int(token) if token.isdigit() else None


def counters(raw: Any) -> dict[str, int]:
    """An HGETALL of a usage hash as counters (a field that is not a whole number is left out)."""
    out = {}
    for k, v in hash_reply(raw or {}).items():
        try:
            out[as_str(k, errors="replace")] = int(v)
        except ValueError:
            continue
    return out


def _user_keys(r: redis.Redis, user: str, session_n: int) -> tuple[Any, int, str, list[SessionEntry],
                                                                   dict[str, int], int]:
    pipe = r.pipeline(transaction=False)  # every key in the user's slot
    pipe.get(keys.lane(user))
    pipe.pttl(keys.lane(user))
    pipe.hget(keys.state(user), "cursor")
    pipe.lrange(keys.session(user), -session_n, -1)
    pipe.hgetall(keys.usage(user))
    pipe.xlen(keys.inbox(user))
    lane, ttl, cursor, session, usage, length = pipe.execute()
    entries = decode_valid(SessionEntry, bytes_list(session)) if session_n else []
    return lane, int(ttl), as_str(cursor) if cursor else "", entries, counters(usage), int(length)


def _inbox_after(r: redis.Redis, user: str, cursor: str,
                 length: int) -> tuple[int, bool, tuple[str, dict[bytes, bytes]] | None]:
    """The count of turns after the cursor, whether it is exact, and the first of them."""
    if length == 0:
        return 0, True, None
    got = raw_rows(r.xrange(keys.inbox(user), f"({cursor}" if cursor else "-", "+", count=INBOX_SCAN + 1))
    first = (as_str(got[0][0]), got[0][1]) if got else None
    return (len(got), True, first) if len(got) <= INBOX_SCAN else (length, False, first)


def _in_progress(r: redis.Redis, user: str, entry: str, fields: dict[bytes, bytes]) -> TurnInProgress:
    """The turn of inbox ``entry``: its id and text, its attempt count, its stream's text so far."""
    turn_id, text = _turn_of(entry, fields)
    attempt = r.hget(keys.state(user), f"att:{entry}")
    count = as_str(attempt, errors="replace").partition("|")[0] if attempt else "0"
    streamed = ""
    if turn_id:
        for _id, f in raw_rows(r.xrange(keys.stream(user, turn_id), count=STREAM_SCAN)):
            kind = f.get(b"k")
            if kind == b"restart":
                streamed = ""
            elif kind == b"chunk":
                streamed += as_str(f.get(b"t", b""), errors="replace")
    return TurnInProgress(entry, turn_id, text, int(count) if count.isdigit() else 0, streamed)


def _turn_of(entry: str, fields: dict[bytes, bytes]) -> tuple[str, str]:
    """An inbox entry's turn id and text, in either form ('' for what does not decode)."""
    if b"m" in fields:
        try:
            turn = decode(Turn, fields[b"m"], max_bytes=TURN_PEEK_BYTES)
        except CodecError:
            return as_str(fields.get(b"turn_id", b""), errors="replace"), ""
        return turn.turn_id, turn.text
    turn_id = as_str(fields.get(b"turn_id", entry.encode()), errors="replace")
    try:
        keys.stream("x", turn_id)
    except ValueError:  # no turn id a key can name
        turn_id = ""
    return turn_id, as_str(fields.get(b"text", b""), errors="replace")


def _pending(r: redis.Redis, user: str, tiers: list[str]) -> tuple[list[str], list[str]]:
    """The tiers with a notification for ``user`` that is undelivered or unacked, and the other
    tiers whose scan was cut by a bound. Two round trips, one key per command."""
    shards = existing_shards(r, tiers)
    streams = [(tier, keys.ready(tier, k)) for tier in tiers for k in shards[tier]]
    pipe = r.pipeline(transaction=False)
    for _tier, stream in streams:
        pipe.xinfo_groups(stream)
        pipe.xpending_range(stream, keys.GROUP, "-", "+", PENDING_SCAN)
    first = pipe.execute(raise_on_error=False) if streams else []
    pipe = r.pipeline(transaction=False)
    plans = [_queue_notification_reads(pipe, stream, first[2 * i], first[2 * i + 1])
             for i, (_tier, stream) in enumerate(streams)]
    second = pipe.execute(raise_on_error=False) if any(n for n, _cut in plans) else []
    found, partial, at = set(), set(), 0
    for (tier, _stream), (n, cut) in zip(streams, plans, strict=True):
        replies, at = second[at: at + n], at + n
        if any(_names(reply, user) for reply in replies):
            found.add(tier)
        if cut or (replies and len(_entries(replies[0])) >= UNDELIVERED_SCAN):
            partial.add(tier)
    return sorted(found), sorted(partial - found)


def _queue_notification_reads(pipe: Any, stream: str, groups: Any, pending: Any) -> tuple[int, bool]:
    """Queue the reads of one stream's undelivered entries (first) and of its pending ones (by
    id): how many reads were queued, and whether the pending list was longer than
    ``PENDING_SCAN``. No stream (``XINFO GROUPS`` failed): nothing waits there, nothing is read."""
    if isinstance(groups, Exception):
        return 0, False
    group = workers_group(groups)
    last = as_str(group.get("last-delivered-id") or "") if group is not None else ""
    pipe.xrange(stream, f"({last}" if last else "-", "+", count=UNDELIVERED_SCAN)
    ids = [] if isinstance(pending, Exception) else [as_str(p.get("message_id")) for p in pending]
    for nid in ids:
        pipe.xrange(stream, nid, nid)
    count = int(group.get("pending") or 0) if group is not None else 0
    return 1 + len(ids), count > len(ids)


def _entries(reply: Any) -> list[Any]:
    return [] if isinstance(reply, Exception) else raw_rows(reply)


def _names(reply: Any, user: str) -> bool:
    return any(f.get(b"user") == user.encode() for _i, f in _entries(reply))


# --- the population -------------------------------------------------------------------------
@dataclass(frozen=True)
class UserUsage:
    """One active user of a tier with the usage counters the worker writes (``keys.usage``:
    ``turns``, ``errors``, ``chars_in``, ``chars_out``, ``handler_ms``: the handler's time on the
    user's turns, every attempt, 0 from workers that do not write it). The counters are the user's
    across tiers: the hash is per user."""

    user: str
    tier: str
    last_active_ts: float  # the user's last submit to the tier (keys.active)
    turns: int = 0
    errors: int = 0
    chars_in: int = 0
    chars_out: int = 0
    handler_ms: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def active_users(r: redis.Redis, tier: str, *, limit: int = 500) -> list[UserUsage]:
    """The ``limit`` users of ``tier``'s active set (keys.active) who submitted last, newest
    first, with their usage counters: two round trips (the set, then every user's hash)."""
    tier = validate_tier(tier)
    if limit <= 0:
        return []
    marks = cast("list[tuple[bytes, float]]", r.zrevrange(keys.active(tier), 0, limit - 1, withscores=True))
    users = []
    for raw, score in marks:
        try:
            users.append((validate_user_id(raw), float(score)))
        except ValueError:  # InvalidId: a member no submit writes; not a key to build
            continue
    pipe = r.pipeline(transaction=False)  # one key per command, one slot per user
    for user, _ts in users:
        pipe.hgetall(keys.usage(user))
    usages = pipe.execute() if users else []
    out = []
    for (user, ts), raw_usage in zip(users, usages, strict=True):
        c = counters(raw_usage)
        out.append(UserUsage(user=user, tier=tier, last_active_ts=ts,
                             **{name: c.get(name, 0) for name in USAGE_FIELDS}))
    return out
