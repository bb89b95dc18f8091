"""The invariants, checked from the store and the record after every schedule.

- **I1** every accepted turn has exactly one reply (ok or error); a turn for a tier that
  runs nowhere is answered with an error once a worker of the user's tier meets it;
- **I2** per user, the session holds each ok turn exactly once, in submission order (and a
  cancelled turn that had streamed text at most once, marked cut, in its place), and the
  handler of each committed turn saw exactly the turns before it;
- **I3** no two workers inside a handler for one user at once, unless the later one's
  write was fenced (only one of two overlapping runs committed);
- **liveness**: every accepted turn is answered within ``bound_s`` of virtual time after
  it was accepted or after the last fault ended, whichever is later; and no turn waits
  longer than ``starve_bound_s`` in all with nobody serving its user while a worker has a
  free slot (the world samples that as it runs);
- **stop**: a worker sent SIGTERM stops within ``stop_bound_s``;
- **zombie**: a worker whose lane was lost stops the handler it runs under it within
  ``zombie_bound_s`` (it learns of the loss at its next renewal), unless it was paused;
- **cancel**: a turn whose cancel was recorded is never answered ``ok`` (its one reply is
  ``cancelled``), and only a cancelled turn is answered ``cancelled``;
- **deadline**: no handler run of a turn starts after its deadline, and only a turn with a
  deadline is answered ``expired``, after it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import fakeredis

from protocol import keys
from protocol.codec import CodecError, as_str, decode
from protocol.models import Reply, SessionEntry
from sim.clock import EPOCH
from sim.world import GHOST, WORKER_TIMING, Call, Record, Submitted
from stores.replies import bytes_list, raw_rows
from worker.app import DEREGISTER_UNSTARTED_S

# SIGTERM -> stopped, for a worker that serves nothing yet: its start cancelled, then at most
# DEREGISTER_UNSTARTED_S to leave the registry (a command on a connection the cancellation broke
# retries on a new one), and the exit
STARTING_STOP_S = DEREGISTER_UNSTARTED_S + 0.5
CONTEXT_TURNS = 20  # WorkerSettings.context_turns: how much of the session a handler sees


@dataclass(frozen=True)
class Violation:
    kind: str  # I1 | I2 | I3 | liveness | stop | zombie | cancel | deadline
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def _replies(r: fakeredis.FakeRedis, sub: Submitted) -> list[Reply]:
    out = []
    for raw in bytes_list(r.lrange(keys.reply(sub.user, sub.turn), 0, -1)):
        try:
            out.append(Reply.model_validate_json(raw) if raw[:1] == b"{" else decode(Reply, raw))
        except (CodecError, ValueError):
            out.append(Reply(turn_id=sub.turn, user=sub.user, ok=False, error="undecodable reply"))
    return out


def _must_answer(sub: Submitted, turns: list[Submitted]) -> bool:
    """A chat turn always; a ghost turn only if a later turn of the user's tier meets it."""
    if sub.accepted is None:
        return False
    if sub.tier != GHOST:
        return True
    return any(t.user == sub.user and t.index > sub.index and t.tier != GHOST and t.accepted is not None
               for t in turns)


def check(r: fakeredis.FakeRedis, record: Record, *, bound_s: float, stop_bound_s: float,
          zombie_bound_s: float, starve_bound_s: float, end: float) -> list[Violation]:
    """Every violation of the invariants in this schedule (empty: it held)."""
    replies = {(s.user, s.turn): _replies(r, s) for s in record.turns}
    out: list[Violation] = []
    out += _i1(record, replies)
    out += _i2(r, record, replies)
    out += _i3(record)
    out += [v for s in record.turns if s.tier != GHOST for v in _stream(r, s, replies[(s.user, s.turn)])]
    out += _ends(record, replies)
    out += _liveness(record, replies, bound_s, end)
    out += _stops(record, stop_bound_s, end)
    out += _zombies(record, zombie_bound_s, end)
    out += [Violation("liveness", f"turn {turn} waited {s:.2f}s with nobody serving its user while a "
                                  f"worker had a free slot (bound {starve_bound_s}s)")
            for turn, s in record.starved.items() if s > starve_bound_s]
    return out


def _stream(r: fakeredis.FakeRedis, sub: Submitted, replies: list[Reply]) -> list[Violation]:
    """A streamed turn's reply stream (empty for a turn not streamed): each chunk is of the
    attempt the last ``restart`` started (1 before any), so none comes from a worker that lost
    the lane; one ``end``, last, once the turn is answered, with its reply's status; and the text
    after the last ``restart`` is the ok reply's."""
    rows = [(entry, {as_str(k): as_str(v) for k, v in fields.items()})
            for entry, fields in raw_rows(r.xrange(keys.stream(sub.user, sub.turn)))]
    out, attempt, text, ends = [], 1, "", 0
    for entry, f in rows:
        if ends:
            out.append(Violation("stream", f"turn {sub.turn}: entry {as_str(entry)} {f} after its end"))
        if f.get("k") == "restart":
            attempt, text = max(attempt, int(f["a"])), ""
        elif f.get("k") == "chunk":
            if int(f["a"]) != attempt:
                out.append(Violation("stream", f"turn {sub.turn}: a chunk of attempt {f['a']} ({f['t']}) "
                                               f"where attempt {attempt}'s text goes"))
            text += f["t"]
        elif f.get("k") == "end":
            ends += 1
    ok = [rep for rep in replies if rep.ok]
    if rows and replies and ends != 1:
        out.append(Violation("stream", f"turn {sub.turn} is answered and its stream has {ends} ends"))
    if rows and ok and text != ok[0].text:
        out.append(Violation("stream", f"turn {sub.turn}: the stream's text {text!r} is not the reply's "
                                       f"{ok[0].text!r}"))
    return out


def _i1(record: Record, replies: dict[tuple[str, str], list[Reply]]) -> list[Violation]:
    out = []
    for sub in record.turns:
        got = replies[(sub.user, sub.turn)]
        if len(got) > 1:
            out.append(Violation("I1", f"turn {sub.turn} got {len(got)} replies"))
        elif not got and _must_answer(sub, record.turns):
            out.append(Violation("I1", f"turn {sub.turn} ({sub.tier}) was accepted and never answered"))
        elif got and sub.tier == GHOST and got[0].ok:
            out.append(Violation("I1", f"turn {sub.turn} for tier {GHOST!r} got an ok reply"))
    return out


Replies = dict[tuple[str, str], list[Reply]]


def _i2(r: fakeredis.FakeRedis, record: Record, replies: Replies) -> list[Violation]:
    out = []
    by_user: dict[str, list[Submitted]] = defaultdict(list)
    for sub in record.turns:
        by_user[sub.user].append(sub)
    for user, subs in by_user.items():
        ordered = sorted(subs, key=lambda s: s.index)
        ok = [s.turn for s in ordered if any(rep.ok for rep in replies[(user, s.turn)])]
        try:
            entries = [decode(SessionEntry, e) for e in bytes_list(r.lrange(keys.session(user), 0, -1))]
        except CodecError as exc:
            out.append(Violation("I2", f"session of {user} does not decode: {exc}"))
            continue
        session = [e.turn_id for e in entries]
        if [e.turn_id for e in entries if not e.cut] != ok:
            out.append(Violation("I2", f"session of {user} is {session}, the ok turns in order are {ok}"))
        # a cancelled turn that had streamed text is in it once, marked cut, in its place
        for e in entries:
            if e.cut and not any(rep.status == "cancelled" for rep in replies[(user, e.turn_id)]):
                out.append(Violation("I2", f"turn {e.turn_id} of {user} is in the session as cut, "
                                           f"and was not answered cancelled"))
        if session != [s.turn for s in ordered if s.turn in session] or len(set(session)) != len(session):
            out.append(Violation("I2", f"session of {user} is {session}: not once each, in submission order"))
        out += _context_seen(user, session, ok, record)
    return out


def _ends(record: Record, replies: Replies) -> list[Violation]:
    """Stop and deadlines. A turn whose cancel was recorded is answered ``cancelled`` or not at
    all, never ``ok``; a ``cancelled`` reply needs a cancel. No handler run of a turn starts
    after its deadline; an ``expired`` reply needs a deadline, and comes after it."""
    out = []
    for sub in record.turns:
        got = [rep.status for rep in replies[(sub.user, sub.turn)]]
        if sub.cancelled == "cancelled" and any(status != "cancelled" for status in got):
            out.append(Violation("cancel", f"turn {sub.turn} was cancelled and answered {got}"))
        if sub.cancelled is None and "cancelled" in got:
            out.append(Violation("cancel", f"turn {sub.turn} was answered cancelled and nobody cancelled it"))
        deadline = sub.deadline
        if deadline is None:
            if "expired" in got:
                out.append(Violation("deadline", f"turn {sub.turn} has no deadline and was answered expired"))
            continue
        late = [c.enter for c in record.calls
                if c.user == sub.user and c.turn == sub.turn and c.enter > deadline]
        if late:
            out.append(Violation("deadline", f"turn {sub.turn}'s handler started at {late[0]:.3f}s, "
                                             f"after its deadline {deadline:.3f}s"))
        early = [rep.ts - EPOCH for rep in replies[(sub.user, sub.turn)]
                 if rep.status == "expired" and rep.ts - EPOCH < deadline]
        if early:
            out.append(Violation("deadline", f"turn {sub.turn} was answered expired at {early[0]:.3f}s, "
                                             f"before its deadline {deadline:.3f}s"))
    return out


def _committed(calls: list[Call], record: Record) -> list[Call]:
    """The handler runs whose result was written: for each write-back that landed, the last run
    of its (lease, turn) that had ended by then (a commit carries a result, so it comes after its
    run). A worker that stopped a turn whose commit was on its way runs it again under its own
    lease: the write that lands later is the first run's, not the second's."""
    runs: dict[tuple[str, str], list[Call]] = defaultdict(list)
    for call in calls:
        runs[(call.lease, call.turn)].append(call)
    out: dict[int, Call] = {}
    for key, landed in record.commits.items():
        candidates = runs.get(key, [])
        for at in landed if candidates else []:
            ended = [c for c in candidates if c.exit is not None and c.exit <= at]
            call = (ended or candidates)[-1]
            out[id(call)] = call
    return list(out.values())


def _context_seen(user: str, session: list[str], ok: list[str], record: Record) -> list[Violation]:
    """Each ok turn's handler saw the session's turns before it (cut ones included)."""
    out = []
    for call in _committed([c for c in record.calls if c.user == user], record):
        if call.turn not in ok:  # answered another way (cancelled, an error): no context to judge
            continue
        before = session[: session.index(call.turn)]
        if call.seen != before[-CONTEXT_TURNS:]:
            out.append(Violation("I2", f"turn {call.turn} of {user} saw the session {call.seen}, "
                                       f"not the turns before it {before[-CONTEXT_TURNS:]}"))
    return out


def _i3(record: Record) -> list[Violation]:
    """Two committed handler runs of one user under different leases must not overlap."""
    out = []
    by_user: dict[str, list[Call]] = defaultdict(list)
    for call in _committed(record.calls, record):
        by_user[call.user].append(call)
    for user, calls in by_user.items():
        calls.sort(key=lambda c: c.enter)
        latest: Call | None = None  # the committed run that ends last among those started so far
        for b in calls:
            if latest is not None and b.enter < _end(latest, record) and latest.lease != b.lease:
                a = latest
                out.append(Violation("I3", f"{user}: {a.worker} ({a.lease}) ran {a.turn} until "
                                           f"{_end(a, record):.3f}s while {b.worker} ({b.lease}) ran "
                                           f"{b.turn} from {b.enter:.3f}s; both committed"))
            if latest is None or _end(b, record) > _end(latest, record):
                latest = b
    return out


def _end(call: Call, record: Record) -> float:
    return call.exit if call.exit is not None else record.killed.get(call.worker, float("inf"))


def _answered_at(got: list[Reply]) -> float | None:
    return got[0].ts - EPOCH if got else None


def _liveness(record: Record, replies: dict[tuple[str, str], list[Reply]], bound_s: float,
              end: float) -> list[Violation]:
    out = []
    for sub in record.turns:
        if not _must_answer(sub, record.turns) or sub.accepted is None:
            continue
        since = max(sub.accepted, record.fault_end)
        at = _answered_at(replies[(sub.user, sub.turn)])
        waited = (at if at is not None else end) - since
        if waited > bound_s:
            state = f"answered at {at:.3f}s" if at is not None else "never answered"
            out.append(Violation("liveness", f"turn {sub.turn} accepted at {sub.accepted:.3f}s, {state}: "
                                             f"{waited:.2f}s after the faults ended (bound {bound_s}s)"))
    return out


def _stops(record: Record, bound_s: float, end: float) -> list[Violation]:
    """A worker that has not started stops at once on SIGTERM, Redis or not (it has nothing
    to finish); a serving one within ``bound_s``, not counting time Redis was away. Time the
    worker spent paused does not count either way (a stopped process reads no signal)."""
    out = []
    for wid, at in record.terminated.items():
        if wid in record.killed:
            continue
        stopped = record.stopped.get(wid)
        until = stopped if stopped is not None else end
        starting = wid in record.terminated_starting
        away = sum(max(0.0, min(b, until) - max(a, at)) for w, a, b in record.paused if w == wid)
        if not starting:
            away += sum(max(0.0, min(b, until) - max(a, at)) for a, b in record.outages)
        limit = STARTING_STOP_S if starting else bound_s
        if until - at - away > limit:
            state = f"stopped after {until - at:.2f}s" if stopped is not None else "never stopped"
            what = "before it had started" if starting else "while serving"
            out.append(Violation("stop", f"worker {wid} got SIGTERM at {at:.3f}s {what} and {state}"))
    return out


def _zombies(record: Record, bound_s: float, end: float) -> list[Violation]:
    out = []
    for at, user, lease in record.expired:
        for call in record.calls:
            if call.user != user or call.lease != lease or call.enter > at:
                continue
            stopped = call.exit if call.exit is not None else record.killed.get(call.worker, end)
            paused = any(w == call.worker and start < stopped and until > at
                         for w, start, until in record.paused)
            # with Redis away the worker cannot hear of the loss: it must assume it at the TTL
            blind = any(a < stopped and b > at for a, b in record.outages)
            limit = bound_s + WORKER_TIMING["lane_ttl_ms"] / 1000 if blind else bound_s
            if stopped - at > limit and not paused:
                what = f"{call.worker} ran {call.turn} of {user} until {stopped:.3f}s"
                out.append(Violation("zombie", f"{what}, {stopped - at:.2f}s after its lane {lease} ended"))
    return out


def waits(record: Record, r: fakeredis.FakeRedis) -> list[float]:
    """Accepted → answered, per answered turn (virtual seconds)."""
    out = []
    for sub in record.turns:
        got = _replies(r, sub)
        if got and sub.accepted is not None:
            out.append(got[0].ts - EPOCH - sub.accepted)
    return out
