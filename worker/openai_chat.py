"""The ``openai_chat`` handler: a turn answered by any server that speaks the OpenAI
chat-completions API (vLLM, llama.cpp's server, Ollama, hosted APIs), streamed.

It needs the ``openai`` extra (``pip install 'fleet[openai]'``) and is registered through the
``fleet.handlers`` entry-point group: without the extra, the handler is unavailable with an
error that says so, and the rest of Fleet is unaffected.

Where each setting comes from (a turn's ``meta`` overrides the tier's ``handler_options``,
except where said):

- ``base_url``: the tier's ``handler_options``, else ``FLEET_OPENAI_BASE_URL``, else
  ``OPENAI_BASE_URL``, else OpenAI's own API; never a turn's ``meta`` (it would send the key
  wherever the submitter likes);
- ``model``: the options, else ``FLEET_OPENAI_MODEL`` (required);
- ``max_tokens``, ``temperature``, ``system_prompt``: the options, unset by default;
- ``timeout_s`` (60): how long the server may take to answer, and between two chunks; bounded
  by the turn's deadline, which also bounds the call as a whole;
- ``max_retries`` (2): the client's retries of a timeout, a lost connection, a 429 or a 5xx;
- the API key: only the environment, ``FLEET_OPENAI_API_KEY`` else ``OPENAI_API_KEY`` (a local
  server needs none). A key in the options or a turn's meta fails the turn.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any, cast

from worker.handlers import NotInstalled

try:
    import openai
except ImportError as exc:  # the core install: the handler is listed as not installed, with this
    raise NotInstalled("the openai_chat handler needs the openai client: pip install 'fleet[openai]' "
                       f"({exc})") from None

from openai.types.chat import ChatCompletionMessageParam

from protocol.models import HandlerResult
from stores.turns import ContextPack
from worker.handlers import HandlerError, TurnContext

DEFAULT_BASE_URL = "https://api.openai.com/v1"
NO_KEY = "none"  # sent when the environment has no key: local servers ignore it
KEY_OPTIONS = frozenset({"api_key", "apikey", "key", "openai_api_key", "authorization"})
_clients: dict[tuple[str, str], openai.AsyncOpenAI] = {}  # (base_url, key) -> the process's client


def build_messages(pack: ContextPack, text: str, system_prompt: str = "") -> list[dict[str, str]]:
    """The chat messages of a turn: a system message (``system_prompt``, the user's profile and
    the pack's memories, most relevant first; none if all are empty), the session as alternating
    user and assistant messages (a reply cut short by a stop as it was), then ``text``."""
    system = [system_prompt.strip()] if system_prompt.strip() else []
    if pack.profile:
        system.append("About the user:\n" + "\n".join(f"- {k}: {v}" for k, v in pack.profile.items()))
    if pack.memories:
        system.append("What you remember of the user, most relevant first:\n"
                      + "\n".join(f"- {m.text}" for m in pack.memories))
    messages = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    for entry in pack.session:
        messages += [{"role": "user", "content": entry.text}, {"role": "assistant", "content": entry.reply}]
    messages.append({"role": "user", "content": text})
    return messages


def api_key() -> str:
    """The key, from the environment only."""
    return os.environ.get("FLEET_OPENAI_API_KEY") or os.environ.get("OPENAI_API_KEY") or NO_KEY


def client(base_url: str, key: str) -> openai.AsyncOpenAI:
    """This process's client of ``base_url`` with ``key`` (its connections are reused across
    turns). Its timeout and retries are set per request."""
    found = _clients.get((base_url, key))
    if found is None:
        found = _clients[(base_url, key)] = openai.AsyncOpenAI(base_url=base_url, api_key=key)
    return found


async def close_clients() -> None:
    """Close this process's clients (their connections belong to the running event loop)."""
    clients = list(_clients.values())
    _clients.clear()
    for each in clients:
        await each.close()


@dataclass(frozen=True)
class Call:
    """One turn's request, as its options and the environment set it."""

    base_url: str
    model: str
    timeout_s: float
    max_retries: int
    sampling: dict[str, Any]  # max_tokens and temperature when set (else the server's defaults)
    system_prompt: str

    @classmethod
    def of(cls, ctx: TurnContext) -> Call:
        """The request of ``ctx``; ``HandlerError`` on an option that cannot be used."""
        for where, values in (("handler_options", ctx.options), ("the turn's meta", ctx.turn.meta)):
            named = sorted(name for name in values if name.lower() in KEY_OPTIONS)
            if named:
                raise HandlerError(f"openai_chat takes its API key from the environment only "
                                   f"(FLEET_OPENAI_API_KEY or OPENAI_API_KEY), never from {where}: "
                                   f"remove {', '.join(named)}")
        if "base_url" in ctx.turn.meta:
            raise HandlerError("base_url is set by the tier's handler_options or FLEET_OPENAI_BASE_URL, "
                               "never by a turn's meta")
        model = str(ctx.option("model", "") or os.environ.get("FLEET_OPENAI_MODEL", ""))
        if not model:
            raise HandlerError("openai_chat has no model: set handler option model or FLEET_OPENAI_MODEL")
        try:
            sampling = {name: kind(ctx.option(name, None)) for name, kind in SAMPLING.items()
                        if ctx.option(name, None) is not None}
            return cls(base_url=str(ctx.options.get("base_url") or os.environ.get("FLEET_OPENAI_BASE_URL")
                                    or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL),
                       model=model, timeout_s=float(ctx.option("timeout_s", 60.0)),
                       max_retries=int(ctx.option("max_retries", 2)), sampling=sampling,
                       system_prompt=str(ctx.option("system_prompt", "")))
        except (TypeError, ValueError) as exc:
            raise HandlerError(f"openai_chat: a handler option is not a number: {exc}") from None


SAMPLING: dict[str, type[int] | type[float]] = {"max_tokens": int, "temperature": float}


@dataclass
class Progress:
    """How far a call got: the pieces of the reply so far, and whether the stream was opened."""

    parts: list[str] = field(default_factory=list)
    opened: bool = False


async def openai_chat(ctx: TurnContext) -> HandlerResult:
    """Answer the turn with a streamed chat completion: each delta goes to ``ctx.emit`` and the
    whole text is the reply. Fails the turn (``HandlerError``, a message fit for the user) on a
    bad configuration, a deadline already past or reached, or the server's failure once the
    client's retries are spent."""
    call = Call.of(ctx)
    remaining = None if ctx.deadline is None else ctx.deadline - time.time()
    if remaining is not None and remaining <= 0:
        raise HandlerError("the turn's deadline passed before the model was called")
    key = api_key()
    progress = Progress()
    try:
        async with asyncio.timeout(remaining):  # the deadline bounds the call as a whole
            await _stream(ctx, call, client(call.base_url, key), remaining, progress)
    except TimeoutError:
        raise HandlerError(f"the model server at {call.base_url} did not finish before the turn's "
                           f"deadline ({len(progress.parts)} chunks streamed)") from None
    except openai.APIError as exc:
        message = _failure(exc, call, progress.opened)
        raise HandlerError(message.replace(key, "***") if key != NO_KEY else message) from None
    return HandlerResult(text="".join(progress.parts))


async def _stream(ctx: TurnContext, call: Call, chat: openai.AsyncOpenAI, remaining: float | None,
                  progress: Progress) -> None:
    """Stream the completion into ``progress`` and ``ctx.emit``; the HTTP stream is closed however
    this ends (cancelled included)."""
    messages = build_messages(ctx.pack, ctx.turn.text, call.system_prompt)
    stream = await chat.with_options(max_retries=call.max_retries).chat.completions.create(
        model=call.model, messages=cast(list[ChatCompletionMessageParam], messages), stream=True,
        timeout=call.timeout_s if remaining is None else min(call.timeout_s, remaining), **call.sampling)
    progress.opened = True
    async with stream:
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    progress.parts.append(choice.delta.content)
                    ctx.emit(choice.delta.content)
            if ctx.cancelled:  # stopped: the stream is closed, the text so far is the reply
                return


def _failure(exc: openai.APIError, call: Call, opened: bool) -> str:
    """One line for the user: what went wrong, in the server's words where it gave some, without
    the client's traceback or the key."""
    if isinstance(exc, openai.APITimeoutError):
        what = f"did not answer within {call.timeout_s:g} s"
    elif isinstance(exc, openai.APIStatusError):
        body = exc.body
        detail = _one_line(body.get("message") if isinstance(body, dict) else body)
        what = f"answered {exc.status_code}" + (f": {detail}" if detail else "")
    elif isinstance(exc, openai.APIConnectionError):
        if not opened:
            return f"could not reach the model server at {call.base_url}"
        what = "closed the connection mid-stream"
    else:  # an error event in the stream
        what = f"failed mid-stream: {_one_line(exc.message)}"
    return f"the model server at {call.base_url} {what}"


def _one_line(text: object) -> str:
    return " ".join(str(text or "").split())[:200]
