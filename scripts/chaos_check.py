"""The chaos run's checks and results table (scripts/chaos.py runs the fleet and the faults).

From Redis and the clients' records: I1 (one reply per accepted turn), I2 (sessions in
submission order), the context check (each turn saw every earlier turn), I4 (ledger epochs).
From the workers' handler trace (FLEET_WORKER_HANDLER_TRACE): I3 as real exclusivity — per
user, handler intervals under two different leases must not overlap unless one of them was
fenced (its turn was committed by another worker) — and the takeover time after a worker
SIGKILL or pause. On a Redis Cluster (``chaos --cluster``), ``failover_split`` tells the
anomalies a master failover explains (asynchronous replication) from those it does not.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import redis
from benchlib import percentile
from redis.crc import key_slot

from protocol import keys
from protocol.codec import CodecError, decode
from protocol.models import LedgerEvent, Reply, SessionEntry, Turn

SESSION_MAX, CONTEXT_TURNS = 200, 20  # the worker's defaults (WorkerSettings)
KILLS = ("worker-kill", "drain-kill")  # the faults that SIGKILL a worker


@dataclass
class UserLog:
    sent: list[str] = field(default_factory=list)  # turn ids in submission order (accepted)
    uncertain: set[str] = field(default_factory=set)  # a submit that failed: maybe accepted
    sent_at: dict[str, float] = field(default_factory=dict)  # turn id -> unix time of the submit
    answered: dict[str, float] = field(default_factory=dict)  # turn id -> wait seconds
    errors: Counter[str] = field(default_factory=Counter)  # why submits failed
    unreplicated: set[str] = field(default_factory=set)  # submits whose WAIT came back short
    streamed: bool = False  # a user of chaos --streamed: its turns stream, some are stopped
    texts: dict[str, str] = field(default_factory=dict)  # turn id -> its text (streamed turns)
    cancels: dict[str, str] = field(default_factory=dict)  # turn id -> what its cancel answered


@dataclass(frozen=True)
class Injected:
    """One fault as injected: ``t`` is the kill or SIGSTOP (unix time), ``until`` its SIGCONT."""

    kind: str
    t: float
    until: float
    worker: str = ""


class MasterKill(NamedTuple):
    """One failover of ``chaos --cluster``: the SIGKILL of the master on ``port`` (unix time
    ``t``), its replica on ``promoted_port`` a master at ``promoted`` (None: not within 60 s),
    the killed node back as a replica at ``healed``; ``slots`` the ranges it served; ``lag_s``
    how long its replicas were paused just before the kill (0: they were up to date)."""

    t: float
    promoted: float | None
    port: int
    promoted_port: int | None
    slots: list[tuple[int, int]]
    healed: float | None = None
    lag_s: float = 0.0  # its replicas were paused this long before the kill (--lagging-replica)
    stream_lost: int | None = None  # bytes of replication stream the promoted replica never got

    @property
    def promotion_s(self) -> float | None:
        return None if self.promoted is None else round(self.promoted - self.t, 3)


@dataclass(frozen=True)
class Interval:
    """A handler run: from its entry to its exit (or the kill of its worker)."""

    user: str
    worker: str
    lease: str
    turn: str
    start: float
    end: float
    closed_by: str  # "exit", "kill" (a SIGKILLed worker's open entry), "run end" (never closed)


@dataclass(frozen=True)
class Answer:
    worker: str  # the worker that committed the reply
    ts: float  # when it did (unix time)


# --- I1, I2 and the context check ---------------------------------------------------------------
Answers = dict[tuple[str, str], Answer]  # (user, turn id) -> its reply


def check(r: redis.Redis, logs: dict[str, UserLog],
          detail: dict[str, list[Any]] | None = None) -> tuple[dict[str, object], Answers]:
    """The figures of I1/I2 and the context check, and every turn's (first) reply. ``detail``,
    if given, gets every anomaly (not just the examples): (user, turn) pairs, and for a user
    out of order (user, the first turn where its session differs)."""
    submitted = sum(len(v.sent) - len(v.uncertain) for v in logs.values())
    lost, duplicated, out_of_order, unseen_context = [], [], [], []
    uncut: list[tuple[str, str]] = []  # a stopped turn's session entry not marked cut
    answers: Answers = {}
    for user, log in logs.items():
        session = [decode(SessionEntry, raw) for raw in r.lrange(keys.session(user), 0, -1)]
        ids = [e.turn_id for e in session]
        if len(ids) != len(set(ids)):
            duplicated += [t for t, c in Counter(ids).items() if c > 1]
        pipe = r.pipeline(transaction=False)
        for t in log.sent:
            pipe.lrange(keys.reply(user, t), 0, -1)
        replies_of = dict(zip(log.sent, pipe.execute(), strict=True))
        # what the user's history must be: every accepted turn, and a failed submit only if it
        # was accepted after all (it has a reply); the session keeps the newest SESSION_MAX. A
        # stopped turn is in it only if it had said something (its entry marked cut)
        stopped = _stopped(user, replies_of, session, answers, duplicated, uncut)
        expected = [t for t in log.sent if (t not in log.uncertain or replies_of[t]) and stopped.get(t, "x")]
        if ids != expected[-len(ids):] or len(ids) != min(len(expected), SESSION_MAX):
            out_of_order.append(user)
            if detail is not None:
                detail.setdefault("out_of_order", []).append((user, _first_difference(ids, expected)))
        for i, t in enumerate(expected):
            replies = replies_of[t]
            if not replies:
                lost.append(t)
                _note(detail, "lost", user, t)
                continue
            if len(replies) > 1:
                duplicated.append(t)
            rep = decode(Reply, replies[0])
            answers[(user, t)] = Answer(rep.worker, rep.ts)
            if t not in log.answered and t in log.sent_at:  # the client gave up: the reply came late
                log.answered[t] = max(0.0, rep.ts - log.sent_at[t])
            # each turn saw every earlier one (its context pack holds the last CONTEXT_TURNS)
            if rep.ok and rep.context.get("session_turns") != min(i, CONTEXT_TURNS):
                unseen_context.append(t)
                _note(detail, "context_gaps", user, t)
        for t in dict.fromkeys(t for t in duplicated if t.startswith(f"{user}-")):
            _note(detail, "duplicated", user, t)
    result: dict[str, object] = {
        "submitted": submitted, "answered": len(answers), "lost": len(lost), "duplicated": len(duplicated),
        "out_of_order_users": len(out_of_order), "context_gaps": len(unseen_context),
        "stopped_entries_not_cut": len(uncut),
        "uncertain_submits": sum(len(v.uncertain) for v in logs.values()),
        "submit_errors": dict(sum((v.errors for v in logs.values()), Counter())),
        "examples": {"lost": lost[:5], "duplicated": duplicated[:5], "out_of_order": out_of_order[:5],
                     "context_gaps": unseen_context[:5], "stopped_entries_not_cut": uncut[:5]}}
    return result, answers


def check_streams(r: redis.Redis, logs: dict[str, UserLog],
                  detail: dict[str, list[Any]] | None = None) -> dict[str, object]:
    """The streamed turns of ``chaos --streamed`` against their replies: each stream ends once,
    with its reply's status; what a reader shows (the text after its last restart) is the
    reply's text, or for a stopped turn the start of the turn's text; no chunk of an earlier
    attempt follows a later attempt's restart (a fenced-out worker added nothing); a turn whose
    cancel was recorded is answered ``cancelled``, and only such a turn is."""
    bad: list[tuple[str, str, str]] = []
    turns = cancelled = 0
    outcomes: Counter[str] = Counter()
    for user, log in logs.items():
        if not log.streamed:
            continue
        outcomes.update(log.cancels.values())
        for t in log.sent:
            raw = r.lrange(keys.reply(user, t), 0, 0)
            if not raw:
                continue  # (I1 counts it)
            turns += 1
            rep = decode(Reply, raw[0])
            cancelled += rep.status == "cancelled"
            why = _stream_fault(r.xrange(keys.stream(user, t)), rep, log.texts.get(t, ""), log.cancels.get(t))
            if why:
                bad.append((user, t, why))
                _note(detail, "streams", user, t)
    return {"streamed_turns": turns, "cancelled": cancelled, "cancel_outcomes": dict(outcomes),
            "violations": len(bad), "examples": bad[:5]}


def _stream_fault(entries: list[Any], rep: Reply, text: str, cancel: str | None) -> str:
    """What is wrong with one streamed turn's stream and reply ('' if nothing)."""
    if cancel == "cancelled" and rep.status != "cancelled":
        return f"its cancel was recorded, yet it was answered {rep.status}"
    if rep.status == "cancelled" and cancel not in ("cancelled", "error"):
        return f"answered cancelled, but its cancel answered {cancel}"
    kinds = [fields.get(b"k") for _id, fields in entries]
    if kinds.count(b"end") != 1 or kinds[-1] != b"end":
        return f"{kinds.count(b'end')} 'end' entries, the last entry {kinds[-1] if kinds else None!r}"
    end = entries[-1][1]
    if end.get(b"status", b"").decode() != rep.status:
        return f"the stream ended {end.get(b'status')!r}, the reply is {rep.status}"
    shown, attempt = "", 0
    for _id, fields in entries[:-1]:
        a = int(fields.get(b"a", b"0"))
        if fields.get(b"k") == b"restart":
            shown, attempt = "", max(attempt, a)
        elif a < attempt:
            return f"a chunk of attempt {a} after attempt {attempt}'s restart"
        else:
            shown += fields.get(b"t", b"").decode()
    if rep.status == "ok" and shown != rep.text:
        return f"it shows {shown[:60]!r}, the reply is {rep.text[:60]!r}"
    if rep.status == "cancelled" and not text.startswith(shown):
        return f"a stopped turn shows {shown[:60]!r}, not the start of its text"
    return ""


def _stopped(user: str, replies_of: dict[str, list[bytes]], session: list[SessionEntry], answers: Answers,
             duplicated: list[str], uncut: list[tuple[str, str]]) -> dict[str, str]:
    """The user's turns answered ``cancelled``, with what each said. One that said nothing is
    answered outside the session (counted here); one that said something has a session entry,
    which must be marked cut (``uncut`` gets those that are not)."""
    stopped = {t: decode(Reply, rs[0]).text for t, rs in replies_of.items()
               if rs and decode(Reply, rs[0]).status == "cancelled"}
    uncut.extend((user, e.turn_id) for e in session if e.turn_id in stopped and not e.cut)
    for t in (t for t, said in stopped.items() if not said):
        rep = decode(Reply, replies_of[t][0])
        answers[(user, t)] = Answer(rep.worker, rep.ts)
        duplicated += [t] if len(replies_of[t]) > 1 else []
    return stopped


def _note(detail: dict[str, list[Any]] | None, kind: str, user: str, turn: str) -> None:
    if detail is not None:
        detail.setdefault(kind, []).append((user, turn))


def _first_difference(ids: list[str], expected: list[str]) -> str:
    """The first turn where a session differs from the history it must be: aligned on the
    session's oldest entry (it keeps the newest SESSION_MAX), the turn expected where the
    session holds another or ends (a lost turn missing from it is that turn)."""
    if not ids:
        return expected[0] if expected else ""
    try:
        start = expected.index(ids[0])
    except ValueError:
        return ids[0]
    for j, got in enumerate(ids):
        want = expected[start + j] if start + j < len(expected) else None
        if got != want:
            return want or got
    return expected[start + len(ids)] if start + len(ids) < len(expected) else ids[-1]


def check_epochs(r: redis.Redis) -> tuple[bool, str]:
    holders: dict[int, set[str]] = {}
    last = 0
    monotone = True
    for _id, fields in r.xrange(keys.EVENTS):
        ev = decode(LedgerEvent, fields[b"m"])
        holders.setdefault(ev.epoch, set()).add(ev.commander)
        monotone = monotone and ev.epoch >= last
        last = max(last, ev.epoch)
    shared = {e: c for e, c in holders.items() if len(c) > 1}
    ok = monotone and not shared
    return ok, f"{len(holders)} epochs, monotone={monotone}, shared={shared or 'none'}"


# --- the handler trace ---------------------------------------------------------------------------
def _event(line: str) -> tuple[str, tuple[str, str, str, str], float] | None:
    try:
        ev = json.loads(line)
        return ev["ev"], (ev["user"], ev["worker"], ev["lease"], ev["turn"]), float(ev["t"])
    except (ValueError, KeyError, TypeError):
        return None


class TraceTail:
    """Follows the trace while the run goes on: which workers are inside a handler now."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rest = path, 0, b""
        self.open: Counter[tuple[str, str, str, str]] = Counter()

    def busy_workers(self) -> set[str]:
        if self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = self.rest + f.read()
                self.offset = f.tell()
            *lines, self.rest = data.split(b"\n")
            for line in lines:
                ev = _event(line.decode(errors="replace"))
                if ev is not None:
                    self.open[ev[1]] += 1 if ev[0] == "enter" else -1
        self.open = +self.open  # drops what is closed
        return {key[1] for key in self.open}


def read_trace(path: Path, killed: dict[str, float], end: float) -> tuple[list[Interval], dict[str, int]]:
    """Every handler interval of the run. An entry with no exit ends at its worker's SIGKILL
    (recorded by the run), else at ``end`` (a worker killed by someone else: counted apart)."""
    opened: dict[tuple[str, str, str, str], list[float]] = defaultdict(list)
    out: list[Interval] = []
    stats: Counter[str] = Counter()
    with path.open(errors="replace") as f:
        for line in f:
            ev = _event(line)
            if ev is None:
                stats["unreadable lines"] += 1
            elif ev[0] == "enter":
                opened[ev[1]].append(ev[2])
            elif opened[ev[1]]:
                out.append(Interval(*ev[1], opened[ev[1]].pop(0), ev[2], "exit"))
            else:
                stats["exits without an entry"] += 1
    for key, starts in opened.items():
        for start in starts:
            kill = killed.get(key[1])
            closed = "kill" if kill is not None else "run end"
            out.append(Interval(*key, start, max(start, kill if kill is not None else end), closed))
    stats.update(i.closed_by for i in out)
    return out, dict(stats)


def check_exclusivity(intervals: list[Interval], answers: Answers,
                      detail: dict[str, list[Any]] | None = None) -> dict[str, object]:
    """I3: per user, two handler intervals of different leases that overlap. Allowed (fenced)
    when one of them did not commit its turn (its reply names another worker, or both ran the
    same turn, which only one commit can answer); a violation when both committed theirs."""
    by_user: dict[str, list[Interval]] = defaultdict(list)
    for iv in intervals:
        by_user[iv.user].append(iv)
    overlaps, fenced, violations = 0, [], []

    def own(iv: Interval) -> bool:
        ans = answers.get((iv.user, iv.turn))
        return ans is not None and ans.worker == iv.worker

    for ivs in by_user.values():
        ivs.sort(key=lambda iv: iv.start)
        for i, a in enumerate(ivs):
            for b in ivs[i + 1:]:
                if b.start >= a.end:
                    break
                if b.lease == a.lease:
                    continue
                overlaps += 1
                pair = (f"{a.user}: {a.turn} by {a.lease} [{a.start:.3f}, {a.end:.3f}, {a.closed_by}] "
                        f"and {b.turn} by {b.lease} [{b.start:.3f}, {b.end:.3f}, {b.closed_by}]")
                violation = a.turn != b.turn and own(a) and own(b)
                (violations if violation else fenced).append(pair)
                if violation and detail is not None:
                    detail.setdefault("i3_violations", []).append((a.user, b.start))
    return {"i3_overlaps": overlaps, "i3_violations": len(violations), "i3_fenced": len(fenced),
            "i3_examples": {"violations": violations[:5], "fenced": fenced[:5]}}


# --- waits and takeover ---------------------------------------------------------------------------
def _stats(values: list[float]) -> dict[str, object]:
    if not values:
        return {"n": 0, "p50_s": None, "p99_s": None, "max_s": None}
    return {"n": len(values), "p50_s": round(percentile(values, 50), 3),
            "p99_s": round(percentile(values, 99), 3), "max_s": round(max(values), 3)}


def waits(logs: dict[str, UserLog], start: float, end: float) -> dict[str, object]:
    """Submit -> reply of the turns submitted in the faulty period [start, end] (unix time)."""
    ws = [w for log in logs.values() for t, w in log.answered.items() if start <= log.sent_at[t] <= end]
    return {"longest_wait_s": round(max(ws), 3) if ws else None,
            "p99_wait_s": round(percentile(ws, 99), 3) if ws else None, "waits_counted": len(ws)}


def takeovers(faults: list[Injected], intervals: list[Interval],
              answers: Answers) -> dict[str, dict[str, object]]:
    """For each worker SIGKILL and pause: the users it was inside a handler for at that moment,
    and the time from it to that user's next reply (committed by anyone)."""
    replies: dict[str, list[float]] = defaultdict(list)
    for (user, _turn), ans in answers.items():
        replies[user].append(ans.ts)
    for ts in replies.values():
        ts.sort()
    by_worker: dict[str, list[Interval]] = defaultdict(list)
    for iv in intervals:
        by_worker[iv.worker].append(iv)
    out: dict[str, list[float]] = {"kill": [], "pause": []}
    missing = 0
    for fault in faults:
        row = "kill" if fault.kind in KILLS else "pause" if fault.kind == "worker-pause" else None
        if row is None:
            continue
        users = {iv.user for iv in by_worker[fault.worker] if iv.start <= fault.t <= iv.end}
        for user in users:
            ts = replies[user]
            k = bisect.bisect_right(ts, fault.t)
            if k < len(ts):
                out[row].append(ts[k] - fault.t)
            else:
                missing += 1
    return {"kill": _stats(out["kill"]), "pause": _stats(out["pause"]), "users_never_answered_after": missing}


# --- a Redis Cluster: what a failover explains ---------------------------------------------------------
FAILOVER_BEFORE_S = 10.0  # a turn submitted this long before a master kill may be in flight at it
FAILOVER_AFTER_S = 10.0  # ...and one this long after the promotion may meet what the kill undid
SPLIT_KINDS = ("lost", "duplicated", "out_of_order", "context_gaps", "i3_violations")


def _slot(key: str) -> int:
    return int(key_slot(key.encode()))


def inbox_turns(r: redis.Redis, user: str) -> set[str]:
    """The turn ids still in the user's inbox (a committed turn's entry is deleted)."""
    out = set()
    for _id, fields in r.xrange(keys.inbox(user)):
        try:
            out.add(decode(Turn, fields[b"m"]).turn_id)
        except (CodecError, KeyError):
            continue
    return out


def failover_split(inboxes: dict[str, set[str]], logs: dict[str, UserLog], kills: list[MasterKill],
                   detail: dict[str, list[Any]], epochs_ok: bool, tier: str = "chat") -> dict[str, Any]:
    """Each anomaly of ``detail`` is "across a failover" when the user's slot or the tier's
    (its ready stream and active set: a lost notification) was on a killed master and the turn
    was submitted (an I3 violation: started) from FAILOVER_BEFORE_S before the kill to
    FAILOVER_AFTER_S after the promotion; else "outside". A lost turn whose inbox entry is
    still there is "stranded" (never answered though its data survived: a liveness failure,
    failover or not); one whose entry is gone lost its submit to the failover (or, outside
    one, to a bug). ``inboxes``: the turn ids left in each user's inbox (``inbox_turns``)."""
    shared = {_slot(keys.ready(tier)), _slot(keys.active(tier))}

    def across(user: str, when: float | None) -> bool:
        slots = {_slot(keys.inbox(user)), *shared}
        for k in kills:
            end = (k.promoted or k.healed or k.t) + FAILOVER_AFTER_S
            if when is not None and k.t - FAILOVER_BEFORE_S <= when <= end and any(
                    lo <= slot <= hi for slot in slots for lo, hi in k.slots):
                return True
        return False

    counts = {"across": Counter[str](), "outside": Counter[str]()}
    examples: dict[str, list[str]] = defaultdict(list)
    stranded = []
    lost_acknowledged = []  # lost though the submit's WAIT said a replica had it (replica_acks)
    lost_short = []  # lost after a WAIT that came back short: the master alone had it
    for kind in SPLIT_KINDS:
        for user, what in detail.get(kind, []):
            when = what if isinstance(what, float) else logs[user].sent_at.get(what)
            if kind == "lost" and what in inboxes.get(user, set()):
                stranded.append(what)
                continue
            if kind == "lost":
                (lost_short if what in logs[user].unreplicated else lost_acknowledged).append(what)
            side = "across" if across(user, when) else "outside"
            counts[side][kind] += 1
            if len(examples[f"{side} {kind}"]) < 5:
                examples[f"{side} {kind}"].append(str(what))
    epoch_slots = {_slot(keys.EPOCH), _slot(keys.LEADER), _slot(keys.EVENTS)}
    epochs_hit = any(lo <= slot <= hi for k in kills for slot in epoch_slots for lo, hi in k.slots)
    return {"across": {k: counts["across"][k] for k in SPLIT_KINDS},
            "outside": {k: counts["outside"][k] for k in SPLIT_KINDS},
            "stranded": len(stranded), "stranded_examples": stranded[:5], "examples": dict(examples),
            "lost_with_short_wait": len(lost_short),
            "lost_acknowledged": len(lost_acknowledged), "lost_acknowledged_examples": lost_acknowledged[:5],
            "short_submit_waits": sum(len(log.unreplicated) for log in logs.values()),
            "epochs_shared_across_failover": (not epochs_ok) and epochs_hit,
            "window_s": [FAILOVER_BEFORE_S, FAILOVER_AFTER_S]}


def on_master(kill: MasterKill, users: list[str], tier: str = "chat") -> dict[str, object]:
    """What the killed master held: how many of the users' slots, and the tier's keys or not."""
    def held(key: str) -> bool:
        return any(lo <= _slot(key) <= hi for lo, hi in kill.slots)

    return {"users_on_it": sum(held(keys.inbox(u)) for u in users),
            "tier_keys_on_it": held(keys.ready(tier)) or held(keys.active(tier))}


def cluster_failures(res: dict[str, Any], split: dict[str, Any],
                     epochs_ok: bool) -> tuple[list[str], list[str]]:
    """(what fails the run, what a failover explains: expected without WAIT). Must hold across
    a failover: liveness (no stranded turn), every invariant outside a failover's window and
    shard, I6 (no orphan, no double spawn, drains obeyed)."""
    out = split["outside"]
    fails = failures({**res, "lost": out["lost"], "duplicated": out["duplicated"],
                      "out_of_order_users": out["out_of_order"], "context_gaps": out["context_gaps"],
                      "i3_violations": out["i3_violations"]},
                     epochs_ok or split["epochs_shared_across_failover"])
    if res.get("replica_acks") and split["lost_acknowledged"]:
        fails.append(f"I1 {split['lost_acknowledged']} turns lost although their submit's WAIT was "
                     f"acknowledged by a replica (e.g. {split['lost_acknowledged_examples']})")
    if split["stranded"]:
        fails.append(f"liveness: {split['stranded']} turns never answered though their inbox entry survived "
                     f"(e.g. {split['stranded_examples']})")
    names = {"lost": "I1 turns lost (their submit did not survive the failover)",
             "duplicated": "I1 duplicated replies or session entries",
             "out_of_order": "I2 users out of order", "context_gaps": "I3 context gaps",
             "i3_violations": "I3 two leases committed at once"}
    expected = [f"{names[k]}: {n}" for k, n in split["across"].items() if n]
    if split["epochs_shared_across_failover"]:
        expected.append("I4 two commanders in one epoch (the epoch's master was failed over)")
    return fails, expected


# --- the verdict and the table ----------------------------------------------------------------------
def failures(res: dict[str, object], epochs_ok: bool) -> list[str]:
    fails = []
    if res["lost"]:
        fails.append("I1/I5 lost turns")
    if res["duplicated"]:
        fails.append("I1 duplicated replies or session entries")
    if res["out_of_order_users"]:
        fails.append("I2 sessions out of submission order")
    if res["context_gaps"]:
        fails.append("I3 a turn did not see every earlier turn of its user")
    fails += _stream_failures(res)
    if res["i3_violations"]:
        fails.append("I3 two workers ran and committed turns of one user at the same time")
    if res["answered"] and not dict(res["trace"]).get("exit"):  # type: ignore[call-overload]
        fails.append("I3 not checked: the workers wrote no handler trace")
    if not epochs_ok:
        fails.append("I4 two commanders in one epoch, or epochs going back")
    if res["orphans"]:
        fails.append("I6 orphan processes")
    if res.get("acl_denials"):
        fails.append(f"a Fleet role refused by the ACL (a right it lacks): {res['acl_denials'][:5]}")
    if res.get("drains_ignored"):
        fails.append(f"I6 workers told to drain kept serving: {res['drains_ignored']}")
    if int(res["max_live_workers"]) > int(res["max_workers"]):  # type: ignore[call-overload]
        fails.append(f"I6 more live workers than max_workers (double spawn): {res.get('workers_at_max')}; "
                     f"faults in the 30 s before: {res.get('faults_before_max')}")
    return fails


def _stream_failures(res: dict[str, object]) -> list[str]:
    fails = []
    if res.get("stopped_entries_not_cut"):
        fails.append("a stopped turn's session entry not marked cut")
    streams = res.get("streams")
    if isinstance(streams, dict) and streams["violations"]:
        fails.append(f"streamed turns: {streams['examples']}")
    return fails


def _s(v: object) -> str:
    return "-" if v is None else f"{v} s"


def table(res: dict[str, object]) -> None:
    take: dict[str, dict[str, object]] = res["takeover"]  # type: ignore[assignment]
    trace: dict[str, int] = res["trace"]  # type: ignore[assignment]
    rows = [("turns submitted (accepted)", res["submitted"]), ("answered", res["answered"]),
            ("lost", res["lost"]), ("duplicated", res["duplicated"]),
            ("users out of order", res["out_of_order_users"]),
            ("context gaps (a turn missed an earlier one)", res["context_gaps"]),
            ("I3 overlaps of two leases on one user", f"{res['i3_overlaps']} (violations "
             f"{res['i3_violations']}, fenced {res['i3_fenced']})"),
            ("handler intervals traced", f"{sum(trace.get(k, 0) for k in ('exit', 'kill', 'run end'))} "
             f"(closed at a kill {trace.get('kill', 0)}, never closed {trace.get('run end', 0)})"),
            ("submits given up (maybe accepted)", res["uncertain_submits"]),
            ("submit errors retried with the same turn id", res["submit_errors"]),
            (f"longest wait, faulty period ({res['waits_counted']} turns)", _s(res["longest_wait_s"])),
            ("p99 wait, faulty period", _s(res["p99_wait_s"]))]
    for row, what in (("kill", "worker SIGKILL"), ("pause", "worker pause")):
        t = take[row]
        rows.append((f"takeover after a {what} p50 / p99 ({t['n']} users)",
                     f"{_s(t['p50_s'])} / {_s(t['p99_s'])} (max {_s(t['max_s'])})"))
    quota: dict[str, int] = res["quota"]  # type: ignore[assignment]
    faults: dict[str, int] = res["faults"]  # type: ignore[assignment]
    rows += [(f"faults: {k}", f"{faults.get(k, 0)} (quota {q})") for k, q in quota.items()]
    rows += [(f"faults: {k}", n) for k, n in sorted(faults.items()) if k not in quota]
    rows += [("ledger epochs", res["epochs"]), ("max live workers / max_workers",
                                                f"{res['max_live_workers']} / {res['max_workers']} "
                                                f"({res.get('max_running_workers', '?')} with the draining)"),
             ("orphan processes after shutdown", res["orphans"]),
             ("ACL refusals of a Fleet role", len(res.get("acl_denials", [])))]
    streams = res.get("streams")
    if isinstance(streams, dict):
        rows += [("streamed turns (cancelled)", f"{streams['streamed_turns']} ({streams['cancelled']})"),
                 ("cancels: what they answered", streams["cancel_outcomes"]),
                 ("streams at odds with their reply", streams["violations"]),
                 ("stopped turns' session entries not cut", res.get("stopped_entries_not_cut", 0))]
    rows += _cluster_rows(res)
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if res["fault_errors"]:
        print("faults not injected: " + "; ".join(res["fault_errors"]))  # type: ignore[arg-type]
    if res["quota_missed"]:
        print("QUOTAS MISSED: " + ", ".join(res["quota_missed"]))  # type: ignore[arg-type]
    if "failover" in res:
        expected = res["expected_across_failover"]
        print("ACROSS A FAILOVER (expected without WAIT): "
              + ("nothing" if not expected else "; ".join(expected)))
    fails = res["invariants_failed"]
    print("INVARIANTS: " + ("all hold" if not fails else "FAILED: " + "; ".join(fails)))  # type: ignore[arg-type]


def _cluster_rows(res: dict[str, Any]) -> list[tuple[str, object]]:
    if "failover" not in res:
        return []
    split = res["failover"]
    rows: list[tuple[str, object]] = [("redis", f"cluster 3 masters + 3 replicas, replica_acks "
                                                f"{res.get('replica_acks')}")]
    for i, k in enumerate(res["master_kills"], 1):
        lag = f", replica lagging {k['lag_s']:.1f} s" if k.get("lag_s") else ""
        if k.get("stream_lost") is not None:
            lag += f", replication stream lost >= {k['stream_lost']} B"
        rows.append((f"master kill {i}", f"port {k['port']} -> replica {k['promoted_port']} promoted "
                                         f"in {_s(k['promotion_s'])}, healed {_s(k['healed_s'])} after "
                                         f"(held {k.get('users_on_it')} users"
                                         f"{lag}"
                                         f"{', the tier keys' if k.get('tier_keys_on_it') else ''})"))
    rows.append(("master pauses failed over all the same", res.get("failovers_in_pauses", 0)))
    for kind in SPLIT_KINDS:
        rows.append((f"{kind}: across a failover / outside",
                     f"{split['across'][kind]} / {split['outside'][kind]}"))
    rows.append(("stranded (inbox entry kept, never answered)", split["stranded"]))
    if res.get("replica_acks"):
        rows.append(("submits whose WAIT came back short", split["short_submit_waits"]))
        rows.append(("lost: WAIT acknowledged / WAIT short",
                     f"{split['lost_acknowledged']} / {split['lost_with_short_wait']}"))
    return rows
