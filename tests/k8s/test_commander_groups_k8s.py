"""A real ``Commander`` on the ``kubernetes`` runtime with a grouped tier: each group's
pool is a Deployment of its own, scaled on the pool's own demand; a group that names an allowed
runtime gets its Deployment made from a copy of the tier's with that runtime's image; a group
that can have none is rejected (ledgered, weight 0 for assignment) and the other group serves
its users. Pods are real ``fleet worker``
processes on the test's redis-server (the stand-in's kubelet runs no image: the image is only
written, the process is the test's Fleet)."""

from __future__ import annotations

from collections import Counter

import pytest

from commander.group_runtimes import GroupRuntime
from fleet.client import Fleet
from protocol.groups import Group, assign
from protocol.policy import turns_policy
from stores.policies import write_policy
from tests.helpers import ledger, wait_until
from tests.k8s.conftest import DEPLOYMENT, answered_once
from tests.k8s.standin import StandIn
from tests.k8s.test_commander_k8s import FAST, run_commander  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.integration

BLUE, GREEN = "fleet-worker-chat-blue", "fleet-worker-chat-green"


def replicas(standin: StandIn, name: str) -> int:
    with standin.cluster.lock:
        deployment = standin.cluster.deployments.get(name)
        return int(deployment["spec"]["replicas"]) if deployment else -1


def owner(standin: StandIn, pod: str) -> str:
    """The Deployment whose ReplicaSet made ``pod`` (a pod that ended: by its name's prefix)."""
    with standin.cluster.lock:
        return next(name for name in standin.cluster.deployments if pod.startswith(f"{name}-5f7c9d8b6-"))


def test_a_grouped_tier_serves_on_kubernetes_each_pool_following_its_demand(
        standin: StandIn, run_commander, r, redis_server):  # noqa: F811 - the fixture imported above
    groups = (Group(name="blue", weight=90, deployment=BLUE, max_workers=4),
              Group(name="green", weight=10, runtime="v2", max_workers=4))
    write_policy(r, "chat", turns_policy(**FAST, groups=groups))
    with standin.cluster.lock:
        standin.cluster.add_deployment(DEPLOYMENT, "chat", replicas=0)  # the tier's: green's is its copy
        standin.cluster.add_deployment(BLUE, "chat", replicas=0, group="blue")
    run_commander(group_runtimes={"v2": GroupRuntime(image="fleet:2")})  # the commander's allow-list
    wait_until(lambda: replicas(standin, BLUE) == 1 and replicas(standin, GREEN) == 1, 20,
               "each pool at its floor of 1, green's Deployment made")
    # (the pass ledgers the runtime's notes after it acts: the scale may be seen first)
    (made,) = wait_until(lambda: ledger(r, "chat.green", "deployment-created"), 10, "the creation ledgered")
    assert f"Deployment {GREEN} created for group green of tier chat: a copy of {DEPLOYMENT}" in made.reason

    users = [f"b{i:02d}" for i in range(40)]
    weights = (("blue", 90.0), ("green", 10.0))
    with Fleet(redis_server.url) as fleet:
        handles = fleet.submit_many([(u, "burst") for u in users])
        replies = answered_once(r, fleet, handles, timeout=90)
    for user, reply in zip(users, replies, strict=True):  # each user served by its group's pods
        assert owner(standin, reply.worker) == {"blue": BLUE, "green": GREEN}[assign(user, weights)], user
    served = Counter(owner(standin, rep.worker) for rep in replies)
    assert served[BLUE] == 37 and served[GREEN] == 3
    blue_up = max(e.to_count for e in ledger(r, "chat.blue", "scale-up"))
    green_up = max(e.to_count for e in ledger(r, "chat.green", "scale-up"))
    # 37 users' backlog takes blue to its max; green's 3 users never need more than 3 workers (its
    # pressure events and the reception's lower threshold may ask for a third: seen 1 run in 3)
    assert blue_up == 4 and green_up <= 3, (blue_up, green_up)
    assert replicas(standin, DEPLOYMENT) == 0  # the tier's own Deployment only lends its spec

    wait_until(lambda: replicas(standin, BLUE) == 1 and replicas(standin, GREEN) == 1
               and len(standin.cluster.pods) == 2, 60, "quiet: each pool back to its floor")
    assert ledger(r, "chat.blue", "reclaim-idle")
    assert not [e for pool in ("chat", "chat.blue", "chat.green")
                for e in ledger(r, pool, "refused", "group-rejected", "worker-exited")]


def test_a_group_with_no_deployment_and_no_image_is_rejected_and_the_other_serves(
        standin: StandIn, run_commander, r, redis_server):  # noqa: F811 - the fixture imported above
    groups = (Group(name="blue", weight=50, deployment=BLUE), Group(name="green", weight=50))
    write_policy(r, "chat", turns_policy(**FAST, groups=groups))
    with standin.cluster.lock:
        standin.cluster.add_deployment(BLUE, "chat", replicas=0, group="blue")
    run_commander()
    (rejected,) = wait_until(lambda: ledger(r, "chat.green", "group-rejected"), 20, "green rejected")
    assert rejected.reason == (
        "group green of tier chat rejected: no Deployment labelled app.kubernetes.io/component=worker,"
        "fleet.dev/tier=chat,fleet.dev/group=green in namespace fleet and the group names no runtime "
        "with an image; "
        "its users are served by the other groups")
    users = [f"u{i:02d}" for i in range(12)]
    assert sum(assign(u, (("blue", 50.0), ("green", 50.0))) == "green" for u in users) == 7  # green's
    with Fleet(redis_server.url) as fleet:
        replies = answered_once(r, fleet, fleet.submit_many([(u, "hi") for u in users]), timeout=60)
    assert {owner(standin, rep.worker) for rep in replies} == {BLUE}  # blue served green's users too
    assert GREEN not in standin.cluster.deployments and standin.cluster.requests["POST deployments"] == 0
    assert len(ledger(r, "chat.green", "group-rejected")) == 1  # once, not every pass
