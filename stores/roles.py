"""The passwords of Fleet's ACL roles (``protocol.acl``), and a URL made to connect as a role.

A role's password is ``$FLEET_ACL_PASSWORD_<ROLE>`` (``FLEET_ACL_PASSWORD_CLIENT`` for
``fleet-client``, …), else the one in the passwords file (``fleet acl`` and ``fleet up`` write
it: ``acl-passwords`` in the local fleet's folder, or ``--passwords PATH``; JSON, mode 0600).
The runtime processes (worker, commander, relay) take their URL as given, credentials in it;
the CLI's commands connect as the role each needs (:func:`as_role`) when its password is known.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from protocol.acl import ROLE_NAMES
from stores import local_fleet
from stores.connection import resolve_url

PASSWORDS_FILE = "acl-passwords"
ADMIN = "default"  # Redis's default user, kept by the ACL file as the admin (every right)


class PasswordsFileError(ValueError):
    """The passwords file cannot be read or is not a JSON object of strings."""


def password_env(role: str) -> str:
    """The environment variable of ``role``'s password: ``FLEET_ACL_PASSWORD_CLIENT`` for
    ``fleet-client``, ``FLEET_ACL_PASSWORD_ADMIN`` for the admin (the default user)."""
    return "FLEET_ACL_PASSWORD_" + ("ADMIN" if role == ADMIN else role.removeprefix("fleet-").upper())


def default_passwords_path() -> Path:
    """``acl-passwords`` in the local fleet's folder (``$FLEET_HOME``, else the nearest ``.fleet/``)."""
    return local_fleet.fleet_home() / PASSWORDS_FILE


def read_passwords(path: Path) -> dict[str, str]:
    """The passwords of ``path`` (role -> password); {} if there is no such file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise PasswordsFileError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise PasswordsFileError(f"{path} is not JSON") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) and v for v in data.values()):
        raise PasswordsFileError(f"{path} is not a JSON object of role -> password")
    return {str(k): v for k, v in data.items()}


def role_password(role: str, path: Path | None = None) -> str | None:
    """``role``'s password: its environment variable, else the passwords file's; None if neither."""
    if os.environ.get(password_env(role)):
        return os.environ[password_env(role)]
    return read_passwords(path or default_passwords_path()).get(role)


def ensure_passwords(path: Path) -> dict[str, str]:
    """The password of every role and of the admin (``ADMIN``): from its environment variable,
    else from ``path``, else a new random one; ``path`` is (re)written, mode 0600, when it
    lacked one of them."""
    known = read_passwords(path)
    passwords = {role: os.environ.get(password_env(role)) or known.get(role) or secrets.token_hex(32)
                 for role in (*ROLE_NAMES, ADMIN)}
    if any(known.get(role) != pw for role, pw in passwords.items()):
        write_secret(path, json.dumps({**known, **passwords}, indent=2) + "\n")
    return passwords


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600 from its creation on)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as out:
        out.write(text)


def with_credentials(url: str, user: str, password: str) -> str:
    """``url`` with ``user`` and ``password`` as its credentials (percent-encoded), replacing any."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))


def as_role(url: str, role: str, path: Path | None = None) -> str:
    """``url`` connecting as ``role`` when its password is known (:func:`role_password`: it
    replaces any credentials the URL carries), else ``url`` unchanged (a Redis without ACLs, or
    a user of the operator's own in the URL)."""
    password = role_password(role, path)
    return url if password is None else with_credentials(url, role, password)


def process_url(url: str | None, role: str) -> str:
    """The URL a Fleet process of ``role`` connects with: ``url``, else ``$REDIS_URL``, else the
    local fleet's (``stores.connection.resolve_url``), as ``role`` when its password is known."""
    return as_role(resolve_url(url), role)
