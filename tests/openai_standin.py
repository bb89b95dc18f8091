"""A stand-in for an OpenAI-compatible model server: ``POST /v1/chat/completions``, streamed as
server-sent events (``data: {chunk}`` ... ``data: [DONE]``) or answered whole.

It runs on its own event loop in a thread, so a test may drive it from async code (the handler
called directly) or from sync code (a worker process pointed at it). The request's ``model``
picks how it behaves:

- ``normal``: answers ``echo: <last user message>`` word by word;
- ``slow``: the same, ``SLOW_CHUNK_S`` between words;
- ``stall``: sends the headers, then nothing;
- ``broken``: sends two chunks, then drops the connection;
- ``dropped``: sends the headers, then drops the connection;
- ``failing``: sends two chunks, then an error event (``data: {"error": {...}}``) and ends;
- ``busy``: answers 429 to its first request, then as ``normal``;
- ``down``: answers 500 to every request.

Each request is recorded (its JSON body, headers and whether the client hung up before the
answer was complete), so a test asserts what was sent and that a stream was closed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

SLOW_CHUNK_S = 0.2
STALL_S = 60.0


@dataclass
class Request:
    """One request the stand-in received."""

    body: dict[str, Any]
    headers: dict[str, str]
    hung_up: threading.Event = field(default_factory=threading.Event)  # the client closed it early

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages", []))


class StandIn:
    """The server; ``url`` is the base URL a client is given (``http://127.0.0.1:<port>/v1``)."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._seen: dict[str, int] = {}  # model -> requests so far
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="openai-standin", daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> StandIn:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def requests_for(self, model: str) -> list[Request]:
        return [r for r in self.requests if r.body.get("model") == model]

    def wait_hung_up(self, request: Request, timeout: float) -> bool:
        return request.hung_up.wait(timeout)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _completions(self, http: web.Request) -> web.StreamResponse:
        body = await http.json()
        request = Request(body, dict(http.headers))
        self.requests.append(request)
        model = str(body.get("model", ""))
        self._seen[model] = self._seen.get(model, 0) + 1
        if model == "down" or (model == "busy" and self._seen[model] == 1):
            status = 500 if model == "down" else 429
            # retry-after-ms: the client's retries come at once (its own backoff is 0.5 s and up)
            message = f"stand-in {model}" + (": none of it works" if model == "down" else "")
            return web.json_response({"error": {"message": message, "type": "server_error"}},
                                     status=status, headers={"retry-after-ms": "10"})
        words = reply_words(request.messages)
        if not body.get("stream"):
            return web.json_response(completion(model, " ".join(words)))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await response.prepare(http)
            if model == "stall":
                await asyncio.sleep(STALL_S)
            if model == "dropped":
                assert http.transport is not None
                http.transport.close()
                return response
            for i, word in enumerate(words):
                if model == "broken" and i == 2:
                    assert http.transport is not None
                    http.transport.close()  # mid-stream: no terminating chunk, no [DONE]
                    return response
                if model == "failing" and i == 2:
                    await response.write(sse({"error": {"message": "out of memory", "type": "server_error"}}))
                    await response.write_eof()
                    return response
                if model == "slow" and i > 0:
                    await asyncio.sleep(SLOW_CHUNK_S)
                await response.write(sse(chunk(model, word if i == 0 else " " + word)))
            await response.write(sse(chunk(model, None, finish="stop")))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            request.hung_up.set()
            raise
        return response


def reply_words(messages: list[dict[str, Any]]) -> list[str]:
    """What the stand-in answers: ``echo:`` and the words of the last message."""
    last = str(messages[-1]["content"]) if messages else ""
    return ["echo:", *last.split()]


def chunk(model: str, content: str | None, finish: str | None = None) -> dict[str, Any]:
    delta = {"role": "assistant", "content": content} if content is not None else {}
    return {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def completion(model: str, text: str) -> dict[str, Any]:
    return {"id": "chatcmpl-standin", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def standin() -> Iterator[StandIn]:
    """A fixture body: a started stand-in, stopped after the test."""
    server = StandIn().start()
    try:
        yield server
    finally:
        server.stop()
