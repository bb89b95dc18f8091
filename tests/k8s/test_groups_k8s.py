"""Groups on the ``kubernetes`` runtime against the stand-in API server: each group's pool is a
Deployment of its own (labels ``fleet.dev/tier`` and ``fleet.dev/group``), scaled and retired on
its own; a group that names an allowed runtime gets its Deployment made from a copy of its tier's
with that runtime's image (the commander's ``group_runtimes``, never the policy's), and its image
set when the group's runtime changes; a group with neither a Deployment nor a runtime, or naming
a runtime the commander does not allow, is refused with the reason and nothing is written.

Every pod is a real ``fleet worker`` process on the test's redis-server; nothing sleeps.
"""

from __future__ import annotations

import pytest

from commander.group_runtimes import GroupRuntime
from commander.runtime import Lifecycle, Refused
from protocol.groups import Group
from protocol.policy import TurnsPolicy, turns_policy
from stores.policies import write_policy
from tests.integration.conftest import wait_until
from tests.k8s.conftest import DEPLOYMENT, listed_ready, running_and_ready
from tests.k8s.standin import StandIn
from tests.k8s.test_runtime_k8s import registered, states

pytestmark = pytest.mark.integration

BLUE, GREEN = "fleet-worker-chat-blue", "fleet-worker-chat-green"
ALLOWED = {"v2": GroupRuntime(image="fleet:2"), "v3": GroupRuntime(image="fleet:3"),
           "venv": GroupRuntime(python="/opt/v/bin/python")}
TIER = dict(handler="sleep", handler_options={"sleep_ms": 50}, concurrency=2, report_interval_s=0.3,
            drain_timeout_s=15)


def grouped(**green: object) -> TurnsPolicy:
    return turns_policy(**TIER, groups=(Group(name="blue", weight=90, deployment=BLUE),
                                  Group(name="green", weight=10, **green)))


def replicas(standin: StandIn, name: str) -> int:
    with standin.cluster.lock:
        return int(standin.cluster.deployments[name]["spec"]["replicas"])


def pods_of(standin: StandIn, name: str) -> list[str]:
    with standin.cluster.lock:
        return sorted(p["metadata"]["name"] for p in standin.cluster.of(standin.cluster.deployments[name])
                      if not p["metadata"].get("deletionTimestamp"))


def running(runtime, pool: str, n: int) -> list[str]:
    def ok() -> list[str]:
        seen = states(runtime, pool)
        return sorted(seen) if len(seen) == n and all(s is Lifecycle.RUNNING for s in seen.values()) else []
    return list(wait_until(ok, 30, f"{n} running workers of {pool}"))


def test_a_grouped_tiers_pools_scale_and_retire_on_their_own(standin: StandIn, make_runtime, r):
    write_policy(r, "chat", grouped())
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
        standin.cluster.add_deployment(BLUE, "chat", replicas=1, group="blue")
        standin.cluster.add_deployment(GREEN, "chat", replicas=0, group="green")
    runtime = make_runtime(group_runtimes=ALLOWED)
    assert runtime.check_group("chat.blue") is None and runtime.check_group("chat.green") is None
    (blue,) = running(runtime, "chat.blue", 1)

    ids = runtime.spawn("chat.green", 2)
    assert all(i.startswith(f"{GREEN}:starting-") for i in ids)
    assert (replicas(standin, GREEN), replicas(standin, BLUE), replicas(standin, DEPLOYMENT)) == (2, 1, 0)
    assert [h.tier for h in runtime.live("chat.green")] == ["chat.green"] * 2
    green = running(runtime, "chat.green", 2)
    assert green == pods_of(standin, GREEN)
    infos = registered(r)
    assert {infos[p].tier for p in green} == {"chat.green"} and infos[blue].tier == "chat.blue"

    # every pod Ready first, in the runtime's listing too: a pod it lists as not ready would be
    # deleted in the victim's place (substituted)
    running_and_ready(standin, 3)
    listed_ready(runtime, "chat.green", 2)
    victim = green[1]
    runtime.retire(victim, "reclaim-idle: test")
    standin.wait_for(lambda c: victim in c.ended, 30, f"green pod {victim} to go")
    assert standin.cluster.rs_deleted == [victim]
    assert (replicas(standin, GREEN), replicas(standin, BLUE)) == (1, 1)
    assert pods_of(standin, BLUE) == [blue] and pods_of(standin, GREEN) == [green[0]]
    assert runtime.refusal("chat") is None  # the tier's own Deployment is a pool of its own, still


def test_a_group_with_an_image_gets_its_deployment_made_scaled_and_rolled(standin: StandIn, make_runtime, r):
    write_policy(r, "chat", grouped(runtime="v2"))
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0, grace_s=45, env={"EXTRA": "1"})
        standin.cluster.add_deployment(BLUE, "chat", replicas=0, group="blue")
    runtime = make_runtime(group_runtimes=ALLOWED)
    assert runtime.check_group("chat.green") is None
    with standin.cluster.lock:
        made = standin.cluster.deployments[GREEN]
        template = made["spec"]["template"]
        labels = {"app.kubernetes.io/component": "worker", "fleet.dev/tier": "chat",
                  "fleet.dev/group": "green"}
        assert made["metadata"]["labels"] == labels == template["metadata"]["labels"]
        assert made["spec"]["selector"] == {"matchLabels": labels} and made["spec"]["replicas"] == 0
        assert made["metadata"]["annotations"] == {"fleet.dev/copied-from": DEPLOYMENT}
        (worker,) = template["spec"]["containers"]
        assert worker["image"] == "fleet:2" and template["spec"]["terminationGracePeriodSeconds"] == 45
        assert worker["env"] == [{"name": "EXTRA", "value": "1"},
                                 {"name": "FLEET_WORKER_GROUP", "value": "green"}]
        # its PodDisruptionBudget: over exactly its pods, one eviction at a time
        budget = standin.cluster.budgets[GREEN]
        assert budget["metadata"]["labels"] == labels
        assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": labels}}
    (note,) = runtime.notes()
    assert (note.tier, note.action) == ("chat.green", "deployment-created")
    assert f"a copy of {DEPLOYMENT} with image fleet:2" in note.reason
    assert note.reason.endswith(f"; PodDisruptionBudget {GREEN} (maxUnavailable 1)")
    assert runtime.check_group("chat.green") is None and standin.cluster.requests["POST deployments"] == 1
    assert standin.cluster.requests["POST poddisruptionbudgets"] == 1

    runtime.spawn("chat.green", 1)
    assert replicas(standin, GREEN) == 1 and replicas(standin, BLUE) == 0
    (pod,) = running(runtime, "chat.green", 1)
    assert registered(r)[pod].tier == "chat.green"  # the copy told its worker its group

    write_policy(r, "chat", grouped(runtime="v3"))  # a new version of green: a rollout of its pool
    generation = standin.cluster.deployments[GREEN]["metadata"]["generation"]
    assert runtime.check_group("chat.green") is None
    with standin.cluster.lock:
        made = standin.cluster.deployments[GREEN]
        assert made["spec"]["template"]["spec"]["containers"][0]["image"] == "fleet:3"
        assert made["metadata"]["generation"] == generation + 1 and made["spec"]["replicas"] == 1
    (note,) = runtime.notes()
    assert note.action == "rollout"
    assert "image fleet:2 -> fleet:3: a rollout of pool chat.green" in note.reason
    assert runtime.check_group("chat.green") is None and not runtime.notes()  # in line: nothing more
    assert standin.cluster.requests["PATCH deployments"] == 1


def test_a_group_without_deployment_or_image_is_refused_with_the_reason(standin: StandIn, make_runtime, r):
    write_policy(r, "chat", grouped())
    with standin.cluster.lock:
        standin.cluster.add_deployment(BLUE, "chat", replicas=0, group="blue")
    runtime = make_runtime(group_runtimes=ALLOWED)
    why = ("no Deployment labelled app.kubernetes.io/component=worker,fleet.dev/tier=chat,"
           "fleet.dev/group=green in namespace fleet and the group names no runtime with an image")
    assert runtime.check_group("chat.green") == why and runtime.refusal("chat.green") == why
    with pytest.raises(Refused, match="the group names no runtime with an image"):
        runtime.spawn("chat.green", 1)
    assert runtime.check_group("chat.blue") is None and runtime.refusal("chat.blue") is None
    # another autoscaler on one group's Deployment refuses that pool only
    with standin.cluster.lock:
        standin.cluster.add_autoscaler("hpa", "blue-hpa", BLUE)
    fresh = make_runtime(group_runtimes=ALLOWED)  # (the autoscalers are cached per runtime)
    assert "HorizontalPodAutoscaler blue-hpa targets Deployment fleet-worker-chat-blue" in (
        fresh.refusal("chat.blue") or "")
    assert fresh.check_group("chat.blue") is None and fresh.refusal("chat.green") == why
    # a group naming a Deployment labelled for another pool: refused until its labels are right
    write_policy(r, "chat", grouped(deployment=BLUE))
    assert runtime.check_group("chat.green") == (
        f"Deployment {BLUE}, named by group green of tier chat, is labelled for pool chat.blue: label it "
        "and its pod template app.kubernetes.io/component=worker,fleet.dev/tier=chat,fleet.dev/group=green")
    # the Role without `create` on deployments: the reason says so, and it is not hammered
    write_policy(r, "chat", grouped(runtime="v2"))
    with standin.cluster.lock:
        standin.cluster.forbidden.add("POST deployments")
    assert runtime.check_group("chat.green") == (
        f"writing Deployment {GREEN} failed (HTTP 403 Forbidden): not tried again for 10s")
    assert runtime.check_group("chat.green") is not None and standin.cluster.requests["POST deployments"] == 1
    assert standin.cluster.requests["PATCH scale"] == 0 and GREEN not in standin.cluster.deployments


def test_a_group_deployment_is_made_even_when_its_budget_cannot_be(standin: StandIn, make_runtime, r):
    write_policy(r, "chat", grouped(runtime="v2"))
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
        standin.cluster.add_deployment(BLUE, "chat", replicas=0, group="blue")
        standin.cluster.forbidden.add("POST poddisruptionbudgets")  # a Role of before the budgets
    runtime = make_runtime(group_runtimes=ALLOWED)
    assert runtime.check_group("chat.green") is None and GREEN in standin.cluster.deployments
    assert not standin.cluster.budgets
    (note,) = runtime.notes()
    assert note.action == "deployment-created" and note.reason.endswith(
        "; no PodDisruptionBudget (HTTP 403 Forbidden): a node drain may evict all its pods at once")
    runtime.spawn("chat.green", 1)  # the pool scales all the same
    assert replicas(standin, GREEN) == 1


def test_once_a_group_is_gone_for_good_only_the_deployment_fleet_made_is_deleted(standin: StandIn,
                                                                                  make_runtime, r):
    write_policy(r, "chat", grouped(runtime="v2"))
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
        standin.cluster.add_deployment(BLUE, "chat", replicas=0, group="blue")
    runtime = make_runtime(group_runtimes=ALLOWED)
    assert runtime.check_group("chat.green") is None and GREEN in standin.cluster.budgets
    runtime.notes()
    runtime.spawn("chat.green", 1)
    running(runtime, "chat.green", 1)

    runtime.pool_forgotten("chat.green")  # (the commander drains a pool before it forgets it)
    assert GREEN in standin.cluster.deployments and not runtime.notes()  # it still runs a pod: kept
    runtime.pool_forgotten("chat.blue")
    assert BLUE in standin.cluster.deployments and not runtime.notes()  # yours: kept

    with standin.cluster.lock:
        (pod,) = pods_of(standin, GREEN)
    runtime.retire(pod, "group-removed: test")
    standin.wait_for(lambda c: pod in c.ended, 30, f"green pod {pod} to go")
    runtime.pool_forgotten("chat.green")
    assert GREEN not in standin.cluster.deployments and GREEN not in standin.cluster.budgets
    assert standin.cluster.deleted == [GREEN, GREEN]  # the Deployment, then its budget
    (note,) = runtime.notes()
    assert (note.tier, note.action) == ("chat.green", "deployment-deleted")
    assert note.reason.startswith(f"Deployment {GREEN} and its PodDisruptionBudget deleted")
    runtime.pool_forgotten("chat.green")  # nothing left: nothing more
    assert not runtime.notes() and standin.cluster.deleted == [GREEN, GREEN]


def test_a_delete_the_role_forbids_is_noted_and_the_deployment_stays(standin: StandIn, make_runtime, r):
    write_policy(r, "chat", grouped(runtime="v2"))
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
        standin.cluster.add_deployment(BLUE, "chat", replicas=0, group="blue")
        standin.cluster.forbidden.add("DELETE deployments")
    runtime = make_runtime(group_runtimes=ALLOWED)
    assert runtime.check_group("chat.green") is None
    runtime.notes()
    runtime.pool_forgotten("chat.green")
    (note,) = runtime.notes()
    assert note.action == "deployment-kept" and "(HTTP 403 Forbidden): delete it" in note.reason
    assert GREEN in standin.cluster.deployments and GREEN in standin.cluster.budgets


@pytest.mark.parametrize(("name", "why"), [
    ("miner", "group green of tier chat names runtime 'miner', which this commander does not allow (its "
              "FLEET_COMMANDER_GROUP_RUNTIMES names: v2, v3, venv)"),
    ("venv", "group green of tier chat: runtime 'venv' gives no image (`image`) for the kubernetes runtime"),
])
def test_a_group_naming_a_runtime_without_an_allowed_image_creates_and_patches_nothing(
        standin: StandIn, make_runtime, r, name: str, why: str):
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
        standin.cluster.add_deployment(BLUE, "chat", replicas=0, group="blue")
        standin.cluster.add_deployment(GREEN, "chat", replicas=0, group="green", image="fleet:1")
    write_policy(r, "chat", grouped(runtime=name))
    runtime = make_runtime(group_runtimes=ALLOWED)
    assert runtime.check_group("chat.green") == why and runtime.refusal("chat.green") == why
    with pytest.raises(Refused, match="does not allow|gives no image"):
        runtime.spawn("chat.green", 1)
    assert runtime.check_group("chat.green") == why and not runtime.notes()
    with standin.cluster.lock:  # its Deployment untouched: no image set, not scaled, nothing made
        assert standin.cluster.deployments[GREEN]["spec"]["template"]["spec"]["containers"][0]["image"] == \
            "fleet:1"
    assert standin.cluster.requests["POST deployments"] == standin.cluster.requests["PATCH deployments"] == 0
    assert standin.cluster.requests["PATCH scale"] == 0
    # with no allow-list at all, a runtime name is refused the same way, and nothing is written
    write_policy(r, "chat", grouped(runtime="v2"))
    bare = make_runtime()
    assert "names: none" in (bare.check_group("chat.green") or "")
    assert standin.cluster.requests["PATCH deployments"] == 0


def test_a_groups_deployment_runs_only_the_allowed_image(standin: StandIn, make_runtime, r):
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)
        standin.cluster.add_deployment(BLUE, "chat", replicas=0, group="blue")
    write_policy(r, "chat", grouped(runtime="v2"))
    pinned = "registry.example/fleet@sha256:" + "a" * 64
    runtime = make_runtime(group_runtimes={**ALLOWED, "v2": GroupRuntime(image=pinned)})
    assert runtime.check_group("chat.green") is None
    with standin.cluster.lock:
        images = {c["image"] for d in standin.cluster.deployments.values()
                  for c in d["spec"]["template"]["spec"]["containers"]}
        made = standin.cluster.deployments[GREEN]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert made == pinned
    assert images == {"fleet:1", made}  # the tier's and blue's, and the allowed one: nothing else
