"""``fleet policy`` (get, set, edit), ``fleet status``, ``fleet dead-letters`` and ``fleet install``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any, cast

import redis

from fleet.cli_base import EXIT_USAGE, CliError, cli_client, known_handlers, print_result
from fleet.status import PAGE_SIZE
from protocol import keys
from protocol.policy import (
    PolicyError,
    RqPolicy,
    TurnsPolicy,
    field_values,
    parse_assignments,
    parse_policy,
    updated,
)
from stores import functions
from stores.cluster import is_cluster
from stores.group_assignment import rejected_groups
from stores.policies import has_policy_key, read_policy, write_policy


# --- policy: a field is named by its dotted path or, when unique, its last name ------------
def _defaults_line() -> str:
    p = TurnsPolicy()
    return (f"handler={p.handler}, concurrency={p.concurrency}, min_workers={p.min_workers}, "
            f"max_workers={p.max_workers}")


def cmd_policy_get(args: argparse.Namespace) -> int:
    r = cli_client(args)
    if not has_policy_key(r, args.tier):  # checked first: reading would record a verdict
        raise CliError(f"tier {args.tier!r} has no policy (defaults would apply: {_defaults_line()}; "
                       f"`fleet policy set {args.tier} key=value ...` creates it)")
    from fleet.status import policy_verdict

    read = read_policy(r, args.tier, known_handlers())
    error, by = policy_verdict(r, args.tier, "", read.error)
    groups = rejected_groups(r, args.tier)  # the commander's verdicts: a group it cannot start
    data = {"tier": args.tier, "source": read.source, "rejected": error, "rejected_by": by,
            "groups_rejected": groups, "policy": read.policy.model_dump(mode="json")}

    def text(_: Any) -> str:
        lines = [f"tier {args.tier} (policy from {read.source})"]
        if error:
            lines.append(f"REJECTED edit of {keys.policy(args.tier)}{f' by {by}' if by else ''}: "
                         f"{error}; running the last good one")
        lines += [f"REJECTED group {name}: {why}" for name, why in sorted(groups.items())]
        lines += [f"  {k} = {json.dumps(v)}" for k, v in field_values(read.policy)]
        return "\n".join(lines)

    print_result(data, args.json, text)
    return 0


def cmd_policy_set(args: argparse.Namespace) -> int:
    r = cli_client(args)
    try:
        changes = parse_assignments(args.assignments)
        current = read_policy(r, args.tier, known_handlers()).policy
        policy = updated(current, changes, known_handlers())
    except PolicyError as exc:
        raise CliError(f"policy not changed: {exc}", EXIT_USAGE) from None
    write_policy(r, args.tier, policy)
    print_result(policy.model_dump(mode="json"), args.json,
           lambda _: f"tier {args.tier}: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in changes.items()))
    _warn_if_no_worker_has(r, args.tier, policy)
    return 0


def _warn_if_no_worker_has(r: redis.Redis, tier: str, policy: TurnsPolicy | RqPolicy) -> None:
    """The handler check that matters is the workers': say so when none of the tier's live
    workers lists the policy's handler (they keep their last good policy until one does)."""
    from stores.registry import read_registry

    if not isinstance(policy, TurnsPolicy):  # an rq tier runs RQ's jobs, no handler
        return
    handler = policy.handler

    live = [w for w in read_registry(r).live(tier) if w.handlers]
    if live and not any(handler in w.handlers for w in live):
        have = sorted({h for w in live for h in w.handlers})
        print(f"warning: no live worker of tier {tier} has handler {handler!r} (they have: "
              f"{', '.join(have)}): they keep running their last good policy until it is "
              f"installed where they run; see the docs, 'Handlers'", file=sys.stderr)


def cmd_policy_edit(args: argparse.Namespace) -> int:
    r = cli_client(args)
    current = read_policy(r, args.tier, known_handlers()).policy
    with tempfile.NamedTemporaryFile("w+", suffix=".json", delete=False) as f:
        f.write(json.dumps(current.model_dump(mode="json"), indent=2) + "\n")
        path = f.name
    try:
        subprocess.run([os.environ.get("EDITOR", "vi"), path], check=True)
        with open(path) as f:
            policy = parse_policy(f.read(), known_handlers())
    except PolicyError as exc:
        raise CliError(f"policy not changed: {exc}", EXIT_USAGE) from None
    except (OSError, subprocess.CalledProcessError) as exc:
        raise CliError(f"editor failed: {exc}") from None
    finally:
        os.unlink(path)
    write_policy(r, args.tier, policy)
    print(f"tier {args.tier}: policy saved")
    _warn_if_no_worker_has(r, args.tier, policy)
    return 0


# --- status / dead letters / worker ---------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    from fleet.status import WorkerPage, snapshot

    here = known_handlers()
    page = WorkerPage(tier=args.tier, page=args.page, size=None if args.all else args.page_size)
    snap = snapshot(cli_client(args), list(here), page)
    snap["handlers_unavailable"] = _unavailable(here.unavailable, snap.pop("handler_failures"))
    print_result(snap, args.json, _status_text)
    return 0


def _unavailable(here: Mapping[str, str],
                 failures: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Handlers whose entry point failed to load, here or on live workers: name -> the first
    error seen and where (``here``, the first worker ids; ``where_total``: on how many workers);
    ``fleet handlers`` shows every detail."""
    out: dict[str, dict[str, Any]] = {n: {"error": e, "where": ["here"], "where_total": 0}
                                      for n, e in here.items()}
    for name, f in failures.items():
        got = out.setdefault(name, {"error": f["error"], "where": [], "where_total": 0})
        got["where"] += f["where"]
        got["where_total"] += f["where_total"]
    return out


def _status_text(snap: dict[str, Any]) -> str:
    lines = [_commander_line(snap)]
    lines += [f"handler {name} unavailable ({_where(u)}): {u['error']} (`fleet handlers`)"
              for name, u in snap.get("handlers_unavailable", {}).items()]
    leader = (snap.get("leader") or "").rpartition("|")[0]
    lines += [f"tier {pool} CRASH LOOP: {why}" for c in snap.get("commanders", [])
              if c.get("commander") == leader for pool, why in (c.get("crash_loop") or {}).items()]
    lines.append("")
    lines += [f"{'TIER':<12}{'WORKERS':>8}{'NO-HB':>6}{'MIN':>5}{'MAX':>5}{'BACKLOG':>9}{'PENDING':>9}"
             f"{'ACTIVE':>8}{'DEAD':>6}  POLICY"]
    for tier, t in snap["tiers"].items():
        by = f" by {t['policy_rejected_by']}" if t.get("policy_rejected_by") else ""
        policy = t["policy_source"] + (f" (REJECTED{by}: {t['policy_error']})" if t["policy_error"] else "")
        if t.get("ready_shards", 1) > 1:
            policy += f", {t['ready_shards']} ready shards"
        if t.get("kind") == "rq":
            policy += _rq_text(t)
        policy += _group_note(t) + _dead_note(t)
        lines.append(f"{tier:<12}{t['workers_alive']:>8}{t.get('workers_dead', 0):>6}"
                     f"{t['min_workers']:>5}{t['max_workers']:>5}"
                     f"{t['backlog']:>9}{t['pending']:>9}{t['active_users']:>8}{t['dead_letters']:>6}"
                     f"  {policy}")
    lines.append("")
    lines.append(f"{'WORKER':<24}{'TIER':<10}{'PID':>8}  {'HOST':<16}{'AGE':>8}  STATE")
    for w in snap["workers"]:  # (in the list's order: by tier, then id)
        state = "alive" if w["alive"] else "no heartbeat"
        lines.append(f"{w['worker']:<24}{w['tier']:<10}{w['pid']:>8}  {w['host'][:15]:<16}"
                     f"{w['age_s']:>7.0f}s  {state}")
    lines += _page_lines(snap.get("workers_page"))
    if snap.get("bad_state"):
        lines += ["", "BAD STATE (skipped; counted in the commander's fleet_state_errors_total)"]
        lines += [f"  {_bad_line(e)}" for e in snap["bad_state"]]
    if snap.get("events"):
        lines += ["", "LAST EVENTS"]
        lines += [f"  {_event_line(e)}" for e in snap["events"]]
    return "\n".join(lines)


def _where(u: Mapping[str, Any]) -> str:
    """Where a handler is unavailable: here, the first workers, and how many more."""
    more = u.get("where_total", 0) - (len(u["where"]) - ("here" in u["where"]))
    return ", ".join(u["where"]) + (f" and {more} more workers" if more > 0 else "")


def _page_lines(p: Mapping[str, Any] | None) -> list[str]:
    """Under the worker list: which workers it shows, and how to see the others."""
    if not p:
        return []
    of = f" (tier {p['tier']})" if p["tier"] else ""
    if p["shown"] == p["total"]:
        return [] if p["total"] else [f"  (no workers{of})"]
    shown = f"workers {p['first']}-{p['first'] + p['shown'] - 1}" if p["shown"] else "no workers"
    line = f"{shown} of {p['total']}{of} shown, by tier then id"
    if p["page"] < p["pages"]:
        tier = f" --tier {p['tier']}" if p["tier"] else ""
        size = f" --page-size {p['page_size']}" if p["page_size"] != PAGE_SIZE else ""
        line += f"; next: `fleet status{tier} --page {p['page'] + 1}{size}`"
    return [line + f" (of {p['pages']} pages; --tier T: one tier's; --all: every worker)"]


def _bad_line(e: dict[str, Any]) -> str:
    """A bad entry of shared state: its kind, key (and member) and why it was skipped."""
    member = f" {e['member']!r}" if e.get("member") else ""
    return f"{e['kind']:<12} {e['key']}{member}: {e['reason']}"


def _rq_text(t: dict[str, Any]) -> str:
    """An rq tier's part of its POLICY column: queues, failed jobs, the oldest queued job's age."""
    if "rq_error" in t:
        return f", rq: {t['rq_error']}"
    queues = ",".join(q["name"] for q in t.get("queues", []))
    return f", rq on {queues}: {t['failed_jobs']} failed, oldest queued {t['oldest_job_age_s']:.0f}s"


def _dead_note(t: dict[str, Any]) -> str:
    """A tier's newest dead letters by kind (``delivery_limit``, ``user_data``, ...), if any."""
    kinds = t.get("dead_letter_kinds") or {}
    return ", dead: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) if kinds else ""


def _group_note(t: dict[str, Any]) -> str:
    """A grouped tier's weights (and canary); a group's weight, and why it is rejected."""
    if "weights" in t:
        canary = f", canary {t['canary']}" if t.get("canary") else ""
        return ", groups " + " / ".join(f"{n} {w:g}" for n, w in t["weights"].items()) + canary
    if "weight" in t:
        why = f", REJECTED: {t['group_rejected']}" if t.get("group_rejected") else ""
        return f", weight {t['weight']:g}{why}"
    return ""


def _commander_line(snap: dict[str, Any]) -> str:
    leader, _, epoch = (snap.get("leader") or "").partition("|")
    head = f"commander: {leader} leads (epoch {epoch})" if leader else "commander: none leads"
    url = next((c.get("metrics_url") for c in snap.get("commanders", [])
                if c.get("commander") == leader and c.get("metrics_url")), None)
    head += f", metrics {url}" if url else ""
    head += f", monitor {snap['monitor_url']}" if snap.get("monitor_url") else ""
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

    rows = dead_letters(cli_client(args), args.tier, args.count)
    print_result(rows, args.json, lambda rows: "\n".join(
        f"{d['id']}  user={d.get('user', '')!r} turn={d.get('turn_id', '')}  {d.get('reason', '')}"
        for d in rows) or "no dead letters")
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    """Load Fleet's functions library (an admin connection: ``FUNCTION LOAD``), on a Cluster on
    every primary; ``--check``: say whether it is there (0) or missing / another version (1)."""
    if args.url:
        args.redis_url = args.url
    r = cli_client(args)
    if args.check:
        state, found = functions.library_state(r)
        print(f"Fleet functions library: {state} (this Fleet needs version {functions.VERSION}, "
              f"Redis has {found or 'none'})")
        return 0 if state == "ok" else 1
    try:
        version = functions.install(r)
    except redis.ResponseError as exc:
        raise CliError(f"cannot load the functions library: {exc} (`fleet install` needs an admin "
                       "connection: a user allowed FUNCTION LOAD)") from None
    where = f"every primary ({len(cast(Any, r).get_primaries())})" if is_cluster(r) else "Redis"
    print(f"installed the Fleet functions library version {version} on {where}")
    return 0
