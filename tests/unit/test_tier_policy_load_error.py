"""The commander's verdict on a policy naming a handler the tier's workers cannot load says
why when they reported it: the load error of its entry point, in the ledger."""

from __future__ import annotations

from typing import Any

import fakeredis

from commander.tier_policies import TierPolicies
from protocol.models import WorkerInfo
from protocol.policy import TurnsPolicy
from stores.policies import write_policy


class Ledger:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def record(self, tier: str, action: str, *_: Any, reason: str = "", **__: Any) -> None:
        self.events.append((tier, action, reason))


def test_the_ledger_names_the_workers_load_error() -> None:
    r = fakeredis.FakeRedis()
    write_policy(r, "chat", TurnsPolicy(handler="broken"))
    ledger = Ledger()
    policies = TierPolicies(r, ledger, None)  # type: ignore[arg-type]
    info = WorkerInfo(worker="w1", tier="chat", pid=1, host="h", started=0.0, handlers=["echo"],
                      handler_errors={"broken": "ModuleNotFoundError: No module named 'broken_x'"})
    read = policies.read_all(["chat"], {"chat": {"w1": (info, True)}})["chat"]
    assert read.rejected is not None and "No module named 'broken_x'" in read.rejected
    [(tier, action, reason)] = ledger.events
    assert (tier, action) == ("chat", "policy-rejected") and "cannot be loaded" in reason
