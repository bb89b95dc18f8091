"""The chaos run's checks of streamed and stopped turns (``chaos --streamed``): each can fail."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest

from tests.conftest import ROOT

if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

from chaos_check import _stream_fault  # noqa: E402  (after the path)

from protocol.models import Reply  # noqa: E402


def reply(status: str = "ok", text: str = "a b") -> Reply:
    return Reply(turn_id="t", user="u", ok=status == "ok", status=status, text=text, worker="w",
                 ts=time.time())


def chunk(text: str, attempt: int = 1) -> tuple[str, dict[bytes, Any]]:
    return ("1-0", {b"k": b"chunk", b"a": str(attempt).encode(), b"t": text.encode()})


def restart(attempt: int) -> tuple[str, dict[bytes, Any]]:
    return ("1-0", {b"k": b"restart", b"a": str(attempt).encode()})


def end(status: str = "ok") -> tuple[str, dict[bytes, Any]]:
    return ("1-0", {b"k": b"end", b"status": status.encode()})


def test_a_sound_stream_passes() -> None:
    assert _stream_fault([chunk("a"), chunk(" x", 1), restart(2), chunk("a", 2), chunk(" b", 2), end()],
                         reply(), "a b", None) == ""
    assert _stream_fault([chunk("a"), end("cancelled")], reply("cancelled", "a"), "a b", "cancelled") == ""


@pytest.mark.parametrize(("entries", "rep", "cancel", "found"), [
    ([chunk("a b"), end(), end()], reply(), None, "2 'end' entries"),
    ([chunk("a b")], reply(), None, "0 'end' entries"),
    ([chunk("a b"), end("error")], reply(), None, "the stream ended"),
    ([restart(2), chunk("a", 1), chunk(" b", 2), end()], reply(), None, "a chunk of attempt 1"),
    ([chunk("a"), end()], reply(), None, "it shows 'a'"),
    ([chunk("a b"), end()], reply(), "cancelled", "its cancel was recorded"),
    ([end("cancelled")], reply("cancelled", ""), None, "answered cancelled, but"),
    ([chunk("b"), end("cancelled")], reply("cancelled", "b"), "cancelled", "not the start of its text"),
])
def test_each_fault_is_found(entries: list[Any], rep: Reply, cancel: str | None, found: str) -> None:
    assert found in _stream_fault(entries, rep, "a b", cancel)
