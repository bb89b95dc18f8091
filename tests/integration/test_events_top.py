"""``fleet events`` and ``fleet top`` as subprocesses against a real redis-server.

The ledger, the reports, the registry and the leader are written directly with redis-py, as
the commander and the workers would; one test runs a commander on the process runtime, to see
what its scale-up writes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from commander.runtime.process import ProcessRuntime
from protocol import keys
from protocol.codec import encode
from protocol.models import CommanderInfo, Counters, LedgerEvent, OccupancyReport, Slots
from protocol.policy import TurnsPolicy
from stores.policies import write_policy
from tests.helpers import fleet_cli, register
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration
T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC


def ledger(r: redis.Redis, event: LedgerEvent) -> str:
    return r.xadd(keys.EVENTS, {"m": encode(event), "tier": event.tier}).decode()


def event(tier: str = "chat", action: str = "scale-up", ts: float = T0, **kw: object) -> LedgerEvent:
    base: dict[str, object] = {"ts": ts, "tier": tier, "epoch": 3, "commander": "cmd-1", "action": action,
                               "from_count": 1, "to_count": 2, "reason": "pressure proposes 2"}
    return LedgerEvent.model_validate({**base, **kw})


def report(worker: str, ts: float, busy: int, total: int = 4, cpu: float | None = 0.2,
           tier: str = "chat", state: str = "ready", handler_s: float = 0.0) -> OccupancyReport:
    return OccupancyReport(worker=worker, tier=tier, ts=ts, state=state, users=3, active_users=1,  # type: ignore[arg-type]
                           slots=Slots(busy=busy, total=total), cpu=cpu, rss=200 * 1024 * 1024,
                           counters=Counters(turns=10, handler_seconds=handler_s), load=(0.1, 0.1, 0.1))


# --- fleet events -----------------------------------------------------------------------
def test_events_json_lists_the_ledger_oldest_first(r: redis.Redis, fleet_env: dict[str, str]) -> None:
    ids = [ledger(r, event(ts=T0, spawned=["chat-b"])),
           ledger(r, event(tier="batch", ts=T0 + 1)),
           ledger(r, event(action="reclaim-idle", ts=T0 + 2, from_count=2, to_count=1, victims=["chat-b"],
                           reason="scale in 2->1: reclaim-idle chat-b", why={"raw": 1}))]
    out = fleet_cli(fleet_env, "events", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [row["id"] for row in rows] == ids
    assert rows[2]["action"] == "reclaim-idle"
    assert rows[2]["victims"] == ["chat-b"]
    assert rows[2]["why"] == {"raw": 1}
    assert rows[0]["spawned"] == ["chat-b"]

    out = fleet_cli(fleet_env, "events", "--json", "--count", "2")
    assert [row["id"] for row in json.loads(out.stdout)] == ids[1:]


def test_a_scale_ups_event_names_the_workers_the_runtime_started(
        r: redis.Redis, fleet_env: dict[str, str], process_commander: ProcessRuntime) -> None:
    """A commander on the process runtime scales a tier up from nothing: ``fleet events``
    shows the ids of the workers it started, as the runtime returned them."""
    write_policy(r, "chat", TurnsPolicy(min_workers=2, max_workers=2))
    wait_until(lambda: len(process_commander.live("chat")) == 2, 30, "two workers started")

    out = fleet_cli(fleet_env, "events", "--json", "--tier", "chat")
    assert out.returncode == 0, out.stderr
    ups = [row for row in json.loads(out.stdout) if row["action"] == "scale-up"]
    started = sorted(h.worker_id for h in process_commander.list())
    assert ups and sorted(w for row in ups for w in row["spawned"]) == started
    assert all(len(row["spawned"]) == row["to_count"] - row["from_count"] for row in ups)


def test_events_tier_filter_and_text_lines(r: redis.Redis, fleet_env: dict[str, str]) -> None:
    ledger(r, event(ts=T0, spawned=["chat-b", "chat-c"], from_count=1, to_count=3))
    for i in range(300):  # the filter must scan back past a page of other tiers' entries
        ledger(r, event(tier="batch", ts=T0 + 1 + i, epoch=4))
    ledger(r, event(action="consolidate", ts=T0 + 400, from_count=3, to_count=2, victims=["chat-c"],
                    reason="scale in 3->2:\nconsolidate chat-c"))
    out = fleet_cli(fleet_env, "events", "--tier", "chat")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("08:00:00  chat")
    assert "scale-up" in lines[0] and "1->3" in lines[0] and "+chat-b,chat-c" in lines[0]
    assert "(epoch 3)" in lines[0]
    assert "consolidate" in lines[1] and "3->2" in lines[1] and "-chat-c" in lines[1]
    assert "scale in 3->2: consolidate chat-c" in lines[1]  # the reason stays on one line
    assert "batch" not in out.stdout

    out = fleet_cli(fleet_env, "events", "--tier", "batch", "--count", "5", "--json")
    rows = json.loads(out.stdout)
    assert len(rows) == 5 and {row["tier"] for row in rows} == {"batch"}

    out = fleet_cli(fleet_env, "events", "--tier", "nosuch")
    assert out.returncode == 0 and "no events for tier nosuch" in out.stdout
    assert fleet_cli(fleet_env, "events", "--tier", "bad tier!").returncode == 2


def test_a_corrupt_ledger_entry_is_shown_not_fatal(r: redis.Redis, fleet_env: dict[str, str]) -> None:
    ledger(r, event(ts=T0))
    bad = r.xadd(keys.EVENTS, {"m": b"\xc1garbage", "tier": "chat"}).decode()
    r.xadd(keys.EVENTS, {"tier": "chat", "other": "x"})  # no "m" at all
    old = r.xadd(keys.EVENTS, {"m": encode(event(ts=T0 + 1)).replace(b"\xa1v\x01", b"\xa1v\x09"),
                               "tier": "chat"}).decode()  # a future protocol version
    ledger(r, event(action="hold", ts=T0 + 2, reason="steady"))
    out = fleet_cli(fleet_env, "events")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 5
    assert f"CORRUPT        entry {bad}: not msgpack" in lines[1]
    assert "no field 'm'" in lines[2]
    assert old in lines[3] and "protocol version" in lines[3]
    assert "hold" in lines[4]

    rows = json.loads(fleet_cli(fleet_env, "events", "--json").stdout)
    assert [("corrupt" in row) for row in rows] == [False, True, True, True, False]

    out = fleet_cli(fleet_env, "top", "--once")
    assert out.returncode == 0, out.stderr
    assert "CORRUPT" in out.stdout


def test_events_follow_prints_new_entries_and_exits_0_on_ctrl_c(r: redis.Redis,
                                                                   fleet_env: dict[str, str]) -> None:
    ledger(r, event(ts=T0, reason="before"))
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "events", "--follow", "--json",
                             "--tier", "chat"], env=fleet_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    try:
        wait_until(lambda: len(lines) >= 1, 20, "the existing event")
        ledger(r, event(tier="batch", ts=T0 + 1, reason="other tier"))
        ledger(r, event(ts=T0 + 2, reason="after"))
        r.xadd(keys.EVENTS, {"m": b"junk", "tier": "chat"})
        wait_until(lambda: len(lines) >= 3, 20, "the followed events")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        reader.join(timeout=5)
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()
    rows = [json.loads(line) for line in lines]
    assert [row.get("reason") for row in rows[:2]] == ["before", "after"]
    assert "corrupt" in rows[2]
    assert all(row["tier"] == "chat" for row in rows)


# --- fleet top --------------------------------------------------------------------------
def _populate(r: redis.Redis) -> None:
    now = time.time()
    register(r, "chat-a")
    register(r, "chat-b")
    register(r, "chat-gone", alive=False)
    register(r, "chat-new")  # registered, no report yet
    register(r, "batch-a", tier="batch")
    for i in range(8):
        ts = now - 8 + i
        # busy slots the whole second: the handler-seconds counter grows by `busy` per report
        r.xadd(keys.REPORTS, {"m": encode(report("chat-a", ts, busy=2, handler_s=2.0 * i))})
        r.xadd(keys.REPORTS, {"m": encode(report("chat-b", ts, busy=0, cpu=0.05,
                                                 state="draining" if i == 7 else "ready"))})
        r.xadd(keys.REPORTS, {"m": encode(report("batch-a", ts, busy=1, total=1, tier="batch",
                                                 handler_s=1.0 * i))})
    r.xadd(keys.REPORTS, {"m": b"not a report"})
    r.set(keys.policy("chat"), json.dumps({"min_workers": 1, "max_workers": 7}))
    r.set(keys.policy("batch"), json.dumps({"min_workers": 0, "max_workers": 3}))
    r.zadd(keys.active("chat"), {"u1": now, "u2": now - 1, "u3": now - 100_000})
    r.xadd(keys.ready("chat"), {"user": "u1"})
    r.xadd(keys.ready("chat"), {"user": "u2"})
    r.xadd(keys.dead("chat"), {"user": "u9", "reason": "boom"})
    r.set(keys.LEADER, "cmd-1|3", px=5000)
    r.hset(keys.COMMANDERS, "cmd-1", encode(CommanderInfo(commander="cmd-1", pid=11, host="h1", started=now,
                                                           role="leader", epoch=3,
                                                           metrics="http://127.0.0.1:9100/metrics")))
    r.hset(keys.COMMANDERS, "cmd-2", encode(CommanderInfo(commander="cmd-2", pid=12, host="h2", started=now)))
    r.hset(keys.COMMANDERS, "cmd-3", b"\x00\x01")
    for i in range(7):
        ledger(r, event(ts=T0 + i, reason=f"event {i}"))
    ledger(r, event(tier="batch", ts=T0 + 10, reason="batch event"))


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


def test_top_once_shows_tiers_workers_leader_and_events(r: redis.Redis, fleet_env: dict[str, str]) -> None:
    _populate(r)
    out = fleet_cli(fleet_env, "top", "--once")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "\x1b[" not in text  # one plain frame: no terminal codes
    assert "leader: cmd-1 (epoch 3, lease" in text
    assert "commanders: 3" in text
    assert "http://127.0.0.1:9100/metrics" in text and "standby" in text and "corrupt entry" in text

    chat = _line(text, "chat ").split()
    # TIER MIN MAX RUN START DRAIN DEAD BACKLOG ACTIVE DLQ POLICY
    assert chat[:11] == ["chat", "1", "7", "1", "1", "1", "1", "2", "2", "1", "key"]
    batch = _line(text, "batch ").split()
    assert batch[:4] == ["batch", "0", "3", "1"]

    a = _line(text, "chat-a ")
    assert "ready" in a and f"[{'#' * 10}{'.' * 10}] 0.50" in a and "2/4" in a and "3/1" in a
    assert "20%" in a and "200MB" in a
    assert "draining" in _line(text, "chat-b ") and "0.05" in _line(text, "chat-b ")
    assert "dead" in _line(text, "chat-gone ") and "(no report)" in _line(text, "chat-gone ")
    assert "starting" in _line(text, "chat-new ") and "(no report)" in _line(text, "chat-new ")
    assert "[####################] 1.00" in _line(text, "batch-a ")
    assert "1 corrupt report(s) skipped" in text

    events = text.split("LAST 5 EVENTS", 1)[1]
    assert "batch event" in events and "event 6" in events and "event 3" in events
    assert "event 2" not in events


def test_top_once_for_one_tier(r: redis.Redis, fleet_env: dict[str, str]) -> None:
    _populate(r)
    out = fleet_cli(fleet_env, "top", "--once", "--tier", "batch")
    assert out.returncode == 0, out.stderr
    assert "batch-a" in out.stdout and "chat-a" not in out.stdout
    assert not any(line.startswith("chat ") for line in out.stdout.splitlines())
    events = out.stdout.split("LAST 5 EVENTS", 1)[1]
    assert "batch event" in events and "event 6" not in events


def test_top_on_an_empty_fleet(r: redis.Redis, fleet_env: dict[str, str]) -> None:
    out = fleet_cli(fleet_env, "top", "--once")
    assert out.returncode == 0, out.stderr
    assert "leader: none" in out.stdout
    assert "(no workers registered)" in out.stdout and "(the ledger is empty)" in out.stdout


def test_top_live_refreshes_and_exits_0_on_ctrl_c(r: redis.Redis, fleet_env: dict[str, str]) -> None:
    _populate(r)
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "top", "--interval", "0.2"], env=fleet_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    clear = b"\x1b[H\x1b[2J"
    try:
        assert proc.stdout is not None
        first = b""
        while first.count(clear) < 2:  # a second frame has begun: it refreshes (the test's timeout bounds it)
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, "top exited before its second frame"
            first += chunk
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
        out = first + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=5)
    assert proc.returncode == 0, err.decode()
    assert out.count(b"\x1b[H\x1b[2J") >= 2  # cleared and redrawn
    assert b"chat-a" in out
