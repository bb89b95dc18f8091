"""``fleet handlers``: every handler that loads here and on each tier's live workers, and every
handler whose entry point failed to load, with its error."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from fleet.cli_base import CliError, cli_client, known_handlers, print_result
from protocol.models import WorkerInfo
from stores.connection import NoFleetFound


def tier_handlers(infos: Iterable[WorkerInfo]) -> dict[str, dict[str, Any]]:
    """By tier: its live workers' count, the handlers any of them loads, and the load errors
    (name -> the error, from the first worker that reported one) of those none of them loads."""
    tiers: dict[str, dict[str, Any]] = {}
    for info in infos:
        row = tiers.setdefault(info.tier, {"workers": 0, "available": set(), "unavailable": {}})
        row["workers"] += 1
        row["available"].update(info.handlers)
        for name, error in info.handler_errors.items():
            row["unavailable"].setdefault(name, error)
    for row in tiers.values():
        errors = sorted(row["unavailable"].items())
        row["unavailable"] = {n: e for n, e in errors if n not in row["available"]}
        row["available"] = sorted(row["available"])
    return dict(sorted(tiers.items()))


def handlers_report(args: argparse.Namespace) -> dict[str, Any]:
    """What ``fleet handlers`` shows: this environment's handlers, and the live workers' by tier
    (``tiers_error``: why they could not be read)."""
    from stores.registry import read_registry

    here = known_handlers()
    data: dict[str, Any] = {"here": {"available": list(here.names), "unavailable": dict(here.unavailable),
                                     "not_installed": dict(here.not_installed)},
                            "tiers": {}, "tiers_error": None}
    try:
        data["tiers"] = tier_handlers(read_registry(cli_client(args)).live())
    except (CliError, NoFleetFound) as exc:  # the local list is still worth showing
        data["tiers_error"] = str(exc)
    return data


def _text(data: dict[str, Any]) -> str:
    lines = [_block("here (this command's environment)", data["here"])]
    lines += [_block(f"tier {tier} ({row['workers']} live worker{'s' if row['workers'] != 1 else ''})", row)
              for tier, row in data["tiers"].items()]
    if data["tiers_error"]:
        lines.append(f"the workers' handlers are not shown: {data['tiers_error']}")
    elif not data["tiers"]:
        lines.append("no live worker")
    return "\n".join(lines)


def _block(title: str, row: dict[str, Any]) -> str:
    lines = [f"{title}:", f"  available: {', '.join(row['available']) or 'none'}"]
    lines += [f"  UNAVAILABLE {name}: {error}" for name, error in row["unavailable"].items()]
    lines += [f"  not installed {name}: {why}" for name, why in row.get("not_installed", {}).items()]
    return "\n".join(lines)


def cmd_handlers(args: argparse.Namespace) -> int:
    print_result(handlers_report(args), args.json, _text)
    return 0


def add_handlers_command(sub: Any) -> None:
    """``fleet handlers [--json]``."""
    h = sub.add_parser("handlers", help="the handlers that load here and on each tier's workers, "
                                        "and why any does not",
                       description=__doc__.split("\n\n")[0] if __doc__ else None)
    h.add_argument("--json", action="store_true", help="print everything as one JSON object")
    h.set_defaults(func=cmd_handlers)
