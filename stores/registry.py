"""The worker registry (``fleet:workers``) read with liveness: one HGETALL, one pipelined EXISTS.

A registered worker whose heartbeat key has expired is dead: it is returned with
``alive=False`` (callers decide whether to show it or ignore it). An entry that does not
decode is skipped and named in ``unreadable``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from protocol import keys
from protocol.codec import CodecError, decode
from protocol.models import WorkerInfo


@dataclass(frozen=True)
class Registry:
    """Workers by id with whether their heartbeat is alive."""

    workers: dict[str, tuple[WorkerInfo, bool]] = field(default_factory=dict)
    unreadable: tuple[str, ...] = ()

    def live(self, tier: str | None = None) -> list[WorkerInfo]:
        """Workers with a heartbeat (of ``tier``, if given), by id."""
        return [info for wid, (info, alive) in sorted(self.workers.items())
                if alive and (tier is None or info.tier == tier)]


def read_registry(r: redis.Redis) -> Registry:
    """The registry with every worker's liveness, in two round trips."""
    infos, bad = [], []
    for wid, blob in r.hgetall(keys.WORKERS).items():
        try:
            infos.append(decode(WorkerInfo, blob))
        except CodecError:
            bad.append(wid.decode(errors="replace") if isinstance(wid, bytes) else str(wid))
    if not infos:
        return Registry(unreadable=tuple(bad))
    pipe = r.pipeline(transaction=False)
    for info in infos:
        pipe.exists(keys.heartbeat(info.worker))
    alive = pipe.execute()
    return Registry({i.worker: (i, bool(a)) for i, a in zip(infos, alive, strict=True)}, tuple(bad))
