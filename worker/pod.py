"""A worker in a Kubernetes pod: its health endpoint, and its wait for SIGTERM after a drain.

``Pod`` runs the ``Worker`` when ``fleet worker`` has a pod name (the downward API's
``metadata.name`` in ``FLEET_WORKER_POD_NAME``) or a health port (``FLEET_WORKER_HEALTH_PORT``).

- ``GET /readyz``: 200 while the worker serves: registered (its start is done), not draining,
  and its last read of the tier's ready stream succeeded; else 503. The ReplicaSet deletes
  not-ready pods first on a scale-down, and a draining worker is no capacity.
- ``GET /livez``: 200 while its heartbeat loop turns: a beat was attempted (sent, or met a
  Redis error it backs off from) within the heartbeat's TTL; 503 when the loop is wedged (an
  event loop stuck, a call hung on a dead connection). A Redis outage is not a reason to be
  restarted: the kubelet would restart every worker at once and back them off for minutes, so
  the body says when a beat last *reached* Redis, and only readiness depends on it.
- A worker drained by command (the commander's retire) waits up to ``drain_linger_s`` for its
  SIGTERM before it exits: the commander lowers the Deployment's replicas right after the drain,
  and a container that exited first would be restarted by the kubelet (restartPolicy Always)
  just before its pod is deleted. SIGTERM itself drains the worker within the pod's
  ``terminationGracePeriodSeconds``: the worker finishes the turn in flight per user, hands the
  rest on and exits 0.

Both answers are JSON: ``{"ok": bool, "why": str, "worker": id}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler

from worker.app import Worker

log = logging.getLogger("fleet.worker")


class Pod:
    """Runs a ``Worker`` with a health endpoint, lingering after a drain by command in a pod."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.settings = worker.settings
        self.lingering = False  # drained and out of the registry, waiting for SIGTERM

    async def run(self) -> int:
        """Serve the health endpoint while the worker runs; in a pod, linger after a drain."""
        runner = await self._serve_health()
        try:
            code = await self.worker.run()
            await self._linger()
            return code
        finally:
            if runner is not None:
                await runner.cleanup()

    async def _linger(self) -> None:
        wait = self.settings.drain_linger_s
        terminated = self.worker.terminated
        if not self.settings.pod_name or terminated.is_set() or wait <= 0:
            return
        self.lingering = True
        log.info("worker %s drained: waiting up to %.0fs for the pod's SIGTERM", self.worker.worker_id, wait)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(terminated.wait(), wait)

    # --- the answers -------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """Whether it takes turns now, and why not."""
        w = self.worker
        if w.draining:
            return False, "draining"
        if w.state != "ready":
            return False, "starting: not registered yet"
        if w.redis_away:
            return False, "the last read of the ready stream failed"
        return True, "registered and reading"

    def liveness(self) -> tuple[bool, str]:
        """Whether its heartbeat loop turns (or it stopped on purpose), and why not."""
        if self.lingering or self.worker.stopping:
            return True, "stopping"
        beat = self.worker.heartbeat
        now = time.monotonic()
        ttl = self.settings.heartbeat_ttl_ms / 1000
        tried = now - beat.tried
        reached = "never" if beat.reached is None else f"{now - beat.reached:.1f}s ago"
        if tried > ttl:
            return False, (f"no heartbeat attempted for {tried:.1f}s (TTL {ttl:g}s); "
                           f"last reached Redis {reached}")
        return True, f"heartbeat attempted {tried:.1f}s ago; last reached Redis {reached}"

    # --- the endpoint ------------------------------------------------------------------
    async def _serve_health(self) -> web.AppRunner | None:
        port = self.settings.health_port
        if port is None:
            return None
        app = web.Application()
        app.router.add_get("/readyz", self._answer(self.readiness))
        app.router.add_get("/livez", self._answer(self.liveness))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.health_host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        log.info("worker %s serves /readyz and /livez on %s:%s", self.worker.worker_id,
                 self.settings.health_host, bound)
        return runner

    def _answer(self, check: Callable[[], tuple[bool, str]]) -> Handler:
        async def handle(_request: web.Request) -> web.StreamResponse:
            ok, why = check()
            return web.json_response({"ok": ok, "why": why, "worker": self.worker.worker_id},
                                     status=200 if ok else 503)

        return handle
