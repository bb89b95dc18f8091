"""The ``fleet`` command. Every failure is one line on stderr and a non-zero exit.

Exit codes: 0 ok (also when the reader of stdout went away: ``fleet status | head -1``),
1 a failure (an error reply, Redis unreachable), 2 a bad argument (usage, an id, a policy
value, a URL, a turn over a size limit), 3 a timeout waiting for a reply.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any, NoReturn

import redis
from redis.connection import parse_url

from fleet.client import UnknownTier
from protocol import keys
from protocol.ids import InvalidId
from protocol.models import MAX_TEXT_CHARS, Reply
from protocol.policy import Policy, PolicyError, parse_assignments, parse_policy, updated
from stores.connection import NoFleetFound, connect_sync, redact_url, resolve_url
from stores.policies import has_policy_key, read_policy, write_policy

EXIT_ERROR_REPLY = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3


class CliError(Exception):
    """A failure to report in one line, with its exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """One-line errors. ``load``: a function that adds the options (and texts) on first use, so a
    subcommand's module is imported only when that subcommand is parsed or shows its help."""

    def __init__(self, *args: Any, load: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load = load

    def _loaded(self) -> None:
        if self._load is not None:
            load, self._load = self._load, None
            load(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._loaded()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._loaded()
        return super().format_usage()

    def format_help(self) -> str:
        self._loaded()
        return super().format_help()

    def error(self, message: str) -> NoReturn:  # one line, not the usage block
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see --help)\n")


def _handlers() -> list[str]:
    from worker.handlers import registered_names

    return registered_names()


def _client(args: argparse.Namespace) -> redis.Redis:
    try:
        r = connect_sync(getattr(args, "redis_url", None), retries=2)
    except ValueError as exc:  # a URL redis-py cannot parse (main checks --redis-url and $REDIS_URL)
        raise CliError(f"bad Redis URL: {exc}", EXIT_USAGE) from None
    try:
        r.ping()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        url = resolve_url(getattr(args, "redis_url", None))
        raise CliError(f"cannot reach Redis at {redact_url(url)}: {exc} (is the fleet up? `fleet up`)"
                       ) from None
    return r


def _print(data: Any, as_json: bool, text: Callable[[Any], str]) -> None:
    print(json.dumps(data, indent=2, default=str) if as_json else text(data))


# --- submit / chat --------------------------------------------------------------------
def _reply_line(reply: Reply) -> str:
    return reply.text if reply.ok else f"error: {reply.error}"


def _unknown_tier(exc: UnknownTier) -> CliError:
    return CliError(f"no tier {exc.tier!r}: it has no policy and no live worker, so nothing would "
                    f"serve the turn; nothing was submitted (check the name, or pass --create-tier "
                    f"to create it with the default policy)", EXIT_USAGE)


def cmd_submit(args: argparse.Namespace) -> int:
    from fleet.client import Fleet, TurnTimeout, TurnTooLarge

    meta = _json_object(args.meta, "--meta") if args.meta else None
    client = Fleet(client=_client(args))
    try:
        handle = client.submit(args.user, " ".join(args.text), tier=args.tier, meta=meta,
                               create_tier=args.create_tier)
        reply = handle.result(args.timeout)
    except TurnTooLarge as exc:
        raise CliError(f"{exc}; nothing was submitted", EXIT_USAGE) from None
    except UnknownTier as exc:
        raise _unknown_tier(exc) from None
    except TurnTimeout as exc:
        print(f"fleet submit: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    _print(reply.model_dump(), args.json, lambda _: _reply_line(reply))
    return 0 if reply.ok else EXIT_ERROR_REPLY


def cmd_chat(args: argparse.Namespace) -> int:
    from fleet.client import Fleet, TurnTimeout, TurnTooLarge

    client = Fleet(client=_client(args))
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting as {args.user} on tier {args.tier}; an empty line or Ctrl-D ends")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        try:
            reply = client.submit(args.user, line.rstrip("\n"), tier=args.tier,
                                  create_tier=args.create_tier).result(args.timeout)
            print(_reply_line(reply), flush=True)
        except TurnTooLarge as exc:  # that line only: the chat goes on
            print(f"fleet chat: {exc}; not sent", file=sys.stderr, flush=True)
        except UnknownTier as exc:
            raise _unknown_tier(exc) from None
        except TurnTimeout as exc:
            print(f"fleet chat: {exc}", file=sys.stderr)


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{what} is not JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(value, dict):
        raise CliError(f"{what} must be a JSON object, got {text[:40]!r}", EXIT_USAGE)
    return value


# --- policy ---------------------------------------------------------------------------
def _defaults_line() -> str:
    p = Policy()
    return (f"handler={p.handler}, concurrency={p.concurrency}, min_workers={p.min_workers}, "
            f"max_workers={p.max_workers}")


def cmd_policy_get(args: argparse.Namespace) -> int:
    r = _client(args)
    if not has_policy_key(r, args.tier):  # checked first: reading would record a verdict
        raise CliError(f"tier {args.tier!r} has no policy (defaults would apply: {_defaults_line()}; "
                       f"`fleet policy set {args.tier} key=value ...` creates it)")
    from fleet.status import policy_verdict

    read = read_policy(r, args.tier, _handlers())
    error, by = policy_verdict(r, args.tier, read.error)
    data = {"tier": args.tier, "source": read.source, "rejected": error, "rejected_by": by,
            "policy": read.policy.model_dump(mode="json")}

    def text(_: Any) -> str:
        lines = [f"tier {args.tier} (policy from {read.source})"]
        if error:
            lines.append(f"REJECTED edit of {keys.policy(args.tier)}{f' by {by}' if by else ''}: "
                         f"{error}; running the last good one")
        lines += [f"  {k} = {json.dumps(v)}" for k, v in data["policy"].items()]
        return "\n".join(lines)

    _print(data, args.json, text)
    return 0


def cmd_policy_set(args: argparse.Namespace) -> int:
    r = _client(args)
    try:
        changes = parse_assignments(args.assignments)
        current = read_policy(r, args.tier, _handlers()).policy
        policy = updated(current, changes, _handlers())
    except PolicyError as exc:
        raise CliError(f"policy not changed: {exc}", EXIT_USAGE) from None
    write_policy(r, args.tier, policy)
    _print(policy.model_dump(mode="json"), args.json,
           lambda _: f"tier {args.tier}: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in changes.items()))
    _warn_if_no_worker_has(r, args.tier, policy.handler)
    return 0


def _warn_if_no_worker_has(r: redis.Redis, tier: str, handler: str) -> None:
    """The handler check that matters is the workers': say so when none of the tier's live
    workers lists ``handler`` (they keep their last good policy until one does)."""
    from stores.registry import read_registry

    live = [w for w in read_registry(r).live(tier) if w.handlers]
    if live and not any(handler in w.handlers for w in live):
        have = sorted({h for w in live for h in w.handlers})
        print(f"warning: no live worker of tier {tier} has handler {handler!r} (they have: "
              f"{', '.join(have)}): they keep running their last good policy until it is "
              f"installed where they run; see README, 'Your own handler'", file=sys.stderr)


def cmd_policy_edit(args: argparse.Namespace) -> int:
    r = _client(args)
    current = read_policy(r, args.tier, _handlers()).policy
    with tempfile.NamedTemporaryFile("w+", suffix=".json", delete=False) as f:
        f.write(json.dumps(current.model_dump(mode="json"), indent=2) + "\n")
        path = f.name
    try:
        subprocess.run([os.environ.get("EDITOR", "vi"), path], check=True)
        with open(path) as f:
            policy = parse_policy(f.read(), _handlers())
    except PolicyError as exc:
        raise CliError(f"policy not changed: {exc}", EXIT_USAGE) from None
    except (OSError, subprocess.CalledProcessError) as exc:
        raise CliError(f"editor failed: {exc}") from None
    finally:
        os.unlink(path)
    write_policy(r, args.tier, policy)
    print(f"tier {args.tier}: policy saved")
    _warn_if_no_worker_has(r, args.tier, policy.handler)
    return 0


# --- status / dead letters / worker ---------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    from fleet.status import snapshot

    snap = snapshot(_client(args), _handlers())
    _print(snap, args.json, _status_text)
    return 0


def _status_text(snap: dict[str, Any]) -> str:
    lines = [_commander_line(snap), ""]
    lines += [f"{'TIER':<12}{'WORKERS':>8}{'MIN':>5}{'MAX':>5}{'BACKLOG':>9}{'PENDING':>9}"
             f"{'ACTIVE':>8}{'DEAD':>6}  POLICY"]
    for tier, t in snap["tiers"].items():
        by = f" by {t['policy_rejected_by']}" if t.get("policy_rejected_by") else ""
        policy = t["policy_source"] + (f" (REJECTED{by}: {t['policy_error']})" if t["policy_error"] else "")
        lines.append(f"{tier:<12}{t['workers_alive']:>8}{t['min_workers']:>5}{t['max_workers']:>5}"
                     f"{t['backlog']:>9}{t['pending']:>9}{t['active_users']:>8}{t['dead_letters']:>6}"
                     f"  {policy}")
    lines.append("")
    lines.append(f"{'WORKER':<24}{'TIER':<10}{'PID':>8}  {'HOST':<16}{'AGE':>8}  STATE")
    for w in sorted(snap["workers"], key=lambda w: (w["tier"], w["worker"])):
        state = "alive" if w["alive"] else "no heartbeat"
        lines.append(f"{w['worker']:<24}{w['tier']:<10}{w['pid']:>8}  {w['host'][:15]:<16}"
                     f"{w['age_s']:>7.0f}s  {state}")
    if snap.get("events"):
        lines += ["", "LAST EVENTS"]
        lines += [f"  {_event_line(e)}" for e in snap["events"]]
    return "\n".join(lines)


def _commander_line(snap: dict[str, Any]) -> str:
    leader, _, epoch = (snap.get("leader") or "").partition("|")
    head = f"commander: {leader} leads (epoch {epoch})" if leader else "commander: none leads"
    url = next((c.get("metrics_url") for c in snap.get("commanders", [])
                if c.get("commander") == leader and c.get("metrics_url")), None)
    head += f", metrics {url}" if url else ""
    others = [f"{c.get('commander')} {c.get('role')}" if c.get("alive") else
              f"{c.get('commander')} gone (last seen {_ago(c.get('seen_ago_s'))})"
              for c in snap.get("commanders", []) if c.get("commander") != leader]
    return head + (f"; {', '.join(others)}" if others else "")


def _ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.0f} s ago"


def _event_line(e: dict[str, Any]) -> str:
    if "error" in e and "action" not in e:
        return f"{e.get('id', '?')}  unreadable: {e['error']}"
    from fleet.events import counts

    action = e.get("action", "?")
    return (f"{e.get('tier', '?')}  {action}  {counts(action, e.get('from_count'), e.get('to_count'))}"
            f"  {e.get('reason', '')}"
            f"  (epoch {e.get('epoch', '?')})")


def cmd_dead_letters(args: argparse.Namespace) -> int:
    from fleet.status import dead_letters

    rows = dead_letters(_client(args), args.tier, args.count)
    _print(rows, args.json, lambda rows: "\n".join(
        f"{d['id']}  user={d.get('user', '')!r} turn={d.get('turn_id', '')}  {d.get('reason', '')}"
        for d in rows) or "no dead letters")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from fleet.events import run_events

    return run_events(_client(args), tier=args.tier, count=args.count, follow=args.follow,
                      as_json=args.json)


def cmd_top(args: argparse.Namespace) -> int:
    from fleet.top import run_top

    return run_top(_client(args), interval=args.interval, once=args.once, tier=args.tier,
                   handlers=_handlers())


def cmd_commander(args: argparse.Namespace) -> int:
    from commander.__main__ import run

    return run(args)


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.__main__ import run

    return run(args)


def cmd_replay(args: argparse.Namespace) -> int:
    from sim.scaling.replay import run_command

    try:
        return run_command(args, resolve_url(args.redis_url))
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None


# --- the parser -----------------------------------------------------------------------
def _count(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _seconds(minimum: float) -> Callable[[str], float]:
    """An argparse type: a number of seconds, at least ``minimum``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not value >= minimum:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g} seconds, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    from fleet.top import DESCRIPTION as TOP_DESCRIPTION
    from fleet.top import MIN_INTERVAL_S

    p = _Parser(prog="fleet", description="Stateless chat-turn workers on Redis.")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else the local fleet")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_up_down(sub)

    s = sub.add_parser("submit", help="submit one turn and print the reply")
    s.add_argument("--user", required=True, help="user id: 1-64 of A-Z a-z 0-9 _ . @ + -")
    s.add_argument("--tier", default="chat", help="tier to serve the turn (default: chat)")
    s.add_argument("--meta", help="JSON object passed to the handler")
    s.add_argument("--timeout", type=_seconds(0.01), default=30.0,
                   help="seconds to wait for the reply; exit 3 if none (default: 30)")
    s.add_argument("--json", action="store_true", help="print the whole reply as JSON")
    s.add_argument("--create-tier", action="store_true",
                   help="create the tier (its default policy) if it does not exist")
    s.add_argument("text", nargs="+", help=f"the turn's text (at most {MAX_TEXT_CHARS} characters)")
    s.set_defaults(func=cmd_submit)

    c = sub.add_parser("chat", help="interactive chat as a user (one turn per line)")
    c.add_argument("--user", required=True, help="user id: 1-64 of A-Z a-z 0-9 _ . @ + -")
    c.add_argument("--tier", default="chat", help="tier to serve the turns (default: chat)")
    c.add_argument("--timeout", type=_seconds(0.01), default=60.0,
                   help="seconds to wait for each reply (default: 60)")
    c.add_argument("--create-tier", action="store_true",
                   help="create the tier (its default policy) if it does not exist")
    c.set_defaults(func=cmd_chat)

    pol = sub.add_parser("policy", help="read or change a tier's policy")
    psub = pol.add_subparsers(dest="policy_command", required=True, parser_class=_Parser)
    g = psub.add_parser("get", help="show the policy in force (and a rejected edit)")
    g.add_argument("tier")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_policy_get)
    st = psub.add_parser("set", help="change fields: fleet policy set chat min_workers=2 ...")
    st.add_argument("tier")
    st.add_argument("assignments", nargs="+", metavar="key=value")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_policy_set)
    ed = psub.add_parser("edit", help="edit the policy as JSON in $EDITOR")
    ed.add_argument("tier")
    ed.set_defaults(func=cmd_policy_edit)

    stt = sub.add_parser("status", help="tiers, workers, backlog",
                         description="Tiers, workers, backlog. A worker's AGE is the time since "
                                     "the worker started (as in `fleet top`).")
    stt.add_argument("--json", action="store_true", help="print everything as one JSON object")
    stt.set_defaults(func=cmd_status)

    d = sub.add_parser("dead-letters", help="turns that could not be served, with reasons")
    d.add_argument("--tier", default="chat", help="tier whose dead letters to show (default: chat)")
    d.add_argument("--count", type=_count, default=20, help="show the newest N (default: 20)")
    d.add_argument("--json", action="store_true", help="print a JSON array")
    d.set_defaults(func=cmd_dead_letters)

    ev = sub.add_parser("events", help="the scaling ledger: what changed, and why")
    ev.add_argument("--tier", default=None, help="only this tier's events (default: every tier)")
    ev.add_argument("--count", type=_count, default=50,
                    help="show the newest N, oldest first (default: 50; 0 with --follow: only new ones)")
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events (Ctrl-C ends)")
    ev.add_argument("--json", action="store_true",
                    help="a JSON array; with --follow, one JSON object per line")
    ev.set_defaults(func=cmd_events)

    tp = sub.add_parser("top", help="live view of tiers, workers, occupancy and the ledger",
                        description=TOP_DESCRIPTION)
    tp.add_argument("--interval", type=_seconds(MIN_INTERVAL_S), default=2.0,
                    help=f"seconds between frames, at least {MIN_INTERVAL_S:g} (default: 2)")
    tp.add_argument("--once", action="store_true", help="print one frame and exit")
    tp.add_argument("--tier", default=None, help="only this tier (default: every tier)")
    tp.set_defaults(func=cmd_top)

    cm = sub.add_parser("commander", help="run the autoscaling commander in the foreground")
    from commander.__main__ import add_arguments as add_commander_arguments

    add_commander_arguments(cm)
    cm.set_defaults(func=cmd_commander)

    w = sub.add_parser("worker", help="run one worker process in the foreground")
    from worker.__main__ import add_arguments as add_worker_arguments

    add_worker_arguments(w, tier_required=True, redis_url=False)
    w.set_defaults(func=cmd_worker)

    rp = sub.add_parser("replay", help="drive a real fleet with a trace (sleep handler)",
                        formatter_class=argparse.RawDescriptionHelpFormatter, load=_replay_arguments)
    rp.set_defaults(func=cmd_replay)
    return p


def _replay_arguments(rp: argparse.ArgumentParser) -> None:
    """``fleet replay``'s options and texts, from the benchmark's replay driver (``sim.scaling``),
    imported only when ``fleet replay`` runs or shows its help."""
    from sim.scaling import replay

    rp.description = replay.__doc__
    replay.add_arguments(rp)


def _add_up_down(sub: argparse._SubParsersAction[Any]) -> None:
    try:
        from fleet.updown import add_up_down_arguments
    except ImportError:
        return
    add_up_down_arguments(sub)


def _bad_url(url: str | None) -> str | None:
    """Why redis-py cannot use ``url`` (one line), or None if it can (or there is none)."""
    if not url:
        return None
    try:
        parse_url(url)  # type: ignore[no-untyped-call]  # unannotated in redis-py
    except ValueError as exc:
        return f"{redact_url(url)!r}: {exc}"
    return None


def _quiet_stdout() -> None:
    """The reader of stdout went away: send what is still buffered nowhere, without a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run one command; a closed stdout (``fleet status | head -1``) ends it quietly with exit 0."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return 0


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.redis_url:
        os.environ["REDIS_URL"] = args.redis_url
    flag = "--redis-url" if args.redis_url else "$REDIS_URL"
    if why := _bad_url(os.environ.get("REDIS_URL")):
        print(f"fleet {args.command}: bad {flag} {why}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except (CliError, InvalidId) as exc:
        print(f"fleet {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, InvalidId) else exc.code
    except NoFleetFound as exc:  # says where it looked; nothing is used by default
        print(f"fleet {args.command}: {exc}", file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        print(f"fleet {args.command}: Redis error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
