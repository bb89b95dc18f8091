"""The monitor page in a real browser: Debian's chromium, headless, driven by playwright-core
(``tests/browser_driver.py``, the ``browser`` fixture), against a real commander and its
workers under load.

Screenshots go to the test's tmp dir (their paths are printed), and also to
``$FLEET_MONITOR_SHOTS`` when set (how docs/images/monitor-*.png were made).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from fleet.client import Fleet
from protocol import keys
from protocol.codec import CodecError, decode
from protocol.deferral import Deferral
from protocol.groups import Group
from protocol.models import CommanderInfo, Reply
from protocol.policy import TurnsPolicy, rq_policy, turns_policy
from stores.deadletters import retry_turn_id
from stores.policies import write_policy
from tests.browser_driver import Browser
from tests.helpers import Started, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "browser-test-token"
ROWS = "document.querySelectorAll('#workers tbody tr[data-worker]').length"


@pytest.fixture
def commander(start_commander: Callable[..., Started], r: redis.Redis) -> str:
    """A real commander serving the monitor on a free loopback port, behind its tokens (the page
    logs in with the operator's, ``TOKEN``, to retry and requeue); its base URL."""
    tokens = {"FLEET_COMMANDER_METRICS_TOKEN": "browser-read-token", "FLEET_COMMANDER_OPERATOR_TOKEN": TOKEN}
    started = start_commander("mon1", "--metrics-port", "0", env=tokens, metrics=True)
    print(f"commander log: {started.log}")
    return f"http://{wait_until(lambda: _address(r, started), 30, 'the commander to register its address')}"


def _address(r: redis.Redis, commander: Started) -> str | None:
    assert commander.alive(), "the commander exited"
    blob = r.hget(keys.COMMANDERS, "mon1")
    if not isinstance(blob, bytes):
        return None
    try:
        info = decode(CommanderInfo, blob)
    except CodecError:
        return None
    return info.metrics if info.role == "leader" and info.metrics else None


class Load:
    """A few users sending turns in a loop (``stop`` ends it)."""

    def __init__(self, url: str, users: int = 10) -> None:
        self.fleet, self.users, self.replies = Fleet(url), [f"web{i}" for i in range(users)], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            handles = self.fleet.submit_many([(u, "hello monitor") for u in self.users])
            self.replies += len(self.fleet.results(handles, timeout=60))
            self.stop.wait(0.05)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=90)


def _shot(b: Browser, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"monitor-{name}.png"
    b("shot", path=str(path))
    print(f"screenshot: {path}")
    keep = os.environ.get("FLEET_MONITOR_SHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)
    return path


def _policy(r: redis.Redis, min_workers: int, fail_attempts: int = 0) -> None:
    write_policy(r, "chat", turns_policy(handler="sleep", concurrency=4, min_workers=min_workers,
                                         max_workers=4,
                                         handler_options={"sleep_ms": 60, "fail_attempts": fail_attempts},
                                         max_attempts=2, scale_down_stabilization_s=1))


def test_the_page_follows_a_real_fleet_as_it_scales(r: redis.Redis, redis_server: Any, commander: str,
                                                    browser: Browser, tmp_path: Path) -> None:
    _policy(r, 1)
    opened = browser("open", url=f"{commander}/?token={TOKEN}")
    assert opened["url"] == f"{commander}/", opened["url"]  # the token left the address bar
    weight = opened["weight"]
    print(f"page weight, one full load: {weight['requests']} requests, {weight['bytes']} bytes")
    for item in weight["items"]:
        print(f"  {item['status']} {item['bytes']:>7} {item['url']}")

    browser("wait", js="document.querySelector('.tier[data-tier=\"chat\"]') !== null")
    with Load(redis_server.role_url("fleet-client")):
        browser("wait", js=f"{ROWS} === 1", timeout=30000)
        browser("wait", js="document.querySelectorAll('#workers svg.hist rect').length > 3", timeout=30000)
        _shot(browser, tmp_path, "one-worker")

        _policy(r, 3)  # the tier scales up: the rows appear without a reload
        browser("wait", js=f"{ROWS} === 3", timeout=40000)
        browser("wait", js="document.querySelector('.tier[data-tier=\"chat\"] .stat b').textContent === '3'",
                timeout=40000)
        time.sleep(3)  # the occupancy histograms fill for the screenshot: nothing is asserted on them
        _shot(browser, tmp_path, "overview")

    _policy(r, 1)  # the load stops and the floor goes down: the drained workers' rows go
    browser("wait", js=f"{ROWS} === 1", timeout=60000)

    browser("hash", hash="#/ledger")
    browser("wait", js="[...document.querySelectorAll('#ledger tbody tr')].some(tr => "
                       "tr.textContent.includes('scale-up'))")
    _shot(browser, tmp_path, "ledger")
    _retry_a_dead_letter_from_the_page(r, redis_server.url, browser, tmp_path)
    _a_canary_on_the_page(r, browser, tmp_path)
    _a_failed_job_requeued_from_the_page(r, browser, tmp_path)

    browser("hash", hash="#/population")  # the users of the load, searchable; one user's page
    browser("wait", js="document.querySelectorAll('#population tbody a').length >= 5")
    browser("eval", js="(() => { const q = document.querySelector('#population-q'); q.value = 'web3';"
                       " q.dispatchEvent(new Event('input')); })()")
    browser("wait", js="document.querySelectorAll('#population tbody a').length === 1")
    browser("click", selector="#population tbody a")
    browser("wait", js="document.querySelector('#user dl.kv') !== null && "
                       "document.querySelector('#user-id').textContent === 'web3'")
    assert browser("errors")["errors"] == []  # no script error, no CSP violation


from stores.deadletters import dead_letter_rows, purge_dead_letters  # noqa: E402


def _groups(green: float) -> TurnsPolicy:
    return turns_policy(handler="echo", min_workers=0, max_workers=2, canary="green",
                        groups=(Group(name="blue", weight=100 - green), Group(name="green", weight=green)))


def _a_canary_on_the_page(r: redis.Redis, b: Browser, tmp_path: Path) -> None:
    """A grouped tier: each group's pool is a panel that says which group it is and lists the
    tier's groups with their shares, the canary marked; a rollout step shows without a reload."""
    write_policy(r, "ab", _groups(10))
    b("hash", hash="#/")
    green = "document.querySelector('.tier[data-tier=\"ab.blue\"] tr[data-group=\"green\"]')"
    b("wait", js=f"{green} !== null && {green}.textContent.includes('10.0 %') && "
                 f"{green}.querySelector('.badge.canary') !== null", timeout=30000)
    pool = "document.querySelector('.tier[data-tier=\"ab.green\"] .group-of')"
    b("wait", js=f"{pool} !== null && {pool}.textContent.includes('group green of tier ab')")
    write_policy(r, "ab", _groups(50))  # fleet rollout ab green --weight 50
    b("wait", js=f"{green}.textContent.includes('50.0 %') && {pool}.textContent.includes('50.0 %')",
      timeout=30000)
    _shot(b, tmp_path, "groups")


def _a_failed_job_requeued_from_the_page(r: redis.Redis, b: Browser, tmp_path: Path) -> None:
    """An rq tier's failed job shows with its error, and Requeue on the page runs it again."""
    from stores import rqjobs  # (the rq extra)

    write_policy(r, "writeback", rq_policy(min_workers=0, max_workers=1,
                                           scale_down_stabilization_s=1))
    d = Deferral(name="fail_first", kwargs={"times": 9}, queue="writeback", user="rq-user", turn_id="t1",
                 index=0, ts=time.time())
    assert rqjobs.enqueue(r, d)  # the commander starts an RQ worker for it; it fails, no retry left
    b("hash", hash="#/")
    row = f"document.querySelector('.failed-jobs[data-queue=\"writeback\"] tr[data-job=\"{d.job_id}\"]')"
    b("wait", js=f"{row} !== null && {row}.textContent.includes('RuntimeError')", timeout=60000)
    _shot(b, tmp_path, "rq-failed")
    b("click", selector=f'.failed-jobs tr[data-job="{d.job_id}"] button.requeue')
    b("wait", js="document.querySelector('#rq-result').textContent === 'requeued 1 job(s) on writeback'")
    runs = lambda: r.hget(keys.usage("rq-user"), "fail_first_runs")  # noqa: E731
    wait_until(lambda: runs() == b"2", 60, "the requeued job to run again")


def _until_served(url: str, in_a_row: int) -> None:
    """Submit probe turns until ``in_a_row`` consecutive ones are answered ok (a deadline of 60 s)."""
    deadline, ok = time.monotonic() + 60, 0
    with Fleet(url) as fleet:
        while ok < in_a_row:
            assert time.monotonic() < deadline, "the workers never ran the fixed policy"
            ok = ok + 1 if fleet.submit(f"probe-{ok}", "probe").result(timeout=60).ok else 0


def _retry_a_dead_letter_from_the_page(r: redis.Redis, url: str, b: Browser, tmp_path: Path) -> None:
    """A turn that failed every attempt is dead-lettered; once the fault is gone, Retry on the
    page re-enqueues it and its reply arrives."""
    _policy(r, 1, fail_attempts=9)  # every attempt fails: dead-lettered after max_attempts
    # the workers read their policy each renew: submit until one turn fails (no worker says
    # which policy it runs, so the outcome is what is polled)
    deadline = time.monotonic() + 60
    with Fleet(url) as fleet:
        while (failed := fleet.submit("dlq-user", "doomed at first").result(timeout=60)).ok:
            assert time.monotonic() < deadline, "the workers never ran the failing policy"
    wait_until(lambda: r.xlen(keys.dead("chat")) == 1, 30, "the dead letter")
    _policy(r, 1)  # the fault is fixed
    b("hash", hash="#/dead-letters")
    _until_served(url, 5)  # the workers run the fixed policy: five probe turns in a row answered ok
    probes = [row.id for row in dead_letter_rows(r, "chat", 1000) if row.user.startswith("probe-")]
    if probes:  # probes the old policy failed: not the dead letter this test retries
        purge_dead_letters(r, "chat", probes)
    [dead] = dead_letter_rows(r, "chat", 1000)
    assert dead.user == "dlq-user", dead
    # the page polls every 2 s: until a poll after the purge, its table still lists the probes'
    # dead letters, and a Retry on one of those retries nothing ("unknown"). So wait until it
    # shows what Redis holds, that one row, and click that row's button by its id.
    row = f'#dead tbody tr[data-id="{dead.id}"]'
    b("wait", js=f"document.querySelectorAll('#dead tbody tr[data-id]').length === 1 && "
                 f"document.querySelector('{row}') !== null")
    _shot(b, tmp_path, "dead-letters")
    b("click", selector=f"{row} button.retry")
    b("wait", js="document.querySelector('#dead-result').textContent !== ''")
    said = b("eval", js="document.querySelector('#dead-result').textContent")["value"]
    assert said == "retried 1 of 1", said  # a row gone from Redis: "retried 0 of 1; not retried: ..."
    retried = retry_turn_id(failed.turn_id)
    wait_until(lambda: r.exists(keys.reply("dlq-user", retried)), 30, "the retried turn's reply")
    raw = r.lindex(keys.reply("dlq-user", retried), 0)
    assert isinstance(raw, bytes)
    try:
        reply = decode(Reply, raw).model_dump()
    except CodecError:  # a plain (JSON) turn's reply
        reply = json.loads(raw)
    assert reply["ok"] is True and reply["turn_id"] == retried, reply
    b("wait", js="document.querySelector('#dead tbody tr.empty') !== null")  # the list is empty again
