"""How a local worker process is started: its id, its command line, its environment.

Every worker runs in its own session (``start_new_session``): it outlives a commander restart,
and a Ctrl-C in the commander's terminal does not reach it (the commander drains it instead).
"""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from protocol.groups import validate_pool
from protocol.ids import validate_token
from stores import local_fleet

FORK_TEMPLATE_MODULE = "worker.forkserver"  # the fork template (run with -m: in every forked worker's argv)
WORKER_ID = re.compile(r"(?P<tier>[a-z0-9][a-z0-9_-]{0,31})-[0-9a-f]{8}")  # new_worker_id's form


class SpawnError(RuntimeError):
    """A worker process could not be started."""


def new_worker_id(tier: str) -> str:
    """``<tier>-<8 hex>`` (``<tier>.<group>-<8 hex>`` in a group's pool): unique enough for a
    fleet, readable in ``fleet status``."""
    return validate_token(f"{validate_pool(tier)}-{secrets.token_hex(4)}", "worker id")


def tier_of(worker_id: str) -> str | None:
    """The tier of a worker id the process runtime made (``<tier>-<8 hex>``), else None."""
    m = WORKER_ID.fullmatch(worker_id)
    return m["tier"] if m else None


def worker_command(tier: str, worker_id: str, python: str | None = None) -> list[str]:
    """The argv of a real worker (the contract of ``worker/__main__.py``), run by ``python``
    (a group's virtualenv) or by this interpreter."""
    return [python or sys.executable, "-m", "worker", "--tier", tier, "--worker-id", worker_id]


def rq_worker_command(queues: Sequence[str], worker_id: str) -> list[str]:
    """The argv of an RQ worker of Fleet's (``worker/rq/rq_worker.py``) on ``queues``."""
    return [sys.executable, "-m", "worker.rq.rq_worker", "--queues", ",".join(queues), "--name", worker_id]


def fork_template_command(python: str, fd: int) -> list[str]:
    """The argv of a fork template serving requests on the socket ``fd``."""
    return [python, "-m", FORK_TEMPLATE_MODULE, "--fd", str(fd)]


def child_env(url: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: ``REDIS_URL`` set, the code importable, output unbuffered."""
    return local_fleet.child_env({"REDIS_URL": url}, base)


def start_fresh(argv: list[str], env: Mapping[str, str], log_path: Path,
                what: str = "worker") -> subprocess.Popen[bytes]:
    """Start ``argv`` as a fresh process in its own session, output appended to ``log_path``."""
    try:
        with open(log_path, "ab") as out:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=dict(env),
                                    start_new_session=True)
    except OSError as exc:
        raise SpawnError(f"cannot start {what}: {argv[0]}: {exc}") from exc
