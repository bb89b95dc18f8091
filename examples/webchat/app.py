"""A chat front end on Fleet: a browser sends a message and watches the reply arrive token by
token over server-sent events, and may press Stop. The usual shape of the web tier in front of
Fleet's workers, in one small aiohttp app:

- ``GET /`` the page (``static/index.html``);
- ``GET /api/chat?user=U&text=T`` submits the turn and streams it as server-sent events
  (``AsyncFleet.stream``): ``turn`` (its id, first), ``chunk`` (text as the handler emits it),
  ``restart`` (the text starts over: drop what was shown), then ``reply`` (how the turn ended,
  and the whole text) or ``error`` (one line, never a traceback);
- ``POST /api/cancel`` with ``{"user": U, "turn_id": T}`` stops the turn (``AsyncFleet.cancel``).

Who the user is comes from the query here; a real application takes it from its own session
or login, never from what the browser says. Run it beside a fleet (``fleet up``, a tier whose
handler streams, e.g. ``echo_stream`` or ``openai_chat``):

    python examples/webchat/app.py --port 8080      # REDIS_URL, or the fleet's own (fleet env)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from fleet.client import AsyncFleet, Restart, TurnTimeout
from protocol.ids import InvalidId
from protocol.models import Reply

log = logging.getLogger("webchat")
STATIC = Path(__file__).resolve().parent / "static"
FLEET: web.AppKey[AsyncFleet] = web.AppKey("fleet", AsyncFleet)
TIER: web.AppKey[str] = web.AppKey("tier", str)
TIMEOUT_S = 120.0  # how long a reply may take, all told


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def chat(request: web.Request) -> web.StreamResponse:
    """Submit the turn and stream it as server-sent events until its reply."""
    user, text = request.query.get("user", ""), request.query.get("text", "")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        stream = request.app[FLEET].stream(user, text, tier=request.app[TIER], timeout=TIMEOUT_S)
        await resp.write(_event("turn", {"turn_id": stream.turn_id}))
        async for item in stream:
            if isinstance(item, Reply):
                await resp.write(_event("reply", {"status": item.status, "text": item.text,
                                                  "error": item.error}))
            elif isinstance(item, Restart):
                await resp.write(_event("restart", {"attempt": item.attempt}))
            else:
                await resp.write(_event("chunk", {"text": item}))
    except (InvalidId, ValueError) as exc:  # a bad user id, or a text over the limits
        await resp.write(_event("error", {"error": str(exc)}))
    except TurnTimeout:
        await resp.write(_event("error", {"error": "no reply in time; it may still come"}))
    except ConnectionResetError:  # the browser went away: the turn goes on, its reply is kept
        log.info("a reader of %s's turn went away", user)
    return resp


async def cancel(request: web.Request) -> web.Response:
    """Stop a turn: ``{"user": U, "turn_id": T}`` -> what the cancel found."""
    try:
        body = await request.json()
        user, turn_id = str(body["user"]), str(body["turn_id"])
        outcome = await request.app[FLEET].cancel(user, turn_id)
    except (ValueError, KeyError, TypeError, InvalidId) as exc:
        return web.json_response({"error": f"bad cancel request: {exc}"}, status=400)
    return web.json_response({"outcome": str(outcome)})


def make_app(fleet: AsyncFleet, tier: str = "chat") -> web.Application:
    app = web.Application()
    app[FLEET], app[TIER] = fleet, tier
    app.router.add_get("/", index)
    app.router.add_get("/api/chat", chat)
    app.router.add_post("/api/cancel", cancel)

    async def close(app: web.Application) -> None:
        await app[FLEET].aclose()

    app.on_cleanup.append(close)
    return app


async def serve(host: str, port: int, tier: str) -> None:
    runner = web.AppRunner(make_app(AsyncFleet(), tier))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"webchat: serving on http://{host}:{bound}/", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a chat page on Fleet, streamed over server-sent events")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0: any free port (printed)")
    p.add_argument("--tier", default="chat")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: stop serving
        asyncio.run(serve(args.host, args.port, args.tier))
    return 0


if __name__ == "__main__":
    sys.exit(main())
