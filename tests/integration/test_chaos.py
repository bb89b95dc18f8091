"""The chaos run's short mode: faults of every kind, then the invariants I1-I6 must hold."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_chaos_quick_holds_every_invariant(tmp_path):
    out = tmp_path / "chaos.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    result = json.loads(out.read_text()) if out.exists() else {}
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert result["invariants_failed"] == []
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["out_of_order_users"] == 0
    assert result["orphans"] == 0
    assert result["submitted"] > 0 and result["answered"] == result["submitted"]
    # every kind of fault was injected at least once
    assert {"worker-kill", "drain-kill", "commander-kill", "redis-restart",
            "redis-pause"} <= set(result["faults"]), result["faults"]
