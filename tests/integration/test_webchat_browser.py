"""The usual front end, in a real browser: ``examples/webchat`` (aiohttp, server-sent events
through ``AsyncFleet.stream``) in front of a real worker whose handler streams word by word
(``echo_stream``). The page shows tokens before the final reply, and Stop cuts a turn short:
its reply says ``cancelled``, holds what was streamed by then, and the next turn is served."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.browser_driver import ROOT, Browser

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(240)]
DELAY_MS = 150  # between two words: a turn of N words streams for about N x 0.15 s


@pytest.fixture
def webchat(fleet_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """The example app on a free loopback port, as the fleet's client role; its base URL."""
    log = (tmp_path / "webchat.log").open("w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "webchat" / "app.py"), "--port", "0"],
                            env=fleet_env, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "serving on" in line, f"webchat did not start: {line!r} {(tmp_path / 'webchat.log').read_text()}"
    yield line.split("serving on ", 1)[1].strip()
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    proc.stdout.close()
    log.close()


def send(b: Browser, text: str) -> None:
    b("eval", js=f"document.getElementById('text').value = {json.dumps(text)}")
    b("click", selector="#send")


def reply(b: Browser, n: int) -> dict[str, str]:
    got = b("eval", js=f"(() => {{ const el = document.getElementById('reply-{n}'); "
                       f"return el ? {{...el.dataset, text: el.textContent}} : null; }})()")["value"]
    assert got is not None, f"no reply-{n} on the page"
    return dict(got)


def test_the_page_streams_tokens_before_the_reply_and_stop_cuts_a_turn(
        r: redis.Redis, start_worker: Callable[..., object], webchat: str, browser: Browser,
        tmp_path: Path) -> None:
    write_policy(r, "chat", TurnsPolicy(handler="echo_stream", handler_options={"delay_ms": DELAY_MS}))
    start_worker("chat")
    browser("open", url=webchat)

    words = "one two three four five six seven eight"
    send(browser, words)
    browser("wait", js="Number(document.getElementById('reply-0')?.dataset.chunks || 0) >= 2 "
                       "&& !document.getElementById('reply-0').dataset.status", timeout=20000)
    browser("wait", js="document.getElementById('reply-0').dataset.status === 'ok'", timeout=20000)
    first = reply(browser, 0)
    assert first["text"] == words, first
    assert int(first["chunks"]) >= 4, first  # word by word, not one block
    # the first token came well before the end (8 words, 0.15 s apart)
    assert int(first["endAt"]) - int(first["firstAt"]) >= 3 * DELAY_MS, first

    long = " ".join(f"w{i}" for i in range(60))  # ~9 s of streaming
    send(browser, long)
    browser("wait", js="Number(document.getElementById('reply-1')?.dataset.chunks || 0) >= 3", timeout=20000)
    stopped_at = time.monotonic()
    browser("click", selector="#stop")
    browser("wait", js="document.getElementById('reply-1').dataset.status === 'cancelled'", timeout=20000)
    took = time.monotonic() - stopped_at
    cut = reply(browser, 1)
    assert took < 5.0, f"the stop took {took:.1f} s"  # far from the ~9 s the turn would stream
    assert cut["text"] and long.startswith(cut["text"].strip()) and cut["text"].strip() != long, cut

    send(browser, "after the stop")  # the user's next turn is served at once
    browser("wait", js="document.getElementById('reply-2')?.dataset.status === 'ok'", timeout=20000)
    assert reply(browser, 2)["text"] == "after the stop"
    print(f"screenshot: {browser('shot', path=str(tmp_path / 'webchat.png'))['path']}")
    assert browser("errors")["errors"] == []
