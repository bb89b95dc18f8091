"""``fleet user U`` (one user as the monitor's user page shows it), ``fleet user delete U`` (erase
every key of the user) and ``fleet dead-letters retry`` / ``purge`` (the listing stays in
``fleet.cli_admin``)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from fleet.cli_base import EXIT_USAGE, CliError, cli_client, count_arg, print_result
from stores.deadletters import Retried, purge_dead_letters, retry_dead_letters
from stores.erase import connection_user, delete_user, who
from stores.users import UserView, inspect_user


def add_user_command(sub: Any) -> None:
    """``fleet user U [--json] [--tier T ...] [--session N]``, and ``fleet user delete U --yes``."""
    u = sub.add_parser("user", help="one user: lane, inbox, session, pending, usage, dead letters; "
                       "`fleet user delete U --yes` erases every key of the user",
                       usage="fleet user U [options] | fleet user delete U --yes [--json]")
    u.add_argument("user", help="the user id (or `delete`, then the user id to erase)")
    u.add_argument("erase", nargs="?", metavar="U", help=argparse.SUPPRESS)
    u.add_argument("--yes", action="store_true", help="with `delete`: erase without asking")
    u.add_argument("--tier", action="append", default=None,
                   help="look at this tier only (repeatable; default: every tier)")
    u.add_argument("--session", type=count_arg, default=10,
                   help="show the last N session entries (default: 10)")
    u.add_argument("--json", action="store_true", help="print one JSON object")
    u.set_defaults(func=cmd_user)


def add_dead_letter_actions(d: argparse.ArgumentParser, parser_class: type[argparse.ArgumentParser]) -> None:
    """``fleet dead-letters retry|purge ID... | --all [--tier T]``; without one, the listing."""
    acts = d.add_subparsers(dest="dead_command", required=False, parser_class=parser_class,
                            metavar="{retry,purge}", help="retry or purge (without one: the listing)")
    for name, help_text in (("retry", "re-enqueue the turns for their users, after what is queued "
                                      "(answered once, by turn id)"),
                            ("purge", "delete dead letters")):
        a = acts.add_parser(name, help=help_text)
        a.add_argument("ids", nargs="*", metavar="ID", help="dead-letter ids, as `fleet dead-letters` shows")
        a.add_argument("--all", action="store_true", help=f"{name} every dead letter of the tier")
        # SUPPRESS: `fleet dead-letters --tier T retry ...` keeps the T given before the action
        a.add_argument("--tier", default=argparse.SUPPRESS, help="the tier (default: chat)")
        a.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
        a.set_defaults(func=cmd_dead_letter_retry if name == "retry" else cmd_dead_letter_purge)


def _chosen(args: argparse.Namespace, action: str) -> list[str] | None:
    """The ids of a retry or purge, or None for ``--all``; both or neither is a usage error."""
    if args.all and args.ids:
        raise CliError(f"give dead-letter ids or --all, not both (fleet dead-letters {action} "
                       "ID... | --all)", EXIT_USAGE)
    if not args.all and not args.ids:
        raise CliError(f"nothing to {action}: give dead-letter ids (see `fleet dead-letters`) or --all",
                       EXIT_USAGE)
    return None if args.all else list(args.ids)


def cmd_dead_letter_retry(args: argparse.Namespace) -> int:
    ids = _chosen(args, "retry")
    done = retry_dead_letters(cli_client(args), args.tier, ids)
    print_result([d.to_json() for d in done], args.json, lambda _: _retried_text(done, args.tier))
    # an id named that was not retried is a failure; --all retrying what it can is not
    return 1 if ids is not None and any(d.outcome != "retried" for d in done) else 0


def _retried_text(done: list[Retried], tier: str) -> str:
    if not done:
        return f"no dead letters in tier {tier}"
    lines = []
    for d in done:
        if d.outcome == "retried":
            lines.append(f"{d.id}  retried: user {d.user}, turn {d.turn_id} on tier {d.tier}")
        else:
            lines.append(f"{d.id}  {'unknown' if d.outcome == 'unknown' else 'not retried'}: {d.reason}")
    n = sum(1 for d in done if d.outcome == "retried")
    lines.append(f"{n} of {len(done)} retried")
    return "\n".join(lines)


def cmd_dead_letter_purge(args: argparse.Namespace) -> int:
    ids = _chosen(args, "purge")
    n = purge_dead_letters(cli_client(args), args.tier, ids)
    data = {"tier": args.tier, "removed": n, "asked": "all" if ids is None else len(set(ids))}
    print_result(data, args.json, lambda _: f"tier {args.tier}: {n} dead letter(s) removed"
                 + ("" if ids is None or n == len(set(ids)) else f" of {len(set(ids))} named (the rest were "
                                                                 "not there)"))
    return 0


def cmd_user(args: argparse.Namespace) -> int:
    if args.erase is not None:
        if args.user != "delete":
            raise CliError(f"unexpected argument {args.erase!r}: `fleet user U` shows a user, "
                           "`fleet user delete U --yes` erases one", EXIT_USAGE)
        return cmd_user_delete(args)
    view = inspect_user(cli_client(args), args.user, tiers=args.tier, session_n=args.session)
    print_result(view.to_json(), args.json, lambda _: user_text(view, time.time()))
    return 0


def cmd_user_delete(args: argparse.Namespace) -> int:
    """Erase every key of a user, fenced against a turn in flight; recorded in the ledger."""
    if not args.yes and not _confirmed(args.erase):
        raise CliError(f"not erased: `fleet user delete {args.erase} --yes` erases every key of the "
                       "user, for good", EXIT_USAGE)
    r = cli_client(args)
    done = delete_user(r, args.erase, who(), connection_user(r), time.time())
    print_result(done.to_json(), args.json, lambda _: f"user {done.user} erased: {done.keys} key(s) and "
                 f"{done.dead_letters} dead letter(s) removed; recorded in the ledger as {done.ledger_id}")
    return 0


def _confirmed(user: str) -> bool:
    """Whether the person at the terminal typed the user id back (False without a terminal)."""
    if not sys.stdin.isatty():
        return False
    answer = input(f"erase every key of user {user}, for good? type the user id to confirm: ")
    return answer.strip() == user


def user_text(v: UserView, now: float) -> str:
    """What ``fleet user U`` prints (pure)."""
    lane = (f"held by {v.lane_holder} (token {v.lane_token}, {v.lane_ttl_ms} ms left)"
            if v.lane_holder else "free")
    inbox = f"{v.inbox_after_cursor}" if v.inbox_exact else f"at most {v.inbox_after_cursor}"
    pending = ", ".join(v.pending) or "none"
    if v.pending_partial:
        pending += f" (not scanned to the end in: {', '.join(v.pending_partial)})"
    usage = ", ".join(f"{k}={n}" for k, n in sorted(v.usage.items())) or "none"
    lines = [f"user {v.user}", f"  lane     {lane}", f"  cursor   {v.cursor or '(none)'}",
             f"  inbox    {inbox} turn(s) queued after the cursor", f"  pending  notification in: {pending}",
             f"  usage    {usage}"]
    if v.in_progress is not None:
        t = v.in_progress
        lines.append(f"  serving  {t.turn_id or t.entry} (attempt {t.attempt})  > {_cut(t.text)}"
                     + (f"  < so far: {_cut(t.streamed)}" if t.streamed else ""))
    lines.append(f"  session  last {len(v.session)}:")
    lines += [f"    {_ago(now - e.ts):>8}  {e.turn_id}  > {_cut(e.text)}  < {_cut(e.reply)}"
              for e in v.session]
    lines.append(f"  dead letters ({len(v.dead_letters)}):")
    lines += [f"    {d.id}  {d.tier}  turn={d.turn_id}  {'' if d.retriable else '(not retriable) '}{d.reason}"
              for d in v.dead_letters]
    return "\n".join(lines)


def _ago(seconds: float) -> str:
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def _cut(text: str, n: int = 50) -> str:
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "…"
