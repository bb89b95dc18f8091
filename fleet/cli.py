"""The ``fleet`` command. Every failure is one line on stderr and a non-zero exit.

Exit codes: 0 ok (also when the reader of stdout went away: ``fleet status | head -1``),
1 a failure (an error reply, Redis unreachable), 2 a bad argument (usage, an id, a policy
value, a URL, a turn over a size limit), 3 a timeout waiting for a reply.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

import redis
from redis.connection import parse_url
from redis.exceptions import RedisClusterException

from fleet.cli_admin import (
    cmd_dead_letters,
    cmd_install,
    cmd_policy_edit,
    cmd_policy_get,
    cmd_policy_set,
    cmd_status,
)
from fleet.cli_base import (
    EXIT_ERROR_REPLY,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    CliError,
    Parser,
    cli_client,
    command_role,
    count_arg,
    json_object_arg,
    known_handlers,
    print_result,
    refused,
    seconds_arg,
)
from fleet.cli_groups import add_group_commands
from fleet.client import Fleet, Restart, UnknownTier
from fleet.handler_template import add_handler_commands
from protocol.ids import InvalidId
from protocol.models import MAX_TEXT_CHARS, Reply
from stores.connection import NoFleetFound, redact_url, resolve_url
from stores.roles import as_role

__all__ = ["EXIT_ERROR_REPLY", "EXIT_TIMEOUT", "EXIT_USAGE", "CliError", "build_parser", "main",
           "cmd_dead_letters", "cmd_policy_edit", "cmd_policy_get", "cmd_policy_set", "cmd_status"]



# --- submit / chat --------------------------------------------------------------------
def _reply_line(reply: Reply) -> str:
    return reply.text if reply.ok else f"{reply.status}: {reply.error}"


def _unknown_tier(exc: UnknownTier) -> CliError:
    return CliError(f"no tier {exc.tier!r}: it has no policy and no live worker, so nothing would "
                    f"serve the turn; nothing was submitted (check the name, or pass --create-tier "
                    f"to create it with the default policy)", EXIT_USAGE)


def _streamed(client: Fleet, user: str, text: str, tier: str, timeout: float,
              meta: dict[str, Any] | None, create_tier: bool, show: bool = True,
              deadline: float | Literal["timeout"] | None = "timeout") -> Reply:
    """Submit a streamed turn and print its text as it comes (unless ``show`` is off); its reply.
    A restart starts a new line (the text after it replaces what was shown); a reply whose text
    is not what was shown (an error, a handler that streams nothing) is printed whole. Its
    deadline as ``Fleet.stream``'s."""
    shown = ""
    for item in client.stream(user, text, tier=tier, timeout=timeout, meta=meta, create_tier=create_tier,
                              deadline=deadline):
        if isinstance(item, Reply):
            if show:
                print("" if item.ok and shown and shown == item.text else
                      ("\n" if shown else "") + _reply_line(item), flush=True)
            return item
        if not show:
            continue
        if isinstance(item, Restart):
            print(f"\n[attempt {item.attempt}, from the start]", file=sys.stderr, flush=True)
            shown = ""
        else:
            print(item, end="", flush=True)
            shown += item
    raise AssertionError("unreachable: a stream ends with its reply or raises")


def cmd_submit(args: argparse.Namespace) -> int:
    from fleet.client import TurnTimeout, TurnTooLarge

    meta = json_object_arg(args.meta, "--meta") if args.meta else None
    client = Fleet(client=cli_client(args))
    try:
        deadline, timeout_s = _deadline_args(args)
        if args.stream:
            due = deadline if timeout_s is None else time.time() + timeout_s
            reply = _streamed(client, args.user, " ".join(args.text), args.tier, args.timeout, meta,
                              args.create_tier, show=not args.json, deadline=due)
            if not args.json:
                return 0 if reply.ok else EXIT_ERROR_REPLY
        else:
            handle = client.submit(args.user, " ".join(args.text), tier=args.tier, meta=meta,
                                   create_tier=args.create_tier, deadline=deadline, timeout_s=timeout_s)
            reply = handle.result(args.timeout)
    except TurnTooLarge as exc:
        raise CliError(f"{exc}; nothing was submitted", EXIT_USAGE) from None
    except UnknownTier as exc:
        raise _unknown_tier(exc) from None
    except TurnTimeout as exc:
        print(f"fleet submit: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    print_result(reply.model_dump(), args.json, lambda _: _reply_line(reply))
    return 0 if reply.ok else EXIT_ERROR_REPLY


def _deadline_args(args: argparse.Namespace) -> tuple[float | None, float | None]:
    """The turn's ``(deadline, timeout_s)``: ``--deadline``, else none with ``--no-deadline``,
    else the end of the wait (``--timeout``): nobody reads the reply after it."""
    if args.deadline is not None:
        return args.deadline, None
    return None, None if args.no_deadline else args.timeout


def cmd_cancel(args: argparse.Namespace) -> int:
    """``fleet cancel``: exit 0 when the turn was cancelled or was answered already (the line
    says which), 1 when no such turn is known."""
    from dataclasses import asdict

    from fleet.client import Fleet

    try:
        got = Fleet(client=cli_client(args)).cancel(args.user, args.turn_id)
    except ValueError as exc:  # an invalid id, keys of the wrong type
        raise CliError(str(exc), EXIT_USAGE) from None
    print_result(asdict(got), args.json, lambda _: str(got))
    return 1 if got.outcome == "unknown" else 0


def cmd_chat(args: argparse.Namespace) -> int:
    from fleet.client import TurnTimeout, TurnTooLarge

    client = Fleet(client=cli_client(args))
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
            _streamed(client, args.user, line.rstrip("\n"), args.tier, args.timeout, None, args.create_tier)
        except TurnTooLarge as exc:  # that line only: the chat goes on
            print(f"fleet chat: {exc}; not sent", file=sys.stderr, flush=True)
        except UnknownTier as exc:
            raise _unknown_tier(exc) from None
        except TurnTimeout as exc:
            print(f"fleet chat: {exc}", file=sys.stderr)




def cmd_events(args: argparse.Namespace) -> int:
    from fleet.events import run_events

    return run_events(cli_client(args), tier=args.tier, count=args.count, follow=args.follow,
                      as_json=args.json)


def cmd_top(args: argparse.Namespace) -> int:
    from fleet.top import run_top

    return run_top(cli_client(args), interval=args.interval, once=args.once, tier=args.tier,
                   handlers=known_handlers())


def cmd_commander(args: argparse.Namespace) -> int:
    from commander.__main__ import run

    return run(args)


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.__main__ import run

    return run(args)


def cmd_replay(args: argparse.Namespace) -> int:
    from sim.scaling.replay import run_command

    try:
        return run_command(args, as_role(resolve_url(args.redis_url), command_role(args.command)))
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fleet", description="Stateless chat-turn workers on Redis.")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else the local fleet")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    _add_up_down(sub)
    _add_turn_commands(sub)
    _add_policy_commands(sub)
    add_group_commands(sub, Parser)
    add_handler_commands(sub, Parser)
    from fleet.cli_handlers import add_handlers_command

    add_handlers_command(sub)
    _add_observe_commands(sub)
    _add_run_commands(sub)
    from fleet.cli_jobs import add_job_commands

    add_job_commands(sub)
    from fleet.cli_acl import add_acl_command

    add_acl_command(sub)
    return p


_Sub = argparse._SubParsersAction  # the type of ``add_subparsers()``'s result


def _add_turn_commands(sub: _Sub[Any]) -> None:
    """``fleet submit`` and ``fleet chat``."""
    s = sub.add_parser("submit", help="submit one turn and print the reply")
    s.add_argument("--user", required=True, help="user id: 1-64 of A-Z a-z 0-9 _ . @ + -")
    s.add_argument("--tier", default="chat", help="tier to serve the turn (default: chat)")
    s.add_argument("--meta", help="JSON object passed to the handler")
    s.add_argument("--timeout", type=seconds_arg(0.01), default=30.0,
                   help="seconds to wait for the reply; exit 3 if none (default: 30). Also the turn's "
                        "deadline: a worker that reaches it later answers it expired")
    s.add_argument("--deadline", type=seconds_arg(0.01), default=None, metavar="UNIX_SECONDS",
                   help="the turn's deadline as a unix time, instead of the end of --timeout")
    s.add_argument("--no-deadline", action="store_true",
                   help="no deadline: the turn is served however late a worker reaches it")
    s.add_argument("--json", action="store_true", help="print the whole reply as JSON")
    s.add_argument("--stream", action="store_true",
                   help="print the reply's text as the handler streams it (with --json: only the reply)")
    s.add_argument("--create-tier", action="store_true",
                   help="create the tier (its default policy) if it does not exist")
    s.add_argument("text", nargs="+", help=f"the turn's text (at most {MAX_TEXT_CHARS} characters)")
    s.set_defaults(func=cmd_submit)

    x = sub.add_parser("cancel", help="stop a user's turn: queued, it is never run; running, its handler "
                                      "is stopped; answered cancelled either way")
    x.add_argument("--user", required=True, help="the turn's user")
    x.add_argument("--json", action="store_true", help="print the outcome as JSON")
    x.add_argument("turn_id", help="the turn's id (fleet submit --json prints it)")
    x.set_defaults(func=cmd_cancel)

    c = sub.add_parser("chat", help="chat as a user: one turn per line of stdin, each reply streamed")
    c.add_argument("--user", required=True, help="user id: 1-64 of A-Z a-z 0-9 _ . @ + -")
    c.add_argument("--tier", default="chat", help="tier to serve the turns (default: chat)")
    c.add_argument("--timeout", type=seconds_arg(0.01), default=60.0,
                   help="seconds to wait for each reply, and its turn's deadline (default: 60)")
    c.add_argument("--create-tier", action="store_true",
                   help="create the tier (its default policy) if it does not exist")
    c.set_defaults(func=cmd_chat)


def _add_policy_commands(sub: _Sub[Any]) -> None:
    """``fleet policy get|set|edit``."""
    pol = sub.add_parser("policy", help="read or change a tier's policy")
    psub = pol.add_subparsers(dest="policy_command", required=True, parser_class=Parser)
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


def _add_observe_commands(sub: _Sub[Any]) -> None:
    """``fleet status``, ``dead-letters`` (and its ``retry``, ``purge``), ``user``, ``events`` and ``top``."""
    from fleet.top import DESCRIPTION as TOP_DESCRIPTION
    from fleet.top import MIN_INTERVAL_S

    stt = sub.add_parser("status", help="tiers, workers, backlog",
                         description="Tiers, workers, backlog. Each tier counts its workers (WORKERS: "
                                     "with a heartbeat, NO-HB: registered without one); the worker "
                                     "list below is one page, by tier then id (--page, --tier, --all). A "
                                     "worker's AGE is the time since the worker started (as in `fleet top`).")
    stt.add_argument("--json", action="store_true", help="print everything as one JSON object")
    _worker_page_arguments(stt)
    stt.set_defaults(func=cmd_status)

    ins = sub.add_parser("install", help="load Fleet's functions library into Redis (an admin connection)",
                         description="Load Fleet's Lua, one Redis Functions library, with an admin "
                                     "connection (FUNCTION LOAD REPLACE; on a Cluster on every primary) "
                                     "and print its version. Fleet's processes only call it (FCALL).")
    ins.add_argument("--url", default=None,
                     help="Redis URL of an admin user (default: --redis-url, $REDIS_URL)")
    ins.add_argument("--check", action="store_true",
                     help="only say whether this version is installed (exit 0) or not (exit 1)")
    ins.set_defaults(func=cmd_install)

    d = sub.add_parser("dead-letters", help="turns that could not be served, with reasons")
    d.add_argument("--tier", default="chat", help="tier whose dead letters to show (default: chat)")
    d.add_argument("--count", type=count_arg, default=20, help="show the newest N (default: 20)")
    d.add_argument("--json", action="store_true", help="print a JSON array")
    d.set_defaults(func=cmd_dead_letters)
    from fleet.cli_users import add_dead_letter_actions, add_user_command

    add_dead_letter_actions(d, Parser)
    add_user_command(sub)

    ev = sub.add_parser("events", help="the scaling ledger: what changed, and why")
    ev.add_argument("--tier", default=None, help="only this tier's events (default: every tier)")
    ev.add_argument("--count", type=count_arg, default=50,
                    help="show the newest N, oldest first (default: 50; 0 with --follow: only new ones)")
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events (Ctrl-C ends)")
    ev.add_argument("--json", action="store_true",
                    help="a JSON array; with --follow, one JSON object per line")
    ev.set_defaults(func=cmd_events)

    tp = sub.add_parser("top", help="live view of tiers, workers, occupancy and the ledger",
                        description=TOP_DESCRIPTION)
    tp.add_argument("--interval", type=seconds_arg(MIN_INTERVAL_S), default=2.0,
                    help=f"seconds between frames, at least {MIN_INTERVAL_S:g} (default: 2)")
    tp.add_argument("--once", action="store_true", help="print one frame and exit")
    tp.add_argument("--tier", default=None, help="only this tier (default: every tier)")
    tp.set_defaults(func=cmd_top)


def _worker_page_arguments(stt: argparse.ArgumentParser) -> None:
    """Which page of the worker list ``fleet status`` shows (the tiers' counts cover every worker)."""
    from fleet.status import MAX_PAGE_SIZE, PAGE_SIZE

    stt.add_argument("--tier", default=None,
                     help="list only this tier's (or a group's pool's) workers (default: every worker)")
    stt.add_argument("--page", type=_page_arg(None), default=1,
                     help="which page of the worker list, by tier then id (default: 1)")
    stt.add_argument("--page-size", type=_page_arg(MAX_PAGE_SIZE), default=PAGE_SIZE,
                     help=f"workers per page, at most {MAX_PAGE_SIZE} (default: {PAGE_SIZE})")
    stt.add_argument("--all", action="store_true", help="list every worker, on one page (--page is ignored)")


def _page_arg(cap: int | None) -> Callable[[str], int]:
    """An argparse type: a whole number, 1 or more (at most ``cap``)."""
    def parse(text: str) -> int:
        value = count_arg(text)
        if value < 1 or (cap is not None and value > cap):
            raise argparse.ArgumentTypeError(f"must be from 1{f' to {cap}' if cap else ''}, got {value}")
        return value

    return parse


def _add_run_commands(sub: _Sub[Any]) -> None:
    """``fleet commander``, ``worker`` and ``replay`` (whose options load on first use)."""
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


def _replay_arguments(rp: argparse.ArgumentParser) -> None:
    """``fleet replay``'s options and texts, from the benchmark's replay driver (``sim.scaling``),
    imported only when ``fleet replay`` runs or shows its help."""
    from sim.scaling import replay

    rp.description = replay.__doc__
    replay.add_arguments(rp)


def _add_up_down(sub: _Sub[Any]) -> None:
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
    """Run one command; a closed stdout (``fleet status | head -1``) ends it quietly with exit 0,
    Ctrl-C with exit 130 and no traceback."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:  # while the command's modules were still loading
        print("fleet: interrupted", file=sys.stderr)
        return 130


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
    except (redis.RedisError, RedisClusterException) as exc:
        role: str | None = getattr(args, "redis_role", None)
        refusal = refused(exc, role) if isinstance(exc, redis.RedisError) and role else None
        if refusal is not None:
            print(f"fleet {args.command}: {refusal}", file=sys.stderr)
            return refusal.code
        print(f"fleet {args.command}: Redis error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
