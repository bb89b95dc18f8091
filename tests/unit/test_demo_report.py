"""scripts/demo.py reports what it observed: each claim comes from the run, and what did not
happen is a failure, never a line of fixed text."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from protocol.models import Reply

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

from demo import Observed, report  # noqa: E402  (scripts/ is no package)


def reply(n: int, worker: str = "w1", ok: bool = True, attempts: int = 1) -> Reply:
    return Reply(turn_id=f"t{n}", user="u", ok=ok, text="x", worker=worker, attempts=attempts)


GOOD = Observed(
    submitted=4, replies=[reply(0, "w1"), reply(1, "w2", attempts=2), reply(2, "w3"), reply(3, "w3")],
    elapsed_s=1.25, sessions_in_order=2, users=2, unread_replies=0, victim="w1", killed_at_s=0.5,
    victim_alive_after=False, takeover={"action": "worker-exited", "why": {"takeover": {"users": 1}}},
    before={"w1", "w2"}, peak=3, after={"w2", "w3"}, scale_events=["scale-up 2->3"])


def test_a_run_where_everything_happened_reports_its_figures_and_no_failure() -> None:
    lines, failures = report(GOOD)
    text = "\n".join(lines)
    assert failures == []
    assert "4 of 4 turns answered in 1.2 s; ok: 4; answered on a second attempt or later: 1" in text
    assert "2 of 2 users" in text and "SIGKILL to w1 at 0.5 s; its process is gone" in text
    assert "worker-exited w1, 1 user(s) handed on" in text and "scale-up 2->3" in text
    assert "2 before, at most 3 during the load, 2 now (1 started since the load began: w3)" in text


@pytest.mark.parametrize("change, failure", [
    ({"replies": GOOD.replies[:3]}, "1 of 4 turns not answered ok"),
    ({"replies": [*GOOD.replies[:3], reply(3, ok=False)]}, "1 of 4 turns not answered ok"),
    ({"sessions_in_order": 1}, "a session out of order"),
    ({"unread_replies": 1}, "answered twice"),
    ({"killed_at_s": None}, "did not land"),
    ({"victim_alive_after": True}, "did not land"),
    ({"takeover": None}, "did not take it over"),
    ({"after": {"w1", "w2"}}, "not back at 2 live workers without w1"),
    ({"after": {"w2"}}, "not back at 2 live workers without w1"),
])
def test_what_did_not_happen_is_a_failure_not_a_claim(change: dict[str, object], failure: str) -> None:
    lines, failures = report(replace(GOOD, **change))  # type: ignore[arg-type]
    assert any(failure in f for f in failures), failures
    if change.get("takeover", "") is None:
        assert not any("worker-exited" in line for line in lines)
    if "killed_at_s" in change:
        assert not any("SIGKILL to" in line for line in lines)
