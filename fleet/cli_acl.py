"""``fleet acl``: the Redis ACL file of Fleet's roles (``protocol.acl``), and the roles' table.

The file has one ``user`` line per role, each with its password's SHA-256 (never the password),
and the ``default`` user as the admin, with a password of its own (``--no-admin``: turned off,
for a server whose admins have users of their own). Passwords come from
``$FLEET_ACL_PASSWORD_<ROLE>`` (``_ADMIN`` for the admin), else the passwords file, else are
generated into it (mode 0600); ``--show-passwords`` prints them, nothing else does.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fleet.cli_base import EXIT_USAGE, CliError
from protocol.acl import CONNECTION, ROLES, SCRIPTING, acl_file
from stores.roles import ADMIN, PasswordsFileError, default_passwords_path, ensure_passwords, write_secret


def add_acl_command(sub: argparse._SubParsersAction[Any]) -> None:
    """``fleet acl [--out PATH] [--passwords PATH] [--no-admin] [--show-passwords] [--table]``."""
    a = sub.add_parser("acl", help="print the Redis ACL file of Fleet's roles (one user per process kind)",
                       description=__doc__)
    a.add_argument("--out", type=Path, help="write the ACL file here (mode 0600) instead of printing it")
    a.add_argument("--passwords", type=Path, default=None,
                   help="the roles' passwords file, created if missing (default: acl-passwords in "
                        "the local fleet's folder, .fleet/)")
    a.add_argument("--no-admin", action="store_true",
                   help="turn the default user off (default: it is the admin, with its own password)")
    a.add_argument("--show-passwords", action="store_true",
                   help="print each role and its password (one per line) instead of the file")
    a.add_argument("--rq", action="store_true",
                   help="RQ keeps its queues on this Redis too (the relay, RQ workers and `fleet jobs` "
                        "without --rq-url): the roles that use RQ get RQ's rights on rq:* alone")
    a.add_argument("--table", action="store_true", help="print the roles as a Markdown table")
    a.set_defaults(func=cmd_acl)


def cmd_acl(args: argparse.Namespace) -> int:
    if args.table:
        print(roles_table(), end="")
        return 0
    path = args.passwords or default_passwords_path()
    try:
        passwords = ensure_passwords(path)
    except (PasswordsFileError, OSError) as exc:
        raise CliError(f"passwords file: {exc}", EXIT_USAGE) from None
    if args.show_passwords:
        for role in (*(r.name for r in ROLES), ADMIN):
            print(f"{role} {passwords[role]}")
        return 0
    text = acl_file(passwords, default=None if args.no_admin else passwords[ADMIN], shared_with_rq=args.rq)
    if args.out is None:
        print(text, end="")
        return 0
    try:
        write_secret(args.out, text)
    except OSError as exc:
        raise CliError(f"cannot write {args.out}: {exc.strerror}") from None
    print(f"wrote {args.out} ({len(ROLES)} roles; passwords in {path})")
    return 0


def roles_table() -> str:
    """The roles as a Markdown table: name, who uses it, commands, key patterns (and channels)."""
    rows = ["| role | used by | commands | keys |", "|---|---|---|---|"]
    for role in ROLES:
        scripting = SCRIPTING.split() if role.scripting else []
        granted = (*(f"+{c}" for c in (*CONNECTION, *role.commands)), *scripting)
        commands = " ".join(f"`{c}`".replace("|", "\\|") for c in granted)
        keys = " ".join([*(f"`{k.render()}`" for k in role.keys), *(f"`{x}`" for x in role.selectors)])
        rq = " (with `--rq`: RQ's rights on `rq:*`)" if role.rq else ""
        rows.append(f"| `{role.name}` | {role.used_by} | {commands} | {keys}{rq} |")
    return "\n".join(rows) + "\n"
