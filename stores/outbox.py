"""The relay's side of the outbox: which users have deferrals, what they are, and
removing them once RQ holds them.

A turn that deferred jobs commits them into ``fleet:u:{U}:outbox`` (``turn_commit.lua``), then
the worker adds ``{user: U}`` to :data:`protocol.keys.OUTBOX_READY`. The relays read that
stream through one consumer group (:data:`protocol.keys.RELAY_GROUP`): a notification is acked
only after every entry of the user's outbox it could see is in RQ and deleted, so a relay that
dies leaves it pending, and another relay (or itself, restarted) claims it once idle.

A worker that dies between its commit and the notification leaves entries with none:
:func:`users_with_entries` finds them from each tier's active set (the users who submitted in
the last ``10 × active_window_s``), never by scanning the keyspace. Each call is one round trip
on one slot (the user's, or the notification stream's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import redis

from protocol import keys
from protocol.codec import as_str
from protocol.ids import InvalidId, validate_user_id
from stores.replies import RawRow, raw_rows, raw_streams

BATCH = 500  # users checked per pipelined round trip by the sweep


@dataclass(frozen=True)
class Hint:
    """One notification of the relay stream: ``user`` is None when it names no valid user."""

    id: str
    user: str | None


@dataclass(frozen=True)
class Entry:
    """One outbox entry: its stream id, RQ job id and msgpack ``Deferral``."""

    id: str
    job: str
    payload: bytes


def join_relay_group(r: redis.Redis) -> None:
    """Create the relays' consumer group (from id 0: notifications written before any relay
    ran are read too); an existing group is kept."""
    try:
        r.xgroup_create(keys.OUTBOX_READY, keys.RELAY_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _hints(rows: Sequence[RawRow]) -> list[Hint]:
    out = []
    for sid, fields in rows:
        try:
            user: str | None = validate_user_id(as_str(fields.get(b"user", b"")))
        except (InvalidId, UnicodeDecodeError):
            user = None
        out.append(Hint(as_str(sid), user))
    return out


def read_hints(r: redis.Redis, relay: str, count: int, block_ms: int) -> list[Hint]:
    """New notifications for this relay (blocking up to ``block_ms``)."""
    got = r.xreadgroup(keys.RELAY_GROUP, relay, {keys.OUTBOX_READY: ">"}, count=count, block=block_ms)
    streams = raw_streams(got)
    return _hints(streams[0][1]) if streams else []


def claim_idle_hints(r: redis.Redis, relay: str, min_idle_ms: int, start: str,
                     count: int) -> tuple[str, list[Hint]]:
    """Notifications pending under any relay for ``min_idle_ms`` (one that died, or this one
    restarted under a new name), claimed by this one; the cursor to resume from ("0-0": done)."""
    nxt, rows, *_ = r.xautoclaim(keys.OUTBOX_READY, keys.RELAY_GROUP, relay, min_idle_ms, start, count=count)
    return as_str(nxt), _hints([row for row in raw_rows(rows) if row and row[1] is not None])


def ack_hints(r: redis.Redis, ids: Sequence[str]) -> None:
    """Ack and delete handled notifications (one slot: one transaction)."""
    if not ids:
        return
    pipe = r.pipeline(transaction=True)
    pipe.xack(keys.OUTBOX_READY, keys.RELAY_GROUP, *ids)
    pipe.xdel(keys.OUTBOX_READY, *ids)
    pipe.execute()


def read_outbox(r: redis.Redis, user: str, count: int) -> list[Entry]:
    """The oldest ``count`` entries of ``user``'s outbox."""
    out = []
    for sid, fields in raw_rows(r.xrange(keys.outbox(user), count=count)):
        out.append(Entry(as_str(sid), as_str(fields.get(b"job", b""), errors="replace"),
                         fields.get(b"d", b"")))
    return out


def delete_entries(r: redis.Redis, user: str, ids: Sequence[str]) -> None:
    """Delete relayed entries (RQ holds their jobs)."""
    if ids:
        r.xdel(keys.outbox(user), *ids)


def dead_letter(r: redis.Redis, user: str, entry: Entry, reason: str, ts: float) -> None:
    """Record an entry the relay cannot enqueue (it is deleted after: it would fail again)."""
    r.xadd(keys.OUTBOX_DEAD, {"user": user, "entry": entry.id, "job": entry.job, "reason": reason[:500],
                              "ts": repr(ts), "d": entry.payload[:4096]}, maxlen=10_000, approximate=True)


def outbox_length(r: redis.Redis, user: str) -> int:
    return int(r.xlen(keys.outbox(user)))


def hint_backlog(r: redis.Redis) -> int:
    """Notifications not yet handled: undelivered + pending in the relays' group."""
    try:
        groups = r.xinfo_groups(keys.OUTBOX_READY)
    except redis.ResponseError:  # no stream yet
        return 0
    for g in groups:
        if as_str(g["name"]) == keys.RELAY_GROUP:
            return int(g.get("lag") or 0) + int(g.get("pending") or 0)
    return int(r.xlen(keys.OUTBOX_READY))


def registered_tiers(r: redis.Redis) -> list[str]:
    """The tiers of ``fleet:tiers`` (one read, no keyspace scan: every tier created by Fleet is
    there)."""
    return sorted(as_str(t) for t in r.smembers(keys.TIERS))


def users_with_entries(r: redis.Redis, tiers: Sequence[str]) -> Iterator[str]:
    """Users of the tiers' active sets whose outbox holds entries (``ZSCAN`` + pipelined
    ``XLEN``, :data:`BATCH` users a round trip)."""
    for tier in tiers:
        cursor = 0
        while True:
            cursor, rows = r.zscan(keys.active(tier), cursor, count=BATCH)
            users = []
            for member, _score in rows:
                try:
                    users.append(validate_user_id(as_str(member)))
                except (InvalidId, UnicodeDecodeError):
                    continue
            if users:
                pipe = r.pipeline(transaction=False)
                for user in users:
                    pipe.xlen(keys.outbox(user))
                yield from (u for u, n in zip(users, pipe.execute(), strict=True) if n)
            if cursor == 0:
                break


def beat_relay(r: redis.Redis, relay_id: str, now: float) -> None:
    """The relay's heartbeat: ``now`` under its id in :data:`protocol.keys.RELAYS`."""
    r.hset(keys.RELAYS, relay_id, repr(now))


def relay_beats(r: redis.Redis) -> dict[str, float]:
    """Every relay's last heartbeat, by id (a value that is no number is left out)."""
    out = {}
    for rid, ts in r.hgetall(keys.RELAYS).items():
        try:
            out[as_str(rid)] = float(ts)
        except ValueError:
            continue
    return out


def forget_relays(r: redis.Redis, relay_ids: Sequence[str]) -> None:
    """Remove the heartbeats of relays gone long ago (one ``HDEL``)."""
    if relay_ids:
        r.hdel(keys.RELAYS, *relay_ids)
