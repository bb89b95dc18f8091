"""A real worker process serving a tier whose policy names ``openai_chat``, pointed at the
stand-in model server (tests/openai_standin.py) by its ``handler_options``; and ``fleet
handlers`` where the ``openai`` client is not installed."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.helpers import fleet_cli
from tests.openai_standin import StandIn, standin

pytestmark = pytest.mark.integration

KEY = "sk-integration-secret"


@pytest.fixture
def server() -> Iterator[StandIn]:
    yield from standin()


def test_a_worker_answers_turns_through_the_model_server(server: StandIn, r: redis.Redis, redis_server: Any,
                                                         start_worker: Callable[..., Any],
                                                         fleet_env: dict[str, str], tmp_path: Path) -> None:
    options = {"base_url": server.url, "model": "normal", "max_tokens": 32, "system_prompt": "Be brief."}
    set_ = fleet_cli(fleet_env, "policy", "set", "chat", "handler=openai_chat",
                     f"handler_options={json.dumps(options)}", cwd=tmp_path)  # as guide/openai.md does
    assert set_.returncode == 0, set_.stderr
    start_worker("chat", env={"FLEET_OPENAI_API_KEY": KEY})
    r.hset(keys.profile("alice"), "name", "Ada")  # the profile the pack carries
    with Fleet(redis_server.role_url("fleet-client")) as client:
        first = client.submit("alice", "hello there", tier="chat").result(timeout=30)
        second = client.submit("alice", "and again", tier="chat").result(timeout=30)
    assert first.ok and first.text == "echo: hello there", first
    assert second.ok and second.text == "echo: and again", second
    sent = server.requests[-1]
    assert sent.headers["Authorization"] == f"Bearer {KEY}"
    assert sent.body["max_tokens"] == 32 and sent.body["stream"] is True
    system, *conversation = sent.messages
    assert system["role"] == "system" and system["content"].startswith("Be brief.")
    assert "- name: Ada" in system["content"]
    assert conversation == [{"role": "user", "content": "hello there"},
                            {"role": "assistant", "content": "echo: hello there"},
                            {"role": "user", "content": "and again"}]


def test_a_failing_server_fails_the_turn_with_a_clean_error(server: StandIn, r: redis.Redis,
                                                             redis_server: Any,
                                                             start_worker: Callable[..., Any]) -> None:
    write_policy(r, "chat", TurnsPolicy(handler="openai_chat", max_attempts=2, handler_options={
        "base_url": server.url, "model": "down", "max_retries": 1}))
    start_worker("chat", env={"FLEET_OPENAI_API_KEY": KEY})
    with Fleet(redis_server.role_url("fleet-client")) as client:
        reply = client.submit("bob", "hi", tier="chat").result(timeout=60)
    assert not reply.ok and reply.status == "error", reply
    assert reply.error is not None and "answered 500: stand-in down" in reply.error, reply.error
    assert "Traceback" not in reply.error and KEY not in reply.error
    assert len(server.requests_for("down")) == 4  # 2 attempts of the turn, each retried once by the client


def test_without_the_openai_client_fleet_handlers_says_what_to_install(fleet_env: dict[str, str],
                                                                        tmp_path: Path) -> None:
    """An ``openai`` that cannot be imported, first on the path: as if the extra were not installed."""
    shadow = tmp_path / "shadow" / "openai"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'openai'\")\n")
    env = dict(fleet_env, PYTHONPATH=os.pathsep.join([str(shadow.parent), fleet_env["PYTHONPATH"]]))
    listed = fleet_cli(env, "handlers", cwd=tmp_path)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert "openai_chat" in listed.stdout and "pip install 'fleet[openai]'" in listed.stdout, listed.stdout
    data = json.loads(fleet_cli(env, "handlers", "--json", cwd=tmp_path).stdout)
    assert "echo" in data["here"]["available"] and "openai_chat" not in data["here"]["available"]
    assert "pip install 'fleet[openai]'" in data["here"]["not_installed"]["openai_chat"]
    assert "openai_chat" not in data["here"]["unavailable"]  # (not broken: fleet status says nothing)
    status = fleet_cli(env, "status", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert "handler openai_chat unavailable" not in status.stdout, status.stdout
