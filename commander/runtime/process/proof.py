"""The proof that a local process was started by this host's commanders: a secret it carries.

The ``process`` runtime signals (drains, kills) the workers it adopts, so a registry entry
naming a pid is never enough: anyone who can write to Redis could name any process of the
commander's user. Each worker, each fork template (whose forks inherit its environment) and
each RQ worker is started with :data:`PROOF_ENV` set to a random secret kept in
``<run_dir>/spawn-proof`` (mode 0600, made by the first commander, read by the next ones: a
restarted commander still adopts its predecessor's workers). Adoption reads the variable from
the process's initial environment (``/proc/<pid>/environ`` on Linux, which only the process's
own user may read) and adopts only a process that carries the secret.
"""

from __future__ import annotations

import enum
import hmac
import logging
import os
import re
import secrets
import time
from pathlib import Path

import psutil

log = logging.getLogger(__name__)
PROOF_ENV = "FLEET_SPAWN_PROOF"
PROOF_FILE = "spawn-proof"
_SECRET = re.compile(r"[0-9a-f]{64}")


class Proof(enum.StrEnum):
    """What a process's environment says about who started it."""

    PROVEN = "proven"  # it carries this host's secret
    MISSING = "missing"  # it carries no secret
    WRONG = "wrong"  # it carries another
    UNREADABLE = "unreadable"  # its environment cannot be read (another user's process, or gone)


def load_secret(run_dir: Path) -> str:
    """The secret in ``run_dir``'s proof file, made (0600, atomically: two commanders starting
    at once read the same) if there is none; a file others may read is made private first, one
    that holds no secret is replaced (both with a warning)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / PROOF_FILE
    try:
        secret = path.read_text().strip()
    except FileNotFoundError:
        return _make(path, replace=False)
    if path.stat().st_mode & 0o077:
        log.warning("%s was readable by others: made private (0600)", path)
        path.chmod(0o600)
    if not _SECRET.fullmatch(secret):
        log.warning("%s holds no secret: writing a new one (workers started with the old one are "
                    "no longer adopted)", path)
        return _make(path, replace=True)
    return secret


def _make(path: Path, replace: bool) -> str:
    """Write a new secret to ``path`` through a private temporary file; the one in ``path`` if
    another process made it first (unless ``replace``)."""
    secret = secrets.token_hex(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    try:
        if replace:
            os.replace(tmp, path)
            return secret
        os.link(tmp, path)  # fails if another commander made it meanwhile: theirs holds
        return secret
    except FileExistsError:
        return path.read_text().strip()
    finally:
        tmp.unlink(missing_ok=True)


def proof_of(proc: psutil.Process, secret: str, wait_s: float = 0.0) -> Proof:
    """Whether ``proc`` was started with ``secret`` in its environment; asked again for up to
    ``wait_s`` while it is not proven (a process whose exec is still in progress shows its
    parent's environment for a few milliseconds after ``Popen`` returns)."""
    deadline = time.monotonic() + wait_s
    while True:
        proof = _read(proc, secret)
        if proof is Proof.PROVEN or time.monotonic() >= deadline:
            return proof
        time.sleep(0.005)


def _read(proc: psutil.Process, secret: str) -> Proof:
    try:
        carried = proc.environ().get(PROOF_ENV)
    except psutil.Error:
        return Proof.UNREADABLE
    if carried is None:
        return Proof.MISSING
    return Proof.PROVEN if hmac.compare_digest(carried, secret) else Proof.WRONG
