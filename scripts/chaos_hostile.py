"""``chaos --hostile``: bad shared state injected during the load, and how each injection was answered.

At moments drawn from the run's seed (:func:`plan`), the :class:`Injector` writes what an
operator's typo or a foreign client could leave in Redis:

- ``bad-tier``: members no tier can have in ``fleet:tiers`` ("Bad Tier!", a non-UTF-8 one);
- ``bad-registry``: registry entries (``fleet:workers``) with an invalid id, or a valid id and
  a value that is no ``WorkerInfo``;
- ``wrong-type``: one of a dedicated user's keys (session, memory, profile, usage, done) set to
  a string, then a turn of that user submitted: it must get an error reply or a dead letter;
- ``poison``: a notification on the tier's ready stream for a user whose inbox (or state) is a
  string, or naming an invalid user id: it must be dead-lettered (``delivery_limit`` /
  ``bad_notification``).

The bad tier members and registry entries are removed at the end (:func:`clean_up`). The
hostile users are none of the load's users, so the load's invariants are checked without them.
:func:`outcomes` reads how each injection was answered, :func:`unexpected_exits` which Fleet
process exited on its own, :func:`section` puts both together with a verdict.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

from fleet.client import Fleet
from protocol import keys
from protocol.codec import decode
from protocol.models import LedgerEvent, Reply
from stores.deadletters import dead_letter_rows
from stores.ledger import EVENTS_MAXLEN, events_since
from stores.retry import TRANSIENT

TIER = "chat"
# a user's key -> how it is named; each is set to a string for one hostile user
WRONG_TYPE_KEYS: dict[str, Callable[[str], str]] = {
    "session": keys.session, "memory": keys.memory, "profile": keys.profile, "usage": keys.usage,
    "done": keys.done}
POISON_KEYS: dict[str, Callable[[str], str]] = {"inbox": keys.inbox, "state": keys.state}
BAD_TIERS: tuple[bytes, ...] = (b"Bad Tier!", b"\xff\xfe-tier")
BAD_WORKERS: dict[bytes, bytes] = {b"bad worker!": b"garbage", b"hostile-w1": b"\x00not a WorkerInfo"}
BAD_USER_IDS = ("Bad User! 0", "no/such:user")  # notifications naming no valid user
START_S = 5.0  # no injection before the fleet settled
ANSWER_ROOM_S = 20.0  # nor in the last seconds of the load: room for a delivery limit to be reached
DEAD_SCAN = 20_000  # dead letters of the tier read to find the injections' own
_EXIT = re.compile(r"^worker (\S+) exited (?:with )?\(?code (-?\d+)")


@dataclass(frozen=True)
class Injection:
    """One planned injection: ``at_s`` seconds after the load started, of ``kind`` on ``target``
    (a tier member, a registry field, or a hostile user), ``what`` its variant (the key made the
    wrong type; for ``poison`` the user's key or "invalid user")."""

    at_s: float
    kind: str  # "bad-tier", "bad-registry", "wrong-type", "poison"
    target: str
    what: str = ""


def plan(seed: int, seconds: float) -> list[Injection]:
    """Every injection of a run of ``seconds``, at times drawn from ``seed`` (pure: one seed, one
    plan), in time order. The fault schedule's generator is not used, so ``--hostile`` leaves
    the faults of a seed as they were."""
    rng = random.Random(f"hostile:{seed}")
    end = max(START_S + 1.0, seconds - ANSWER_ROOM_S)
    out = [Injection(0.0, "bad-tier", m.decode(errors="backslashreplace")) for m in BAD_TIERS]
    out += [Injection(0.0, "bad-registry", w.decode(errors="backslashreplace")) for w in BAD_WORKERS]
    out += [Injection(0.0, "wrong-type", f"h{i}", role) for i, role in enumerate(WRONG_TYPE_KEYS)]
    out += [Injection(0.0, "poison", f"p{i}", role) for i, role in enumerate(POISON_KEYS)]
    out += [Injection(0.0, "poison", user, "invalid user") for user in BAD_USER_IDS]
    timed = [Injection(round(rng.uniform(START_S, end), 3), i.kind, i.target, i.what) for i in out]
    return sorted(timed, key=lambda i: (i.at_s, i.kind, i.target))


def expects_answer(injection: Injection) -> bool:
    """Whether the fleet owes the injection an answer (a turn or a notification)."""
    return injection.kind in ("wrong-type", "poison")


@dataclass
class Injector:
    """Writes the planned injections at their times (admin client ``r``; turns submitted by
    ``fleet``, the client's role). An injection Redis refuses for a while (a restart, a pause)
    is tried again; one that cannot be written is reported in ``errors``."""

    injections: list[Injection]
    r: redis.Redis
    fleet: Fleet
    done: list[Injection] = field(default_factory=list)  # written, in order
    turns: dict[str, str] = field(default_factory=dict)  # hostile user -> the turn id submitted
    errors: list[str] = field(default_factory=list)

    def run(self, stop: threading.Event, started: float) -> None:
        """Inject each at ``started`` (monotonic) + its ``at_s``, until ``stop``."""
        for injection in self.injections:
            if stop.wait(max(0.0, started + injection.at_s - time.monotonic())):
                return
            try:
                _retrying(lambda injection=injection: self.inject(injection))  # type: ignore[misc]
                self.done.append(injection)
            except Exception as exc:  # noqa: BLE001 - an injection not written is reported, not fatal
                self.errors.append(f"{injection.kind} {injection.target}: {type(exc).__name__}: {exc}")

    def inject(self, injection: Injection) -> None:
        if injection.kind == "bad-tier":
            self.r.sadd(keys.TIERS, _raw(injection.target, BAD_TIERS))
        elif injection.kind == "bad-registry":
            member = _raw(injection.target, BAD_WORKERS)
            self.r.hset(keys.WORKERS, member, BAD_WORKERS[member])
        elif injection.kind == "wrong-type":
            self.r.set(WRONG_TYPE_KEYS[injection.what](injection.target), "hostile")
            turn_id = f"{injection.target}-0"
            self.fleet.submit(injection.target, "a turn of a user with bad data", tier=TIER, turn_id=turn_id)
            self.turns[injection.target] = turn_id
        elif injection.what in POISON_KEYS:
            self.r.set(POISON_KEYS[injection.what](injection.target), "hostile")
            self.r.xadd(keys.ready(TIER), {"user": injection.target})
        else:
            self.r.xadd(keys.ready(TIER), {"user": injection.target})


def _raw(shown: str, members: Iterable[bytes]) -> bytes:
    """The member an injection's target names (targets are shown with non-UTF-8 escaped)."""
    return next(m for m in members if m.decode(errors="backslashreplace") == shown)


def _retrying(write: Callable[[], Any], attempts: int = 40) -> None:
    for attempt in range(attempts):
        try:
            write()
            return
        except TRANSIENT:
            if attempt == attempts - 1:
                raise
            time.sleep(min(1.0, 0.05 * 2 ** attempt))


def clean_up(r: redis.Redis) -> None:
    """Remove the bad tier members and registry entries (the users' bad keys stay: their turns
    were answered)."""
    r.srem(keys.TIERS, *BAD_TIERS)
    r.hdel(keys.WORKERS, *BAD_WORKERS)


# --- how each injection was answered -------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """How the fleet answered one injection that owes an answer."""

    injection: Injection
    error_reply: bool = False  # (a turn) its reply is an error
    ok_reply: bool = False  # (a turn) its reply is a success: the bad key did not bite
    dead_letter: str = ""  # the kind of its dead letter, if any

    @property
    def answered(self) -> bool:
        return self.error_reply or self.ok_reply or bool(self.dead_letter)


def outcomes(r: redis.Redis, done: list[Injection], turns: dict[str, str]) -> list[Outcome]:
    """How each written injection that owes an answer was answered, read from Redis: a turn by
    its reply and its user's ``user_data`` dead letter, a poison notification by a dead letter
    naming its user (``delivery_limit`` or ``bad_notification``: a takeover re-posts a
    notification under a new id, so the id cannot tell)."""
    dead: dict[str, set[str]] = {}
    for row in dead_letter_rows(r, TIER, DEAD_SCAN):
        dead.setdefault(row.user, set()).add(row.kind)
    out = []
    for injection in filter(expects_answer, done):
        kinds = dead.get(injection.target, set())
        if injection.kind == "wrong-type":
            raw = r.lrange(keys.reply(injection.target, turns[injection.target]), 0, -1)
            replies = [decode(Reply, one if isinstance(one, bytes) else one.encode()) for one in raw]
            kind = "user_data" if "user_data" in kinds else ""
            out.append(Outcome(injection, error_reply=any(not x.ok for x in replies),
                               ok_reply=any(x.ok for x in replies), dead_letter=kind))
        else:
            kind = next((k for k in ("delivery_limit", "bad_notification") if k in kinds), "")
            out.append(Outcome(injection, dead_letter=kind))
    return out


def wait_answered(read: Callable[[], list[Outcome]], grace_s: float,
                  sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic) -> list[Outcome]:
    """``read()`` until every outcome is answered, or ``grace_s`` passed: the last reading."""
    deadline = clock() + grace_s
    while True:
        try:
            got = read()
        except TRANSIENT:
            got = []
        if (got and all(o.answered for o in got)) or clock() >= deadline:
            return got
        sleep(0.5)


def worker_exits(events: Iterable[LedgerEvent]) -> list[tuple[str, int]]:
    """Each worker exit with a code the ledger records, as ``(worker, code)`` (an exit known by
    its expired heartbeat, or a kill by the commander, has none)."""
    found = (_EXIT.match(e.reason) for e in events if e.action == "worker-exited")
    return [(m[1], int(m[2])) for m in found if m]


def unexpected_exits(exits: Iterable[tuple[str, int]], killed: Iterable[str]) -> list[str]:
    """The exits with a failure code of workers chaos did not kill."""
    mine = set(killed)
    return [f"worker {w} exited (code {code})" for w, code in exits if code != 0 and w not in mine]


def ledger_events(r: redis.Redis) -> list[LedgerEvent]:
    """Every readable entry of the run's ledger, oldest first."""
    return [e for _id, e in events_since(r, 0.0, limit=EVENTS_MAXLEN) if isinstance(e, LedgerEvent)]


# --- the section of the results ----------------------------------------------------------------
def section(planned: list[Injection], done: list[Injection], answers: list[Outcome],
            exits: list[str], errors: list[str], exits_read: int = 0) -> dict[str, Any]:
    """The results' ``hostile`` section (plain data), its verdict in ``failed``; ``exits_read``:
    the worker exits with a code the ledger recorded (the ones ``exits`` was chosen from)."""
    turns = [o for o in answers if o.injection.kind == "wrong-type"]
    notes = [o for o in answers if o.injection.kind == "poison"]
    res: dict[str, Any] = {
        "planned": len(planned), "injected": len(done),
        "state_entries": sum(not expects_answer(i) for i in done),
        "turns": {"injected": len(turns), "error_reply": sum(o.error_reply for o in turns),
                  "dead_lettered": sum(bool(o.dead_letter) for o in turns),
                  "ok_reply": sum(o.ok_reply for o in turns),
                  "unanswered": sum(not o.answered for o in turns)},
        "notifications": {"injected": len(notes), "dead_lettered": sum(bool(o.dead_letter) for o in notes),
                          "unanswered": sum(not o.answered for o in notes)},
        "unanswered": [f"{o.injection.kind} {o.injection.target} ({o.injection.what})"
                       for o in answers if not o.answered],
        "process_exits": exits, "worker_exits_read": exits_read, "errors": errors}
    res["failed"] = failures(res)
    return res


def with_exits(res: dict[str, Any], exits: list[str]) -> dict[str, Any]:
    """``res`` with more processes that exited on their own (the commander's, known at its stop)."""
    out = {**res, "process_exits": [*res["process_exits"], *exits]}
    out["failed"] = failures(out)
    return out


def failures(res: dict[str, Any]) -> list[str]:
    """Why the hostile part failed (empty: it held)."""
    fails = []
    if res["unanswered"]:
        fails.append(f"injections never answered: {res['unanswered']}")
    if res["turns"]["ok_reply"]:
        fails.append("a turn of a user with a wrong-type key was served as if nothing was wrong")
    if res["process_exits"]:
        fails.append(f"Fleet processes exited on their own: {res['process_exits']}")
    if res["errors"] or res["injected"] < res["planned"]:
        fails.append(f"injections not written ({res['injected']}/{res['planned']}): {res['errors']}")
    return fails


def rows(res: dict[str, Any]) -> list[tuple[str, object]]:
    """The hostile section of the results table."""
    t, n = res["turns"], res["notifications"]
    return [("hostile: injected / planned", f"{res['injected']} / {res['planned']}"),
            ("hostile: bad tier members and registry entries", res["state_entries"]),
            ("hostile: turns of users with a wrong-type key",
             f"{t['injected']} (error reply {t['error_reply']}, dead-lettered {t['dead_lettered']}, "
             f"unanswered {t['unanswered']})"),
            ("hostile: poison notifications",
             f"{n['injected']} (dead-lettered {n['dead_lettered']}, unanswered {n['unanswered']})"),
            ("hostile: Fleet processes exited on their own",
             f"{len(res['process_exits'])} (worker exits with a code in the ledger: "
             f"{res['worker_exits_read']}, chaos's kills among them)")]


def table(res: dict[str, Any]) -> None:
    """Print the hostile section and its pass/fail line."""
    shown = rows(res)
    width = max(len(k) for k, _ in shown)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in shown))
    print("HOSTILE: " + ("every injection answered, no process exited" if not res["failed"]
                         else "FAILED: " + "; ".join(res["failed"])))
