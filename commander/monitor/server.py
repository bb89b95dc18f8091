"""The commander's web server on aiohttp: ``/metrics``, ``/healthz``, the monitor page and ``/api``.

One address serves all of it (``--metrics-host``/``--metrics-port``, loopback by default), from
a thread of its own with its own event loop, so the commander's loop never waits on a viewer.

Who may do what (``Access``):

- With no token the server binds loopback only (``refusal`` says why another address is refused)
  and answers only a request whose ``Host`` is a loopback name or address or one of the allowed
  hosts (421 otherwise): a DNS-rebound name reaches the port with its own name as ``Host``.
- With a token every request needs one: the read token (``FLEET_COMMANDER_METRICS_TOKEN``) reads,
  the operator token (``FLEET_COMMANDER_OPERATOR_TOKEN``) reads and writes (403 for a write with
  the read token). A client sends ``Authorization: Bearer <token>``; a browser opens
  ``/?token=<token>`` once, which sets an HttpOnly, SameSite=Strict cookie (a keyed hash of the
  token, never the token) and redirects to ``/``.
- A write (any method but GET and HEAD) that carries an ``Origin`` must come from the server's own
  origin or an allowed host's (403 otherwise): a page elsewhere cannot post with the cookie.

Tokens are compared in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from commander.monitor.access import COOKIE, Access, cookie_value, grant, hostname, refusal
from commander.monitor.api import Handler, Monitor, api_app

log = logging.getLogger("fleet.monitor")
STATIC = Path(__file__).with_name("static")
STOP_TIMEOUT_S = 5.0
READS = {"GET", "HEAD"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                               "script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
TOKEN_PAGE = ("<!doctype html><title>Fleet monitor</title><p>This monitor needs its token: open "
              "<code>/?token=&lt;token&gt;</code> once (the commander's FLEET_COMMANDER_OPERATOR_TOKEN, "
              "or FLEET_COMMANDER_METRICS_TOKEN to read only).</p>")


def _same_origin(request: web.Request, access: Access) -> bool:
    """Whether a write's ``Origin`` (when sent) is the server's own or an allowed host's."""
    origin = request.headers.get("Origin")
    if origin is None:  # not a browser's cross-site request: curl, scripts (the token decides)
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (a sandboxed or file page) and anything malformed
    own = request.headers.get("Host", "")
    if parts.netloc.lower() == own.lower():
        return True
    return access.allows(hostname(parts.netloc))


def _refuse(status: int, error: str) -> web.Response:
    return web.json_response({"error": error}, status=status, headers=SECURITY_HEADERS)


def _auth(access: Access) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not access.guarded and not access.host_allowed(request.headers.get("Host", "")):
            return _refuse(421, "this monitor answers only to its loopback address (or an allowed host: "
                                "FLEET_COMMANDER_ALLOWED_HOSTS)")
        given = request.query.get("token")
        if access.guarded and request.path == "/" and given is not None:
            return _login(given, access)
        granted = grant(request.headers.get("Authorization"), request.cookies.get(COOKIE), access)
        if granted == "none":
            if request.path in ("/", "/index.html"):
                return web.Response(status=401, text=TOKEN_PAGE, content_type="text/html",
                                    headers=SECURITY_HEADERS)
            return web.Response(status=401, text="unauthorized\n",
                                headers={"WWW-Authenticate": 'Bearer realm="fleet"'})
        if request.method not in READS:
            if granted != "write":
                return _refuse(403, "this needs the operator token (FLEET_COMMANDER_OPERATOR_TOKEN)")
            if not _same_origin(request, access):
                return _refuse(403, "refused: the request's origin is not this monitor's")
        response = await handler(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    return middleware


def _login(given: str, access: Access) -> web.Response:
    """``/?token=``: a right token sets its session cookie and leaves the token out of the URL."""
    for token, _ in access.tokens():
        if hmac.compare_digest(given.encode(), token.encode()):
            response = web.Response(status=303, headers={"Location": "/"})
            response.set_cookie(COOKIE, cookie_value(token), httponly=True, samesite="Strict", path="/")
            return response
    return web.Response(status=401, text=TOKEN_PAGE, content_type="text/html", headers=SECURITY_HEADERS)


def build_app(metrics: Any | None = None, monitor: Monitor | None = None,
              access: Access | None = None) -> web.Application:
    """The application: ``/metrics`` (``metrics.render()``), ``/healthz``, the page, ``/api``."""
    app = web.Application(middlewares=[_auth(access or Access())])

    async def render_metrics(_request: web.Request) -> web.Response:
        if metrics is None:
            raise web.HTTPNotFound(text="no metrics here\n")
        body = metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def index(_request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.router.add_get("/metrics", render_metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC, append_version=False)
    if monitor is not None:
        app.add_subapp("/api/", api_app(monitor))
    return app


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    sock.setblocking(False)
    return sock


class MonitorServer:
    """Serves an application from a daemon thread with its own event loop."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def start(self, host: str = "127.0.0.1", port: int = 0, access: Access | None = None) -> tuple[str, int]:
        """Bind ``host:port`` (0: any free port) and serve; returns the bound (host, port).

        A ValueError (``refusal``) for an address beyond loopback without a token."""
        if self._thread is not None:
            raise RuntimeError("already serving")
        why = refusal(host, access or Access())
        if why is not None:
            raise ValueError(why)
        sock = _listen(host, port)
        loop = asyncio.new_event_loop()
        ready: list[BaseException | None] = []
        started = threading.Event()
        thread = threading.Thread(target=self._run, args=(loop, sock, ready, started),
                                  name="fleet-monitor", daemon=True)
        thread.start()
        started.wait(STOP_TIMEOUT_S)
        if not ready or ready[0] is not None:  # (a failed start ends the thread by itself)
            thread.join(STOP_TIMEOUT_S)
            raise RuntimeError(f"the monitor did not start: {ready[0] if ready else 'timed out'}")
        self._loop, self._thread = loop, thread
        bound = sock.getsockname()
        return str(bound[0]), int(bound[1])

    def _run(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
             ready: list[BaseException | None], started: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.SockSite(runner, sock).start())
            ready.append(None)
        except Exception as exc:  # noqa: BLE001 - handed to start(), which raises it
            ready.append(exc)
        started.set()
        try:
            if ready[0] is None:
                loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            sock.close()
            loop.close()
            self._stopped.set()

    def stop(self) -> None:
        """Stop serving and close the port (idempotent)."""
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_TIMEOUT_S)
        if thread.is_alive():
            log.warning("the monitor's thread did not stop within %.0fs", STOP_TIMEOUT_S)


def serve(metrics: Any | None, monitor: Monitor | None, host: str, port: int,
          access: Access) -> tuple[MonitorServer, tuple[str, int]]:
    """Build the application and serve it; returns the server and its bound (host, port)."""
    server = MonitorServer(build_app(metrics, monitor, access))
    return server, server.start(host, port, access)
