"""docs/grafana/fleet.json: a valid dashboard whose queries name only metrics the commander exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from commander.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "fleet.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# what the issue asks the dashboard to show, at least
WANTED = {"fleet_tier_running_workers", "fleet_tier_starting_workers", "fleet_tier_draining_workers",
          "fleet_tier_desired_workers", "fleet_tier_target_workers", "fleet_tier_backlog",
          "fleet_tier_active_users", "fleet_worker_occupancy", "fleet_turns_total",
          "fleet_turn_queue_wait_seconds_bucket", "fleet_turn_handler_seconds_bucket",
          "fleet_turn_latency_seconds_bucket", "fleet_dead_letters_total", "fleet_turn_retries_total",
          "fleet_fenced_total", "fleet_takeovers_total", "fleet_scale_events_total"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return body


def exported() -> set[str]:
    """Every sample name a fresh commander's registry can expose."""
    names = set()
    for family in Metrics().registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_dashboard_is_a_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 36 and dashboard["title"] and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["tier"]["datasource"] == DATASOURCE
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        box = panel["gridPos"]
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24 and box["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        assert all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]


def test_every_metric_a_query_uses_is_exported(dashboard: dict[str, Any]) -> None:
    used = {name for expr in queries(dashboard) for name in re.findall(r"fleet_[a-z_]+", expr)}
    assert used - exported() == set()
    assert WANTED - used == set(), "panels the dashboard should have"


def test_queries_are_well_formed(dashboard: dict[str, Any]) -> None:
    for expr in queries(dashboard):
        depth = 0
        for ch in expr:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            assert depth >= 0, expr
        assert depth == 0 and expr.count("{") == expr.count("}"), expr
        if "histogram_quantile" in expr:  # over the rate of the buckets, keeping le
            assert "_bucket" in expr and "rate(" in expr and re.search(r"by \([^)]*\ble\b", expr), expr
        for name in re.findall(r"fleet_[a-z_]+_total", expr):
            assert re.search(rf"(rate|increase)\({name}\b", expr), f"a counter read raw: {expr}"
