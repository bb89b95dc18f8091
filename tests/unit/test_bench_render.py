"""scripts/bench writes its regions of docs/BENCHMARKS.md and keeps the rest of the page, which
is written by hand from dedicated runs: a region is replaced only when all of its steps ran, and
says when they ran and how quiet the machine was."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

from bench_render import REGIONS, render, splice  # noqa: E402  (after the path)

PAGE = """# Benchmarks

Hand-written.

<!-- bench:commander -->
old figures
<!-- /bench:commander -->

### 4b. Hand-written too
"""


def test_splice_replaces_a_region_and_keeps_the_rest() -> None:
    page = splice(PAGE, {"commander": "new figures"})
    assert page == PAGE.replace("old figures", "new figures")
    with pytest.raises(ValueError, match="no region goals"):
        splice(PAGE, {"goals": "x"})


def test_only_the_regions_whose_steps_all_ran_are_rendered(tmp_path: Path) -> None:
    commander = {"decide": {"workers": 1000, "tiers": 20, "median_ms": 0.5, "p95_ms": 0.6,
                            "per_tier_us": 25.0},
                 "ingest": {"reports": 100, "seconds": 0.01, "reports_per_s": 10000},
                 "machine": {"load_average_at_start": [0.42, 0.3, 0.2], "valid": False,
                             "invalid_because": ["others used 20% of a core"]}}
    (tmp_path / "commander.json").write_text(json.dumps(commander))
    data = dict.fromkeys(REGIONS["goals"]) | {"commander": commander}
    regions = render(data, tmp_path, tmp_path, quick=False)
    assert set(regions) == {"commander"}
    text = regions["commander"]
    assert "load average 0.42 at its start, INVALID: others used 20% of a core" in text
    assert "median **0.5 ms**" in text and "Quick mode" not in text
    page = splice(PAGE, regions)
    assert "old figures" not in page and "Hand-written." in page and "### 4b. Hand-written too" in page


def test_the_page_has_every_region() -> None:
    page = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert splice(page, dict.fromkeys(REGIONS, "x")).count("\nx\n") == len(REGIONS)
