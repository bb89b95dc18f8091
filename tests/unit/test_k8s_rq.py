"""The kubernetes runtime's rq tiers, pure parts (commander/runtime/kubernetes/rq_pods.py): which pods' RQ
registrations are read, the registry a pod's state is read from, what an ended pod left behind,
and the grace period warning; and the rq views' use of the pod's state (commander/rq/inputs.py).
Tables of cases; no API server, no Redis."""

from __future__ import annotations

import pytest

from commander.rq.inputs import RqWorkerSeen, rq_views
from commander.runtime.interface import Lifecycle, WorkerHandle
from commander.runtime.kubernetes.model import Deployment, Pod
from commander.runtime.kubernetes.reconcile import reconcile
from commander.runtime.kubernetes.rq_pods import rq_names, rq_registry, short_grace

TIER = "writeback"


def pod(name: str, phase: str = "Running", ready: bool = True, tier: str = TIER,
        deleting: bool = False) -> Pod:
    return Pod(name=name, tier=tier, phase=phase, node="n1", ready=ready, created=1.0, deleting=deleting)


def handle(name: str, state: Lifecycle = Lifecycle.RUNNING, tier: str = TIER) -> WorkerHandle:
    return WorkerHandle(name, tier, 0, state, 1.0)


def test_the_names_read_are_the_rq_tiers_pods_listed_or_known_before() -> None:
    pods = [pod("w-a"), pod("c-a", tier="chat"), pod("w-b", phase="Pending", ready=False)]
    handles = [handle("w-gone"), handle("c-gone", tier="chat")]
    assert rq_names([TIER], pods, handles) == ["w-a", "w-b", "w-gone"]
    assert rq_names([], pods, handles) == []  # no rq tier: RQ's registry is not read at all


@pytest.mark.parametrize(("the_pod", "registered", "expected"), [
    (pod("p"), True, {"p": True}),  # Running, Ready, in RQ's registry: its RQ worker is alive
    (pod("p", ready=False), True, {"p": False}),  # its container died: the entry is a dead one's
    (pod("p", phase="Pending", ready=False), True, {"p": False}),
    (pod("p"), False, {}),  # not registered (yet, or any more): left out
    (None, True, {"p": False}),  # gone from the listing, still registered: it died with its job
    (None, False, {}),  # gone and deregistered: a warm shutdown
])
def test_the_registry_of_an_rq_pod(the_pod: Pod | None, registered: bool, expected: dict[str, bool]) -> None:
    assert rq_registry(["p"], [registered], [the_pod] if the_pod else []) == expected


@pytest.mark.parametrize(("the_pod", "registered", "state"), [
    (pod("p"), True, Lifecycle.RUNNING),
    (pod("p", ready=False), True, Lifecycle.STARTING),  # a dead RQ worker's entry does not count
    (pod("p"), False, Lifecycle.STARTING),  # the container runs; RQ has no worker of it yet
    (pod("p", deleting=True), True, Lifecycle.DRAINING),  # warm shutdown under way
])
def test_a_pods_state_from_rqs_registry(the_pod: Pod, registered: bool, state: Lifecycle) -> None:
    view = reconcile({}, [the_pod], rq_registry(["p"], [registered], [the_pod]), {}, (), now=10.0)
    assert view.handles["p"].state is state


@pytest.mark.parametrize(("registered", "drained"), [(False, True), (True, False)])
def test_an_ended_pod_left_nothing_when_rq_no_longer_has_it(registered: bool, drained: bool) -> None:
    prior = {"p": handle("p", Lifecycle.DRAINING)}
    view = reconcile(prior, [], rq_registry(["p"], [registered], []), {}, (), now=10.0)
    (gone,) = view.exits
    assert gone.state is Lifecycle.EXITED and gone.drained is drained  # not drained: its job is reaped


@pytest.mark.parametrize(("grace_s", "drain_s", "rq", "says"), [
    (200.0, 180.0, True, None),
    (180.0, 180.0, True, None),
    (30.0, 180.0, True, "an RQ worker's warm shutdown at 30s"),
    (None, 180.0, True, "terminationGracePeriodSeconds 30 is under the tier's drain_timeout_s 180"),
    (45.0, 60.0, False, "a drain at 45s, and the turns in flight run again"),
    (10.0, None, True, None),  # no timeout given: nothing to compare
])
def test_a_short_grace_period_is_said(grace_s: float | None, drain_s: float | None, rq: bool,
                                      says: str | None) -> None:
    why = short_grace(Deployment("fleet-worker-writeback", TIER, 1, grace_s), drain_s, rq, 30.0)
    if says is None:
        assert why is None
    else:
        assert why is not None and says in why and "fleet-worker-writeback" in why


@pytest.mark.parametrize(("state", "seen", "view"), [
    (Lifecycle.RUNNING, "idle", "ready"),
    (Lifecycle.RUNNING, None, "starting"),
    (Lifecycle.STARTING, "busy", "starting"),  # the pod's state says its RQ worker is not alive
    (Lifecycle.DRAINING, "busy", "draining"),
])
def test_an_rq_view_needs_the_runtime_to_say_running(state: Lifecycle, seen: str | None, view: str) -> None:
    rq = [RqWorkerSeen("p", seen, "j")] if seen else []
    (v,) = rq_views(TIER, [handle("p", state)], rq)
    assert v.state == view
