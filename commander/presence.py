"""The commander's entry in ``fleet:commanders`` (leader or standby, shown by ``fleet status``
and ``fleet top``), and its clean exit: the workers stopped if asked, the lease given up, the
entry removed."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

import redis
from redis.exceptions import ResponseError

from commander.leadership import Leadership
from commander.metrics import Metrics
from commander.runtime import Runtime
from protocol import keys
from protocol.models import CommanderInfo
from stores.bad_state import DEFAULT, BadState, reject_wrong_type
from stores.commanders import deregister_commander, forget_commanders, register_commander
from stores.retry import TRANSIENT

log = logging.getLogger("fleet.commander")
FORGET_COMMANDER_S = 3600.0  # the leader removes entries of commanders not seen for this long


class Presence:
    """One commander's entry in the commanders' registry, from its start to its exit."""

    def __init__(self, r: redis.Redis, runtime: Runtime, leadership: Leadership, *,
                 stop_workers_on_exit: bool, metrics: Metrics | None,
                 clock: Callable[[], float], bad: BadState = DEFAULT) -> None:
        self._r, self._runtime, self._leadership, self._bad = r, runtime, leadership, bad
        self._stop_workers = stop_workers_on_exit
        self._metrics, self._clock = metrics, clock
        self._started = clock()

    def register(self) -> None:
        """Write the entry (role, epoch, where its /metrics is); the leader also removes the
        entries of commanders long gone."""
        leading = self._leadership.leading
        info = CommanderInfo(commander=self._leadership.commander_id, pid=os.getpid(),
                             host=socket.gethostname(), started=self._started,
                             role="leader" if leading else "standby", epoch=self._leadership.epoch or 0,
                             metrics=self._metrics.address if self._metrics else "", seen=self._clock(),
                             crash_loop=self._runtime.crash_loop() if leading else {})
        try:
            register_commander(self._r, info)
            if leading:
                forget_commanders(self._r, self._clock() - FORGET_COMMANDER_S, self._bad)
        except ResponseError as exc:  # the registry holds another type: no entry, the loop goes on
            self._bad.note("commander", keys.COMMANDERS, "", reject_wrong_type(exc))

    def leave(self, redis_away: bool = False) -> None:
        """Stop the workers if asked (fleet down), give up the lease, leave the registry. With
        Redis unreachable at the last try, only the workers: each Redis call would spend the
        client's reconnect attempts, the lease expires on its own and the entry shows as gone."""
        stop_workers = self._leadership.leading and self._stop_workers
        if redis_away and not stop_workers:
            log.warning("Redis unreachable: exiting without giving up the lease (it expires on its own)")
            return
        try:
            if stop_workers:
                log.info("stopping every worker before exit (fleet down)")
                self._runtime.stop_all()
            self._leadership.step_down()
            deregister_commander(self._r, self._leadership.commander_id)
        except TRANSIENT as exc:
            log.warning("clean shutdown incomplete (%s); the lease expires on its own", exc)
