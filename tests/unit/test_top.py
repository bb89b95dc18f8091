"""``fleet top``'s frame as text (``fleet.top.render``): pure, from a frame built here."""

from __future__ import annotations

from commander.evaluator import Occupancy
from fleet.top import LEGEND, Frame, WorkerRow, busiest, render


def frame(workers: int) -> Frame:
    rows = [WorkerRow(worker=f"chat-{i:05d}", tier="chat", state="ready", busy=1, total=4, report_age_s=1.0,
                      occupancy=Occupancy(value=(i % 100) / 100), age_s=60.0) for i in range(workers)]
    rows.append(WorkerRow(worker="chat-new", tier="chat", state="starting", occupancy=Occupancy()))
    return Frame(ts=1_800_000_000.0, tiers=[], workers=rows, leader=None, leader_ttl_ms=None)


def test_a_frame_of_ten_thousand_workers_fits_the_terminal_and_shows_the_busiest() -> None:
    big = frame(10_000)
    text = render(big, width=120, height=40)
    lines = text.splitlines()
    assert len(lines) <= 39, len(lines)  # (the cursor takes the last line)
    shown = [line for line in lines if line.startswith("chat-")]
    assert shown and all("0.99" in line for line in shown), shown  # the busiest: occupancy 0.99 each
    assert f"... {10_001 - len(shown):,} more of 10,001 workers, busiest shown first" in text
    assert LEGEND[0] in lines and "LAST 5 EVENTS" in text


def test_a_fleet_that_fits_or_a_pipe_shows_every_worker_in_order() -> None:
    small = frame(5)
    for height in (None, 60):
        lines = render(small, width=120, height=height).splitlines()
        assert [line.split()[0] for line in lines if line.startswith("chat-")] == \
            [*(f"chat-{i:05d}" for i in range(5)), "chat-new"]
        assert not any("more of" in line for line in lines)
    assert len(render(frame(10_000)).splitlines()) > 10_000  # into a pipe: whole


def test_busiest_puts_workers_without_a_report_last() -> None:
    rows = frame(3).workers
    assert [w.worker for w in busiest(rows, 4)] == ["chat-00002", "chat-00001", "chat-00000", "chat-new"]
    assert busiest(rows, 0) == []
