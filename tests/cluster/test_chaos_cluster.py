"""``scripts/chaos --cluster``: the chaos run on a 3+3 Redis Cluster with a master failover.

The smoke test runs ``--cluster --quick`` (60 s, one master SIGKILL, its replica promoted):
what must hold across a failover holds, and the failover's figures are reported. What a
failover explains (asynchronous replication: lost or doubled writes) is reported, not asserted
to be zero. The other tests check the split on hand-made records, without Redis.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from redis.crc import key_slot

from protocol import keys
from tests.cluster.conftest import _require_cluster_tools
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

SPLIT = ("lost", "duplicated", "out_of_order", "context_gaps", "i3_violations")


@pytest.mark.smoke
def test_chaos_cluster_quick_survives_a_master_failover(tmp_path):
    _require_cluster_tools()
    out = tmp_path / "chaos.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--cluster", "--quick",
                          "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    result = json.loads(out.read_text()) if out.exists() else {}
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert result["cluster"] is True and result["invariants_failed"] == [] and result["quota_missed"] == []
    # the cluster faults replaced the single node's, and a master was killed and its replica promoted
    assert {"master-kill", "master-pause"} <= set(result["faults"]), result["faults"]
    assert not {"redis-restart", "redis-pause"} & set(result["quota"])
    assert len(result["master_kills"]) >= 1
    for kill in result["master_kills"]:
        assert kill["promotion_s"] is not None and kill["promotion_s"] > 0, kill
        assert kill["promoted_port"] != kill["port"] and kill["healed_s"] >= kill["promotion_s"]
    # what must hold across a failover: liveness, I6; every turn answered or lost to the failover
    assert result["failover"]["stranded"] == 0 and result["orphans"] == 0
    assert all(result["failover"]["outside"][k] == 0 for k in SPLIT), result["failover"]
    lost_to_failover = result["failover"]["across"]["lost"]
    assert result["submitted"] > 0 and result["answered"] + lost_to_failover == result["submitted"]
    assert result["trace"].get("exit", 0) > 0
    for line in ("master kill 1", "across a failover / outside", "ACROSS A FAILOVER (expected without WAIT)",
                 "stranded", "INVARIANTS: all hold"):
        assert line in run.stdout, run.stdout


def _user_on(slot_range: tuple[int, int] | None = None, avoid: tuple[int, int] | None = None) -> str:
    """A user id whose inbox slot is inside ``slot_range`` (or outside ``avoid``)."""
    for i in range(100_000):
        slot = key_slot(keys.inbox(f"u{i}").encode())
        if slot_range and slot_range[0] <= slot <= slot_range[1]:
            return f"u{i}"
        if avoid and not avoid[0] <= slot <= avoid[1]:
            return f"u{i}"
    raise AssertionError("no such user")


def _checker(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import chaos_check

    return chaos_check


def test_failover_split_tells_what_a_failover_explains(monkeypatch):
    """An anomaly is the failover's when its user's slot (or the tier's) was on the killed
    master and it falls in the kill's window; a lost turn still in its inbox is stranded."""
    ck = _checker(monkeypatch)
    tier_slots = {key_slot(keys.ready("chat").encode()), key_slot(keys.active("chat").encode())}
    killed = (0, 5460) if not any(s <= 5460 for s in tier_slots) else (10923, 16383)
    assert not any(killed[0] <= s <= killed[1] for s in tier_slots)
    hit, spared = _user_on(killed), _user_on(avoid=killed)
    kill = ck.MasterKill(t=100.0, promoted=104.0, port=1, promoted_port=2, slots=[killed], healed=110.0)
    logs = {u: ck.UserLog() for u in (hit, spared)}
    for u in logs:
        logs[u].sent_at.update({f"{u}-0": 99.5, f"{u}-1": 300.0, f"{u}-2": 99.0, f"{u}-3": 101.0})
    detail = {"lost": [(hit, f"{hit}-0"), (spared, f"{spared}-0"), (hit, f"{hit}-2")],
              "duplicated": [(hit, f"{hit}-3"), (hit, f"{hit}-1")],
              "i3_violations": [(hit, 103.0), (spared, 103.0)]}
    inboxes = {hit: {f"{hit}-2"}}  # its turn 2 survived in the inbox but was never answered
    split = ck.failover_split(inboxes, logs, [kill], detail, epochs_ok=True)
    assert split["across"] == {"lost": 1, "duplicated": 1, "out_of_order": 0, "context_gaps": 0,
                               "i3_violations": 1}
    # the spared shard's lost turn and I3 violation, and a duplicate long after the failover
    assert split["outside"] == {"lost": 1, "duplicated": 1, "out_of_order": 0, "context_gaps": 0,
                                "i3_violations": 1}
    assert split["stranded"] == 1 and split["stranded_examples"] == [f"{hit}-2"]
    base = {"lost": 3, "duplicated": 2, "out_of_order_users": 0, "context_gaps": 0, "i3_violations": 2,
            "answered": 1, "trace": {"exit": 1}, "orphans": 0, "max_live_workers": 1, "max_workers": 6}
    fails, expected = ck.cluster_failures(base, split, epochs_ok=True)
    assert fails[:3] == ["I1/I5 lost turns", "I1 duplicated replies or session entries",
                         "I3 two workers ran and committed turns of one user at the same time"]
    assert fails[3].startswith("liveness: 1 turns never answered")
    assert expected == ["I1 turns lost (their submit did not survive the failover): 1",
                        "I1 duplicated replies or session entries: 1", "I3 two leases committed at once: 1"]


def test_a_failover_that_explains_everything_passes(monkeypatch):
    ck = _checker(monkeypatch)
    killed = (0, 16383)  # every slot: the user's, the tier's and the ledger's
    user = _user_on(killed)
    kill = ck.MasterKill(t=100.0, promoted=104.0, port=1, promoted_port=2, slots=[killed])
    logs = {user: ck.UserLog(sent_at={f"{user}-0": 100.0})}
    detail = {"duplicated": [(user, f"{user}-0")], "out_of_order": [(user, f"{user}-0")]}
    split = ck.failover_split({}, logs, [kill], detail, epochs_ok=False)
    assert split["epochs_shared_across_failover"] is True
    res = {"lost": 0, "duplicated": 1, "out_of_order_users": 1, "context_gaps": 0, "i3_violations": 0,
           "answered": 1, "trace": {"exit": 1}, "orphans": 0, "max_live_workers": 1, "max_workers": 6}
    fails, expected = ck.cluster_failures(res, split, epochs_ok=False)
    assert fails == []
    assert len(expected) == 3 and expected[-1].startswith("I4 two commanders in one epoch")


def test_the_policy_hooks(monkeypatch):
    """--policy-json sets tier policy fields (validated as a policy); --replica-acks sets the WAIT."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import chaos

    assert chaos.chaos_policy(None, None) is chaos.POLICY
    assert chaos.chaos_policy(None, '{"concurrency": 2}').concurrency == 2
    with pytest.raises(ValueError):
        chaos.chaos_policy(None, "[1]")
    with pytest.raises(ValueError):
        chaos.chaos_policy(None, '{"no_such_field": 1}')
    assert chaos.chaos_policy(1, None).durability.replica_acks == 1
    with pytest.raises(SystemExit) as exit_:
        chaos.parse_args(["--policy-json", "[1]"])
    assert exit_.value.code == 2


def test_a_session_out_of_order_is_dated_by_its_first_difference(monkeypatch):
    """A session that misses a lost turn differs first at that turn (its submit dates it, not
    the session's oldest entry); a truncated session is aligned on its oldest entry."""
    ck = _checker(monkeypatch)
    expected = ["a", "b", "c", "d", "e"]
    assert ck._first_difference(["a", "b", "d", "e"], expected) == "c"
    assert ck._first_difference(["a", "c", "b", "d", "e"], expected) == "b"
    assert ck._first_difference(["b", "c", "d"], expected) == "e"
    assert ck._first_difference(["x"], expected) == "x"
    assert ck._first_difference([], expected) == "a"
