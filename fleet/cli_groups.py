"""``fleet group pin|unpin|show`` and ``fleet rollout``: who is served by which group of a tier.

A rollout writes the tier's policy (the groups' weights, and ``canary``); the commander records
the change in the ledger (``rollout``) on its next pass, fenced by its leadership like every
ledger entry. Weights are percentages that sum to 100 (``protocol.groups.rollout_weights``), so
a step moves only the users between the old and the new threshold.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from fleet.cli_base import EXIT_USAGE, CliError, cli_client, print_result
from protocol.groups import rollout_weights
from protocol.ids import InvalidId, validate_tier, validate_user_id
from protocol.policy import PolicyError, TurnsPolicy
from stores.group_assignment import pin_group, rejected_groups, unpin_group, user_pins
from stores.policies import has_policy_key, read_policy, write_policy


def percent_arg(text: str) -> float:
    """An argparse type: a percentage, 0 to 100."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if math.isnan(value) or not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be a percentage (0..100), got {text}")
    return value


def add_group_commands(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    """``fleet group pin|unpin|show`` and ``fleet rollout``."""
    grp = sub.add_parser("group", help="pin a user to a group of a tier (blue/green, canary)")
    gsub = grp.add_subparsers(dest="group_command", required=True, parser_class=parser_class)
    pin = gsub.add_parser("pin", help="serve the user's next turns of the tier on GROUP")
    pin.add_argument("user")
    pin.add_argument("group")
    pin.add_argument("--tier", default="chat")
    pin.set_defaults(func=cmd_group_pin)
    unpin = gsub.add_parser("unpin", help="back to the weights' choice")
    unpin.add_argument("user")
    unpin.add_argument("--tier", default="chat")
    unpin.set_defaults(func=cmd_group_unpin)
    show = gsub.add_parser("show", help="the user's pins")
    show.add_argument("user")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_group_show)
    ro = sub.add_parser("rollout", help="shift a tier's traffic to a group: --weight 10, --to 100, --abort")
    ro.add_argument("tier")
    ro.add_argument("group")
    how = ro.add_mutually_exclusive_group(required=True)
    how.add_argument("--weight", type=percent_arg, help="the group's share in percent (a canary step)")
    how.add_argument("--to", type=percent_arg, help="the same, for the last steps: --to 100")
    how.add_argument("--abort", action="store_true", help="the group's weight to 0")
    ro.add_argument("--json", action="store_true")
    ro.set_defaults(func=cmd_rollout)


def _valid(check: Callable[[str], str], value: str) -> str:
    """``value`` as ``check`` validates it; a bad id is a one-line usage error."""
    try:
        return check(value)
    except InvalidId as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def _ids(args: argparse.Namespace) -> tuple[str, str]:
    return _valid(validate_user_id, args.user), _valid(validate_tier, args.tier)


def _grouped_policy(r: Any, tier: str) -> TurnsPolicy:
    if not has_policy_key(r, tier):
        raise CliError(f"tier {tier!r} has no policy", EXIT_USAGE)
    policy = read_policy(r, tier).policy
    if not isinstance(policy, TurnsPolicy) or not policy.rollout.groups:
        raise CliError(f"tier {tier!r} has no groups (set them: fleet policy set {tier} groups='[...]')",
                       EXIT_USAGE)
    return policy


def cmd_group_pin(args: argparse.Namespace) -> int:
    user, tier = _ids(args)
    r = cli_client(args)
    names = [g.name for g in _grouped_policy(r, tier).rollout.groups]
    if args.group not in names:
        raise CliError(f"tier {tier!r} has no group {args.group!r} (groups: {', '.join(names)})", EXIT_USAGE)
    pin_group(r, user, tier, args.group)
    print(f"{user}: pinned to {tier}.{args.group} from the next turn on (the one in progress finishes "
          "where it is)")
    return 0


def cmd_group_unpin(args: argparse.Namespace) -> int:
    user, tier = _ids(args)
    had = unpin_group(cli_client(args), user, tier)
    print(f"{user}: {'unpinned from' if had else 'had no pin on'} tier {tier}")
    return 0


def cmd_group_show(args: argparse.Namespace) -> int:
    user = _valid(validate_user_id, args.user)
    pins = user_pins(cli_client(args), user)
    print_result(pins, args.json, lambda p: "\n".join(f"{t}: {g}" for t, g in sorted(p.items()))
                 or f"{user} has no pins")
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    tier = _valid(validate_tier, args.tier)
    r = cli_client(args)
    policy = _grouped_policy(r, tier)
    percent = 0.0 if args.abort else args.weight if args.weight is not None else args.to
    try:
        weights = rollout_weights(policy.rollout.weights(), args.group, percent,
                                  frozenset(rejected_groups(r, tier)))
        new = policy.with_weights(weights, canary=args.group)
    except (ValueError, PolicyError) as exc:
        raise CliError(f"rollout not done: {exc}", EXIT_USAGE) from None
    write_policy(r, tier, new)
    before = dict(policy.rollout.weights())
    data = {"tier": tier, "canary": args.group, "before": before, "after": dict(weights)}
    print_result(data, args.json, lambda _: f"tier {tier}: " + ", ".join(
        f"{n} {before[n]:g} -> {w:g}" for n, w in weights) + " (the commander records it in the ledger)")
    return 0



