"""The ``openai_chat`` handler, called directly with a ``TurnContext``, against the stand-in
model server of tests/openai_standin.py (real HTTP, real SSE, the official client)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from protocol.models import MemoryItem, SessionEntry, Turn
from stores.turns import ContextPack
from tests.openai_standin import STALL_S, StandIn, reply_words, standin
from worker import handlers, openai_chat
from worker.handlers import HandlerError, TurnContext

KEY = "sk-test-secret-key"


@pytest.fixture(scope="module")
def server() -> Iterator[StandIn]:
    yield from standin()


@pytest.fixture(autouse=True)
async def env(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    for name in ("FLEET_OPENAI_BASE_URL", "FLEET_OPENAI_MODEL", "FLEET_OPENAI_API_KEY", "OPENAI_API_KEY",
                 "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLEET_OPENAI_API_KEY", KEY)
    yield
    await openai_chat.close_clients()  # each test has its own event loop: its clients go with it


def context(server: StandIn, text: str = "hello there", pack: ContextPack | None = None,
            meta: dict[str, Any] | None = None, deadline: float | None = None, **options: Any) -> TurnContext:
    opts: dict[str, Any] = {"base_url": server.url, "model": "normal", "max_retries": 0, **options}
    turn = Turn(turn_id="t1", user="alice", text=text, ts=time.time(), meta=meta or {})
    return TurnContext(turn, pack or ContextPack(), opts, deadline=deadline)


def entry(i: int, text: str, reply: str, cut: bool = False) -> SessionEntry:
    return SessionEntry(turn_id=f"s{i}", entry=f"{i}-0", text=text, reply=reply, ts=float(i), cut=cut)


# --- the messages -----------------------------------------------------------------------------


def test_the_pack_becomes_a_system_message_the_conversation_and_the_turn() -> None:
    pack = ContextPack(
        session=[entry(1, "hi", "hello Ada"), entry(2, "tell me a story", "Once upon a", cut=True)],
        profile={"name": "Ada", "city": "Paris"},
        memories=[MemoryItem(id="m1", text="likes tea", importance=0.9, ts=1.0),
                  MemoryItem(id="m2", text="has a cat", importance=0.5, ts=2.0)])
    messages = openai_chat.build_messages(pack, "another one", system_prompt="You are terse.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("You are terse.")
    assert "- name: Ada" in system and "- city: Paris" in system
    assert system.index("likes tea") < system.index("has a cat")  # the pack's order: most relevant first
    assert messages[1:] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello Ada"},
                            {"role": "user", "content": "tell me a story"},
                            {"role": "assistant", "content": "Once upon a"},  # a cut reply, as it is
                            {"role": "user", "content": "another one"}]


def test_an_empty_pack_is_the_turn_alone() -> None:
    assert openai_chat.build_messages(ContextPack(), "hi") == [{"role": "user", "content": "hi"}]
    only_prompt = openai_chat.build_messages(ContextPack(), "hi", system_prompt="Be kind.")
    assert only_prompt == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]


# --- a turn -------------------------------------------------------------------------------------


async def test_a_turn_streams_each_delta_and_returns_the_whole_text(server: StandIn) -> None:
    pack = ContextPack(session=[entry(1, "hi", "hello")], profile={"name": "Ada"})
    ctx = context(server, "how are you", pack, max_tokens=64, temperature=0.25, system_prompt="Be brief.")
    result = await openai_chat.openai_chat(ctx)
    assert ctx.emitted == ["echo:", " how", " are", " you"]
    assert result.text == "echo: how are you"
    sent = server.requests[-1]
    assert sent.messages == openai_chat.build_messages(pack, "how are you", system_prompt="Be brief.")
    assert sent.body["model"] == "normal" and sent.body["stream"] is True
    assert sent.body["max_tokens"] == 64 and sent.body["temperature"] == 0.25
    assert sent.headers["Authorization"] == f"Bearer {KEY}"


async def test_the_environment_names_the_server_model_and_key(server: StandIn,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_OPENAI_BASE_URL", server.url)
    monkeypatch.setenv("FLEET_OPENAI_MODEL", "normal")
    monkeypatch.delenv("FLEET_OPENAI_API_KEY")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-fallback")
    turn = Turn(turn_id="t1", user="alice", text="hi", ts=time.time())
    result = await openai_chat.openai_chat(TurnContext(turn, ContextPack()))
    assert result.text == "echo: hi"
    assert server.requests[-1].headers["Authorization"] == "Bearer sk-fallback"


async def test_a_turns_meta_overrides_the_model(server: StandIn) -> None:
    result = await openai_chat.openai_chat(context(server, "hi", meta={"model": "slow"}))
    assert result.text == "echo: hi" and server.requests[-1].body["model"] == "slow"


@pytest.mark.parametrize("where", ["options", "meta"])
@pytest.mark.parametrize("name", ["api_key", "OPENAI_API_KEY", "key"])
async def test_a_key_in_the_options_or_a_turn_is_refused_without_a_call(server: StandIn, where: str,
                                                                      name: str) -> None:
    before = len(server.requests)
    ctx = context(server, meta={name: "sk-leaked"} if where == "meta" else None)
    if where == "options":
        ctx.options[name] = "sk-leaked"
    with pytest.raises(HandlerError, match="environment") as info:
        await openai_chat.openai_chat(ctx)
    assert "sk-leaked" not in str(info.value) and len(server.requests) == before


async def test_a_turn_cannot_point_the_key_at_another_server(server: StandIn) -> None:
    """The base URL comes from the tier or the environment: a turn's meta naming one would send
    the worker's key wherever the submitter likes."""
    before = len(server.requests)
    with pytest.raises(HandlerError, match="base_url"):
        await openai_chat.openai_chat(context(server, meta={"base_url": "http://127.0.0.1:9/v1"}))
    assert len(server.requests) == before


async def test_no_model_is_a_clear_error(server: StandIn) -> None:
    ctx = context(server)
    del ctx.options["model"]
    with pytest.raises(HandlerError, match="FLEET_OPENAI_MODEL"):
        await openai_chat.openai_chat(ctx)


async def test_one_client_per_server_and_key_reused_across_turns(server: StandIn,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    await openai_chat.openai_chat(context(server))
    await openai_chat.openai_chat(context(server, max_retries=3, timeout_s=5))
    assert len(openai_chat._clients) == 1
    monkeypatch.setenv("FLEET_OPENAI_API_KEY", "sk-other")
    await openai_chat.openai_chat(context(server))
    assert len(openai_chat._clients) == 2


# --- failures -----------------------------------------------------------------------------------


async def test_a_stalled_server_times_out_as_a_clean_turn_failure(server: StandIn) -> None:
    started = time.monotonic()
    with pytest.raises(HandlerError, match="did not answer within 0.5 s") as info:
        await openai_chat.openai_chat(context(server, model="stall", timeout_s=0.5))
    assert time.monotonic() - started < 5
    assert "Traceback" not in str(info.value) and KEY not in str(info.value)
    assert server.wait_hung_up(server.requests_for("stall")[-1], 5)


async def test_a_connection_dropped_mid_stream_fails_the_turn(server: StandIn) -> None:
    ctx = context(server, "a b c d", model="broken")
    with pytest.raises(HandlerError, match="mid-stream") as info:
        await openai_chat.openai_chat(ctx)
    assert ctx.emitted == ["echo:", " a"]  # what came before the drop was streamed
    assert KEY not in str(info.value)


async def test_an_error_event_mid_stream_fails_the_turn_with_the_servers_words(server: StandIn) -> None:
    ctx = context(server, "a b c d", model="failing")
    with pytest.raises(HandlerError) as info:
        await openai_chat.openai_chat(ctx)
    assert str(info.value) == f"the model server at {server.url} failed mid-stream: out of memory"
    assert ctx.emitted == ["echo:", " a"]


async def test_a_connection_dropped_before_the_first_chunk_is_a_drop_not_unreachable(server: StandIn) -> None:
    with pytest.raises(HandlerError, match="closed the connection mid-stream"):
        await openai_chat.openai_chat(context(server, model="dropped"))


async def test_a_429_is_retried_by_the_client(server: StandIn) -> None:
    result = await openai_chat.openai_chat(context(server, "hi", model="busy", max_retries=2))
    assert result.text == "echo: hi"
    assert len(server.requests_for("busy")) == 2


async def test_a_server_error_is_retried_then_fails_the_turn_cleanly(server: StandIn) -> None:
    before = len(server.requests_for("down"))
    with pytest.raises(HandlerError) as info:
        await openai_chat.openai_chat(context(server, model="down", max_retries=2))
    assert len(server.requests_for("down")) - before == 3  # the first and 2 retries
    message = str(info.value)
    assert message.endswith("answered 500: stand-in down: none of it works"), message
    assert "Traceback" not in message and KEY not in message and "\n" not in message


async def test_without_a_key_nothing_of_the_message_is_taken_for_one(
        server: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEET_OPENAI_API_KEY")
    with pytest.raises(HandlerError, match="answered 500: stand-in down: none of it works$"):
        await openai_chat.openai_chat(context(server, model="down"))


async def test_an_unreachable_server_fails_the_turn_cleanly() -> None:
    ctx = TurnContext(Turn(turn_id="t1", user="alice", text="hi", ts=time.time()), ContextPack(),
                      {"base_url": "http://127.0.0.1:9/v1", "model": "m", "max_retries": 0})
    with pytest.raises(HandlerError, match="could not reach the model server at http://127.0.0.1:9/v1"):
        await openai_chat.openai_chat(ctx)


# --- deadline and stop ----------------------------------------------------------------------------


async def test_a_turn_past_its_deadline_never_calls_the_server(server: StandIn) -> None:
    before = len(server.requests)
    with pytest.raises(HandlerError, match="deadline"):
        await openai_chat.openai_chat(context(server, deadline=time.time() - 1))
    assert len(server.requests) == before


async def test_the_deadline_bounds_the_request_timeout(server: StandIn) -> None:
    started = time.monotonic()
    with pytest.raises(HandlerError, match="deadline"):
        await openai_chat.openai_chat(context(server, model="stall", timeout_s=STALL_S,
                                              deadline=time.time() + 0.5))
    assert time.monotonic() - started < 5


async def test_the_deadline_bounds_a_slow_stream_as_a_whole(server: StandIn) -> None:
    """Each chunk comes within the request timeout, but the reply as a whole would end after the
    deadline: the call stops at the deadline."""
    ctx = context(server, "one two three four five six", model="slow", timeout_s=30,
                  deadline=time.time() + 0.5)
    with pytest.raises(HandlerError, match="deadline"):
        await openai_chat.openai_chat(ctx)
    # the whole reply takes 6 x SLOW_CHUNK_S: part of it came before the deadline, not all
    assert 0 < len(ctx.emitted) < len(reply_words([{"content": "one two three four five six"}]))
    assert server.wait_hung_up(server.requests_for("slow")[-1], 5)


async def test_cancelling_the_handler_closes_the_http_stream(server: StandIn) -> None:
    ctx = context(server, "one two three four five", model="slow")
    task = asyncio.ensure_future(openai_chat.openai_chat(ctx))
    while not ctx.emitted:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert server.wait_hung_up(server.requests_for("slow")[-1], 5)  # the server saw the close
    assert ctx.emitted == ["echo:"]


async def test_the_cancel_flag_stops_reading_and_closes_the_stream(server: StandIn) -> None:
    ctx = context(server, "one two three four five", model="slow")
    task = asyncio.ensure_future(openai_chat.openai_chat(ctx))
    while not ctx.emitted:
        await asyncio.sleep(0.01)
    ctx.cancel_flag.set()
    result = await asyncio.wait_for(task, 5)
    assert result.text == "".join(ctx.emitted) and len(ctx.emitted) < 6
    assert server.wait_hung_up(server.requests_for("slow")[-1], 5)


# --- without the extra ----------------------------------------------------------------------------


def test_without_the_openai_client_the_handler_is_not_installed_with_the_extra_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not installed, not broken: listed with what to install, never warned about as unavailable."""
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` fails as when not installed
    monkeypatch.delitem(sys.modules, "worker.openai_chat")
    monkeypatch.setattr(handlers, "_REGISTRY", {k: v for k, v in handlers._REGISTRY.items()
                                                if k != "openai_chat"})
    monkeypatch.setattr(handlers, "_UNAVAILABLE", {})
    monkeypatch.setattr(handlers, "_NOT_INSTALLED", {})
    handlers.rescan()
    try:
        assert "openai_chat" not in handlers.registered_names()
        assert "openai_chat" not in handlers.unavailable()
        why = handlers.not_installed()["openai_chat"]
        assert "pip install 'fleet[openai]'" in why and "\n" not in why, why
        assert handlers.known().not_installed["openai_chat"] == why  # a policy naming it is refused with it
    finally:
        handlers._load_entry_points.cache_clear()


def test_with_the_client_the_handler_is_registered() -> None:
    handlers.rescan()
    assert handlers.get("openai_chat") is openai_chat.openai_chat
