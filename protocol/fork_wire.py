"""The fork template's wire format, shared by the template (in ``worker/``) and its client
(``commander/runtime/process/fork_client.py``).

One JSON object per ``SOCK_SEQPACKET`` message.
  template -> client: ``{"ready": pid}`` once; ``{"exit": pid, "code": n}`` per reaped child;
                      ``{"id": n, "pid": pid}`` or ``{"id": n, "error": "..."}`` per request.
  client -> template: ``{"id", "tier", "worker_id", "log", "cwd", "set": {}, "unset": []}``.
"""

from __future__ import annotations

from typing import Any

MAX_MSG = 256 * 1024  # a request carries only the environment that differs from the template's
MAX_EXITS = 10_000  # exit codes kept on either side for the runtime to collect (oldest dropped first)
Message = dict[str, Any]
