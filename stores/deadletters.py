"""A tier's dead letters (``fleet:{T}:dead``): how the worker writes them, how ``fleet status``,
``fleet top``, ``fleet user`` and the monitor read them, and the operator's retry and purge.

The worker appends them (``Worker.dead_letter`` calls :func:`dead_letter_async`). An entry holds
``user``, ``entry`` (the inbox entry id, '' for a bad notification), ``turn_id``, ``reason``,
``kind`` (what the reason is about, :data:`DeadKind`),
``worker``, ``ts``, ``size``, ``payload`` (a JSON preview of the fields, each cut to
``DEAD_FIELD_BYTES``) and ``turn``: the inbox entry's own fields, whole, as a msgpack map, when
they fit in ``DEAD_TURN_BYTES`` (a turn the worker accepts does): what a retry re-enqueues. An
entry without ``turn`` cannot be retried.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from itertools import groupby
from typing import Any, Literal

import msgpack
import redis
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from protocol import keys
from protocol.codec import CodecError, as_str, decode, encode
from protocol.ids import InvalidId, validate_tier, validate_token, validate_user_id
from protocol.models import Turn
from stores.cluster import is_cluster
from stores.functions import Function, command
from stores.replies import Row, raw_rows
from stores.submit import submit_turns
from stores.submit_options import read_submit_options, split_by_pool
from stores.tier_exists import read_tier_probe, tier_defined

DEAD_MAXLEN = 100_000
DEAD_MAX_BYTES = 64 * 1024 * 1024  # a tier's dead letters, by default (its policy's dead_letter_max_bytes)
DEAD_FIELD_BYTES = 2048
# The whole entry is kept up to this size: the worker's default max_turn_bytes (64 KiB of
# values) plus room for the field names. A larger one was rejected for its size anyway.
DEAD_TURN_BYTES = 64 * 1024 + 1024
PAGE = 500  # dead letters read per round trip when retrying all of a tier
RETRY_BATCH = 100  # turns per submit round trip of a retry
NOT_KEPT = "cannot retry: the turn's text was not kept"

Fields = Mapping[bytes, bytes]
log = logging.getLogger("fleet.deadletters")
# What a dead letter is about: a turn that does not decode, one for a tier no policy defines, one
# whose handler failed max_attempts times, one whose user's keys hold the wrong type, a
# notification that names no valid user, one that hit the delivery limit (``other``: an entry
# written without a kind)
DeadKind = Literal["bad_turn", "no_policy", "attempts", "user_data", "bad_notification",
                   "delivery_limit", "other"]
KIND_SCAN = 1_000  # the newest dead letters of a tier counted by kind (fleet status)


def dead_letter_count(r: redis.Redis, tier: str) -> int:
    """How many dead letters the tier keeps."""
    return int(r.xlen(keys.dead(tier)))


def newest_dead_letters(r: redis.Redis, tier: str, count: int) -> list[Row]:
    """The newest ``count`` dead letters as ``(id, fields)``, newest first."""
    return [(as_str(i), f) for i, f in raw_rows(r.xrevrange(keys.dead(tier), count=count))]


async def dead_letter_async(r: aioredis.Redis, tier: str, *, user: str, entry: str, turn_id: str,
                            reason: str, worker: str, fields: Fields, kind: DeadKind = "other",
                            max_bytes: int = DEAD_MAX_BYTES) -> None:
    """Append a turn that could not be served to the tier's dead letters, with the reason and
    its fields (each cut to ``DEAD_FIELD_BYTES``); an inbox entry (``entry`` set) of up to
    ``DEAD_TURN_BYTES`` is kept whole, for a retry. The oldest are trimmed while the tier keeps
    more than ``DEAD_MAXLEN`` entries or ``max_bytes`` bytes (:func:`trim_call`)."""
    out = dead_letter_fields(user=user, entry=entry, turn_id=turn_id, reason=reason, worker=worker,
                             fields=fields, now=time.time(), kind=kind)
    async with r.pipeline(transaction=True) as pipe:  # one slot: the tier's
        pipe.xadd(keys.dead(tier), out)
        pipe.execute_command(*trim_call(tier, entry_bytes(out), max_bytes))
        added, trimmed = await pipe.execute(raise_on_error=False)
    if isinstance(added, Exception):
        raise added
    if isinstance(trimmed, Exception):  # the dead letter is kept; the next one trims
        log.warning("the dead letters of %s were not trimmed: %s", tier, trimmed)


def entry_bytes(fields: Mapping[Any, Any]) -> int:
    """The bytes of a stream entry as ``dead_trim.lua`` counts them: its names' and values' lengths."""
    return sum(len(_as_bytes(k)) + len(_as_bytes(v)) for k, v in fields.items())


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def trim_call(tier: str, added: int, max_bytes: int = DEAD_MAX_BYTES) -> tuple[Any, ...]:
    """The ``FCALL`` of ``dead_trim.lua``: count ``added`` bytes in (negative: out), then trim the
    oldest dead letters to ``DEAD_MAXLEN`` entries and ``max_bytes`` bytes."""
    return command("dead_trim", _trim_keys(tier), [added, DEAD_MAXLEN, max_bytes])


def _trim_keys(tier: str) -> list[str]:
    return [keys.dead(tier), keys.dead_bytes(tier)]


def dead_letter_fields(*, user: str, entry: str, turn_id: str, reason: str, worker: str,
                       fields: Fields, now: float, kind: DeadKind = "other") -> dict[FieldT, EncodableT]:
    """The fields of one dead-letter entry (pure: what :func:`dead_letter_async` writes)."""
    payload = {as_str(k)[:64]: v[:DEAD_FIELD_BYTES].decode(errors="replace") for k, v in fields.items()}
    size = sum(len(k) + len(v) for k, v in fields.items())
    out: dict[FieldT, EncodableT] = {
        "user": user, "entry": entry, "turn_id": turn_id, "reason": reason, "kind": kind,
        "worker": worker, "ts": f"{now:.3f}", "size": str(size),
        "payload": json.dumps(payload)[: 4 * DEAD_FIELD_BYTES]}
    if entry and size <= DEAD_TURN_BYTES:
        out["turn"] = msgpack.packb(dict(fields), use_bin_type=True)
    return out


# --- reading ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DeadLetterRow:
    """One dead letter as people read it; ``retriable`` says whether the turn was kept."""

    id: str
    tier: str
    user: str
    entry: str
    turn_id: str
    reason: str
    kind: str  # a DeadKind, as written (``other`` when missing)
    worker: str
    ts: float
    size: int
    payload: str  # the JSON preview of the entry's fields (each value cut)
    retriable: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_dead_letter(tier: str, entry_id: str, fields: Fields) -> DeadLetterRow:
    """A raw dead-letter entry as a row; a field missing or unreadable (an old or hand-written
    entry) reads as empty."""
    def text(name: bytes) -> str:
        return as_str(fields.get(name, b""), errors="replace")

    def number(name: bytes) -> float:
        try:
            return float(text(name) or 0)
        except ValueError:
            return 0.0

    return DeadLetterRow(id=entry_id, tier=tier, user=text(b"user"), entry=text(b"entry"),
                         turn_id=text(b"turn_id"), reason=text(b"reason"), kind=text(b"kind") or "other",
                         worker=text(b"worker"),
                         ts=number(b"ts"), size=int(number(b"size")), payload=text(b"payload"),
                         retriable=b"turn" in fields)


def dead_letter_kinds(r: redis.Redis, tier: str, scan: int = KIND_SCAN) -> dict[str, int]:
    """How many of the tier's newest ``scan`` dead letters are of each kind."""
    out: dict[str, int] = {}
    for _id, fields in newest_dead_letters(r, tier, scan):
        kind = as_str(fields.get(b"kind", b"other"), errors="replace")[:32] or "other"
        out[kind] = out.get(kind, 0) + 1
    return out


def dead_letter_rows(r: redis.Redis, tier: str, count: int, user: str | None = None) -> list[DeadLetterRow]:
    """The newest ``count`` dead letters of ``tier``, newest first; with ``user``, only that
    user's among them (so at most ``count`` entries are read)."""
    rows = [parse_dead_letter(tier, i, f) for i, f in newest_dead_letters(r, tier, count)]
    return [row for row in rows if user is None or row.user == user]


# --- retry ------------------------------------------------------------------------------
_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")
_RETRY_SUFFIX = re.compile(r"^(.*)\.r(\d{1,6})$")


def validate_dead_letter_id(value: str) -> str:
    """A dead-letter id as ``fleet dead-letters`` shows it (``1700000000000-0``), else InvalidId."""
    if not _STREAM_ID.fullmatch(value):
        raise InvalidId(f"invalid dead-letter id {value[:40]!r}: use an id `fleet dead-letters` "
                        "shows, like 1700000000000-0")
    return value


def retry_turn_id(turn_id: str) -> str:
    """The turn id a retry of ``turn_id`` is served under: ``<id>.r1``, then ``.r2`` for a retry
    of that one, and so on; one dead letter always gives the same id, so the user's done-set
    answers it once however often it is retried. A fresh id, not the original: the original is
    in the done-set already (the rejection was committed under it) and its reply key may still
    hold the error reply. Cut to the 64 characters a turn id may have."""
    m = _RETRY_SUFFIX.match(turn_id)
    base, n = (m.group(1), int(m.group(2)) + 1) if m else (turn_id, 1)
    suffix = f".r{n}"
    return validate_token(base[: 64 - len(suffix)] + suffix, "turn id")


def retry_turn(row_tier: str, fields: Fields, now: float) -> Turn | str:
    """The turn a dead letter re-enqueues (a new turn id, submitted ``now``), or why it cannot
    be retried: a pure function of the dead-letter entry."""
    if b"turn" not in fields:
        if not as_str(fields.get(b"entry", b""), errors="replace"):
            return "cannot retry: a bad notification, not a turn"
        return NOT_KEPT
    try:
        user = validate_user_id(fields.get(b"user", b""))
        kept = msgpack.unpackb(fields[b"turn"], raw=True)
        if not isinstance(kept, dict) or not all(isinstance(k, bytes) and isinstance(v, bytes)
                                                 for k, v in kept.items()):
            return "cannot retry: the kept turn is unreadable"
        turn_id = validate_token(as_str(fields.get(b"turn_id", b"")), "turn id")
        return _rebuilt(user, row_tier, kept, retry_turn_id(turn_id), now)
    except (InvalidId, CodecError, UnicodeDecodeError) as exc:
        return f"cannot retry: {exc}"
    except (ValueError, msgpack.UnpackException):
        return "cannot retry: the kept turn is unreadable"


def _rebuilt(user: str, tier: str, kept: dict[bytes, bytes], turn_id: str, now: float) -> Turn:
    """The kept inbox entry as a new ``Turn`` (binary: the msgpack ``Turn``; plain: ``text``,
    ``tier``, ``meta`` as the worker's intake reads them); raises CodecError as intake would."""
    if b"m" in kept:
        turn = decode(Turn, kept[b"m"])
        if turn.user != user:
            raise CodecError(f"turn is for user {turn.user!r} but was dead-lettered for {user!r}")
        return turn.model_copy(update={"turn_id": turn_id, "ts": now})
    if b"text" not in kept:
        raise CodecError("plain turn has no 'text' field")
    try:
        meta = json.loads(kept[b"meta"]) if b"meta" in kept else {}
    except (ValueError, RecursionError):
        raise CodecError("'meta' is not JSON") from None
    if not isinstance(meta, dict):
        raise CodecError("'meta' must be a JSON object")
    try:
        return Turn(turn_id=turn_id, user=user, tier=kept.get(b"tier", tier.encode()).decode(),
                    text=kept[b"text"].decode(), ts=now, meta=meta, reply_fmt="json")
    except ValueError as exc:  # pydantic's ValidationError: the text over the limit, a bad tier
        raise CodecError(str(exc).splitlines()[0]) from None


@dataclass(frozen=True)
class Retried:
    """What a retry did with one dead-letter id."""

    id: str
    outcome: Literal["retried", "unknown", "not_retriable"]
    reason: str = ""
    user: str = ""
    turn_id: str = ""  # the new turn id: the reply arrives on keys.reply(user, turn_id)
    tier: str = ""  # the tier it was submitted to (the turn's own)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def retry_dead_letters(r: redis.Redis, tier: str, ids: list[str] | None) -> list[Retried]:
    """Re-enqueue the turns of ``tier``'s dead letters ``ids`` (None: all those there when it
    starts, oldest first, a page at a time),
    each for its user, after what the user has queued: a normal submit (stores.submit, so the
    inbox entry precedes its notification, on a Cluster too) under :func:`retry_turn_id`, then
    the dead letter is deleted. The rest are reported (unknown id, not retriable) and kept.

    Idempotent by turn id: a crash (or a Redis error) after the submit and before the delete
    leaves the dead letter in place; retrying it again submits a second copy under the same
    turn id, which the worker answers at most once (the user's done-set: ``turn_commit.lua``
    returns ``dup`` and writes no second reply or session entry), as long as the user has not
    answered ``done_keep`` (1,000) other turns in between. Two operators retrying at once are
    the same case. A submit that fails raises, and the batch's dead letters stay.
    """
    validate_tier(tier)
    if ids is not None:
        return _retry_rows(r, tier, _rows_by_id(r, tier, ids))
    out: list[Retried] = []
    for page in _pages(r, tier):
        out += _retry_rows(r, tier, page)
    return out


def _retry_rows(r: redis.Redis, tier: str, rows: list[tuple[str, Fields | None]]) -> list[Retried]:
    """Retry the rows read (None: an unknown id), ``RETRY_BATCH`` submits at a time; the
    outcomes in the rows' order."""
    now = time.time()
    out: list[Retried] = []
    todo: list[tuple[str, Turn]] = []
    for entry_id, fields in rows:
        if fields is None:
            out.append(Retried(entry_id, "unknown", f"no dead letter {entry_id} in tier {tier}"))
            continue
        turn = retry_turn(tier, fields, now)
        if isinstance(turn, str):
            who = as_str(fields.get(b"user", b""), errors="replace")
            out.append(Retried(entry_id, "not_retriable", turn, who))
        else:
            todo.append((entry_id, turn))
    for start in range(0, len(todo), RETRY_BATCH):
        out += _resubmit(r, tier, todo[start:start + RETRY_BATCH])
    order = {entry_id: i for i, (entry_id, _f) in enumerate(rows)}
    return sorted(out, key=lambda x: order[x.id])


def _resubmit(r: redis.Redis, tier: str, batch: list[tuple[str, Turn]]) -> list[Retried]:
    """Submit a batch's turns in order (one round trip per run of turns of one target tier and
    pool: on a tier with groups, each user's turn goes to the pool of the user's group, as a
    client's submit does), then delete the dead letters of those submitted. A turn of another
    tier that no policy defines any more is not submitted (nothing would serve it there): not
    retriable, and kept."""
    out: list[Retried] = []
    done: list[str] = []
    for target, run in groupby(batch, key=lambda item: item[1].tier):
        items = list(run)
        if target != tier and not tier_defined(target, *read_tier_probe(r, target)[:2]):
            out += [Retried(i, "not_retriable", f"cannot retry: the turn's tier {target!r} is not defined",
                            t.user, tier=target) for i, t in items]
            continue
        opts = read_submit_options(r, target)
        for pool, part in split_by_pool(target, [(t, encode(t), i) for i, t in items], opts):
            submit_turns(r, [(t, payload) for t, payload, _i in part], pool, opts, cluster=is_cluster(r))
            out += [Retried(i, "retried", user=t.user, turn_id=t.turn_id, tier=t.tier) for t, _p, i in part]
            done += [i for _t, _p, i in part]
    if done:
        r.xdel(keys.dead(tier), *done)
    return out


def _rows_by_id(r: redis.Redis, tier: str, ids: list[str]) -> list[tuple[str, Fields | None]]:
    """The entries ``ids`` (each once, in the order given), None for an id not in the stream."""
    wanted = list(dict.fromkeys(validate_dead_letter_id(i) for i in ids))
    if not wanted:
        return []
    pipe = r.pipeline(transaction=False)  # one key: the tier's slot
    for entry_id in wanted:
        pipe.xrange(keys.dead(tier), entry_id, entry_id)
    found = [raw_rows(reply) for reply in pipe.execute()]
    return [(entry_id, got[0][1] if got else None) for entry_id, got in zip(wanted, found, strict=True)]


def _pages(r: redis.Redis, tier: str) -> Iterator[list[tuple[str, Fields | None]]]:
    """The tier's dead letters, oldest first, ``PAGE`` at a time, up to the newest one when the
    walk began: a retried turn that fails again is a new dead letter, left for the next retry
    (else ``--all`` could chase it for ever). Each page is retried before the next is read, so
    memory holds one page, and a page starts after the last id of the one before."""
    tip = raw_rows(r.xrevrange(keys.dead(tier), count=1))
    if not tip:
        return
    last, start = as_str(tip[0][0]), "-"
    while True:
        page = raw_rows(r.xrange(keys.dead(tier), start, last, count=PAGE))
        if page:
            yield [(as_str(i), f) for i, f in page]
        if len(page) < PAGE:
            return
        start = "(" + as_str(page[-1][0])


def purge_dead_letters(r: redis.Redis, tier: str, ids: list[str] | None) -> int:
    """Delete ``tier``'s dead letters ``ids`` (None: all of them); how many were removed."""
    validate_tier(tier)
    if ids is None:
        removed = int(r.xtrim(keys.dead(tier), maxlen=0, approximate=False))
        r.delete(keys.dead_bytes(tier))
        return removed
    rows = [(i, f) for i, f in _rows_by_id(r, tier, ids) if f is not None]
    removed = int(r.xdel(keys.dead(tier), *(i for i, _ in rows))) if rows else 0
    if removed:  # their bytes out of the count (the trim call trims nothing more than it would)
        Function(r, "dead_trim")(keys=_trim_keys(tier),
                                 args=[-sum(entry_bytes(f) for _, f in rows), DEAD_MAXLEN, DEAD_MAX_BYTES])
    return removed
