"""The Kubernetes manifests (compose/k8s), rendered by kustomize as `kubectl apply -k` renders
them, checked without a cluster:

- every object of both overlays validates, strictly (an unknown field is an error), against
  the API's JSON schemas that `kubernetes-validate` ships, for the oldest Kubernetes we claim
  and the newest it has;
- the contract with the kubernetes runtime (commander/runtime/kubernetes/): the Role's rules
  exactly, the worker Deployments' names, labels, command, env, ports and probes;
- what must agree across files: a tier's memory limit and its policy's memory_limit_mb, its
  grace period and drain_timeout_s, selectors and the pods they select, Secret references;
- least privilege: each process connects to Redis as its ACL role, from a Secret of its role's
  (no shared URL, no admin's), and the commander's monitor on 0.0.0.0 has its tokens;
- every pod runs as non-root with a read-only root filesystem and no capabilities.

What only a cluster can tell (admission, scheduling, a real rollout) is not checked here.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from commander.runtime.kubernetes.clone import clone_for_group
from commander.runtime.kubernetes.model import deployment_of
from protocol.policy import TurnsPolicy, parse_assignments, updated
from tests.deploy.tools import K8S, OVERLAYS, REDIS_IMAGE, ROOT, by_kind, one, render, render_dir
from tests.k8s.standin_writes import selector_matches

OLDEST = "1.29.0"  # the oldest minor still in the managed clouds' extended support
GRACE_MARGIN_S = 15  # terminationGracePeriodSeconds - drain_timeout_s (compose/k8s/base/worker-chat.yaml)
# production: made by hand (one Redis URL per role; the relay's with the rq components)
USER_SECRETS = {"fleet-redis-commander", "fleet-redis-worker", "fleet-redis-operator", "fleet-redis-admin",
                "fleet-redis-tls", "fleet-monitor-tokens"}
# the ACL role each component's pods connect as (fleet acl), from the Secret fleet-redis-<role>
ROLE_OF = {"commander": "commander", "worker": "worker", "relay": "relay", "policy": "operator"}
TLS_DIR = "/etc/fleet/tls"
WORKLOADS = ("Deployment", "StatefulSet", "Job")

# The runtime's rules, exactly: the calls commander/runtime/kubernetes/api.py makes (its docstring's table)
RUNTIME_RULES = {
    ("apps", "deployments"): {"list", "get", "create", "patch", "delete"},  # list; the rest: groups
    ("apps", "deployments/scale"): {"get", "patch"},
    ("", "pods"): {"list", "patch"},
    ("autoscaling", "horizontalpodautoscalers"): {"list"},
    ("keda.sh", "scaledobjects"): {"list"},
    ("policy", "poddisruptionbudgets"): {"create", "delete"},  # a group's Deployment the runtime made
}


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return {**{overlay: render(overlay) for overlay in OVERLAYS},
            "production+rq": production_with_rq(tmp_path_factory.mktemp("k8s"))}


def production_with_rq(tmp: Path) -> list[dict[str, Any]]:
    """The production overlay with the rq component in, as its comment says to do it."""
    k8s = tmp / "k8s"
    shutil.copytree(K8S, k8s)
    kustomization = k8s / "overlays" / "production" / "kustomization.yaml"
    text = kustomization.read_text()
    commented = "# components:\n#   - ../../components/rq\n#   - ../../components/rq-node\n"
    enabled = text.replace(commented, "components:\n  - ../../components/rq\n  - ../../components/rq-node\n")
    assert enabled != text, "the production overlay no longer carries the rq component's line"
    kustomization.write_text(enabled)
    return render_dir(kustomization.parent)


def version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def workers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in by_kind(objects, "Deployment")
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's env by name; a generated Secret's name without kustomize's hash suffix."""
    env = {e["name"]: copy.deepcopy(e) for e in container.get("env", [])}
    for e in env.values():
        if ref := e.get("valueFrom", {}).get("secretKeyRef"):
            ref["name"] = re.sub(r"-[a-z0-9]{10}$", "", ref["name"])
    return env


def field_ref(path: str) -> dict[str, Any]:
    return {"fieldRef": {"fieldPath": path}}


def redis_url_ref(role: str) -> dict[str, Any]:
    """The REDIS_URL of a process of ``role``: the key ``url`` of its role's Secret."""
    return {"secretKeyRef": {"name": f"fleet-redis-{role}", "key": "url"}}


RQ_URL_REF = {"secretKeyRef": {"name": "fleet-rq", "key": "RQ_URL"}}


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi)", quantity)
    assert m, f"memory {quantity!r}: write it in Ki, Mi or Gi"
    return float(m[1]) * units[m[2]]


def fleet_image(overlay: str) -> str:
    return {"demo": "fleet", "production": "registry.example.com/fleet", "canary": "fleet"}[overlay] \
        + f":{version()}"


# the worker Deployments of each overlay: (tier, group) -> name
WORKER_DEPLOYMENTS = {
    "demo": {("chat", ""): "fleet-worker-chat", ("writeback", ""): "fleet-worker-writeback"},
    "production": {("chat", ""): "fleet-worker-chat"},
    "canary": {("chat", "blue"): "fleet-worker-chat-blue", ("chat", "green"): "fleet-worker-chat-green",
               ("writeback", ""): "fleet-worker-writeback"},
}


# --- schemas ------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", [*OVERLAYS, "production+rq"])
def test_every_object_validates_against_the_kubernetes_schemas(
        manifests: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    errors = []
    for k8s in (OLDEST, latest_version()):
        for obj in manifests[overlay]:
            name = f"{obj['kind']}/{obj['metadata']['name']} ({k8s})"
            try:
                kubernetes_validate.validate(obj, k8s, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{name}: {'.'.join(map(str, exc.path))}: {exc.message}")
            except SchemaNotFoundError as exc:  # a CRD: it would go unchecked, so none is used
                errors.append(f"{name}: {exc.message}")
    assert not errors, "\n".join(errors)


def test_the_validator_rejects_what_an_api_server_would(manifests: dict[str, list[dict[str, Any]]]) -> None:
    """A control: the schema check is strict and looks inside pod templates."""
    deployment = workers(manifests["demo"])[0]
    typo = {**deployment, "spec": {**deployment["spec"], "terminationGracePeriod": 45}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, OLDEST, strict=True)
    bad_port = copy.deepcopy(deployment)
    pod_spec(bad_port)["containers"][0]["ports"] = [{"name": "health", "containerPort": "x"}]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad_port, OLDEST, strict=True)


# --- RBAC ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_role_grants_exactly_what_the_runtime_uses(
        manifests: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = manifests[overlay]
    role = one(objects, "Role", "fleet-commander")
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == RUNTIME_RULES
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    binding = one(objects, "RoleBinding", "fleet-commander")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "fleet-commander"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleet-commander",
                                    "namespace": binding["metadata"]["namespace"]}]
    one(objects, "ServiceAccount", "fleet-commander")
    for workload in (o for kind in WORKLOADS for o in by_kind(objects, kind)):
        spec = pod_spec(workload)
        if workload["metadata"]["name"] == "fleet-commander":
            assert spec["serviceAccountName"] == "fleet-commander"
        else:  # nothing else talks to the API server
            assert spec.get("automountServiceAccountToken") is False, workload["metadata"]["name"]


def test_an_overlay_can_move_fleet_to_another_namespace(tmp_path: Path) -> None:
    """`namespace:` in an overlay of an overlay moves everything, the RoleBinding's subject and
    the Namespace object included (the base names no namespace it would have to follow)."""
    demo = os.path.relpath(K8S / "overlays" / "demo", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{demo}]\nnamespace: chat-prod\n")
    objects = render_dir(tmp_path)
    assert one(objects, "Namespace", "chat-prod")
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "chat-prod", obj["metadata"]["name"]
    (subject,) = one(objects, "RoleBinding", "fleet-commander")["subjects"]
    assert subject["namespace"] == "chat-prod"


# --- the commander ------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_commander_runs_two_replicas_with_the_kubernetes_runtime(
        manifests: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    commander = one(manifests[overlay], "Deployment", "fleet-commander")
    assert commander["spec"]["replicas"] == 2
    assert commander["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (c,) = pod_spec(commander)["containers"]
    assert c["command"] == ["fleet", "commander"]
    assert c["image"] == fleet_image(overlay)
    env = env_of(c)
    assert env["FLEET_COMMANDER_RUNTIME"]["value"] == "kubernetes"
    assert env["FLEET_COMMANDER_K8S_NAMESPACE"]["valueFrom"] == field_ref("metadata.namespace")
    assert env["REDIS_URL"]["valueFrom"] == redis_url_ref("commander")
    # every interface, so both tokens, from their Secret (the commander refuses 0.0.0.0 without one)
    assert env["FLEET_COMMANDER_METRICS_HOST"]["value"] == "0.0.0.0"
    tokens = (("FLEET_COMMANDER_OPERATOR_TOKEN", "operator"), ("FLEET_COMMANDER_METRICS_TOKEN", "read"))
    for name, key in tokens:
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "fleet-monitor-tokens", "key": key}, name
    port = int(env["FLEET_COMMANDER_METRICS_PORT"]["value"])
    assert c["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
    for probe in (c["readinessProbe"], c["livenessProbe"]):  # a token guards /healthz too: the probe sends it
        assert "httpGet" not in probe
        assert "/healthz" in probe["exec"]["command"][-1]
        assert "FLEET_COMMANDER_METRICS_TOKEN" in probe["exec"]["command"][-1]
    service = one(manifests[overlay], "Service", "fleet-commander")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "metrics", "port": port, "targetPort": "metrics",
                                         "protocol": "TCP"}]
    assert one(manifests[overlay], "PodDisruptionBudget", "fleet-commander")["spec"]["minAvailable"] == 1


# --- the workers --------------------------------------------------------------------------

def runs_rq(deployment: dict[str, Any]) -> bool:
    """Whether the worker Deployment is an rq tier's (its pods run `fleet rq-worker`)."""
    (c,) = pod_spec(deployment)["containers"]
    return bool(c["command"][:2] == ["fleet", "rq-worker"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_deployments_follow_the_runtime_contract(
        manifests: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    deployments = workers(manifests[overlay])
    found = {(d["metadata"]["labels"]["fleet.dev/tier"], d["metadata"]["labels"].get("fleet.dev/group", "")):
             d["metadata"]["name"] for d in deployments}
    assert found == WORKER_DEPLOYMENTS[overlay] and len(deployments) == len(found)
    rq = ["fleet-worker-writeback"] if overlay != "production" else []  # RQ needs one Redis node: the demo's
    assert [d["metadata"]["name"] for d in deployments if runs_rq(d)] == rq
    for d in deployments:
        tier = d["metadata"]["labels"]["fleet.dev/tier"]
        group = d["metadata"]["labels"].get("fleet.dev/group")
        labels = {"app.kubernetes.io/name": "fleet", "app.kubernetes.io/component": "worker",
                  "fleet.dev/tier": tier, **({"fleet.dev/group": group} if group else {})}
        pool = f"{tier}-{group}" if group else tier
        assert d["metadata"]["name"] == "fleet-worker-" + pool.replace("_", "-")
        assert labels.items() <= d["metadata"]["labels"].items()
        assert labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        read = deployment_of(d)  # as the runtime reads it: its pool, and pods it will count
        assert read is not None and read.tier == (f"{tier}.{group}" if group else tier)
        assert not read.stray_template
        assert d["spec"]["selector"] == {"matchLabels": labels}
        assert "replicas" not in d["spec"], "the commander is the single writer of the count"
        (c,) = pod_spec(d)["containers"]  # one: a patch naming a container must not add one
        assert c["name"] == "worker"  # the name production's TLS patch and group copies look for
        assert c["image"] == fleet_image(overlay)
        env = env_of(c)
        assert env.get("FLEET_WORKER_GROUP", {}).get("value") == group  # the worker's pool: <tier>.<group>
        assert env["FLEET_WORKER_POD_NAME"]["valueFrom"] == field_ref("metadata.name")
        assert env["REDIS_URL"]["valueFrom"] == redis_url_ref("worker")
        pdb = one(manifests[overlay], "PodDisruptionBudget", d["metadata"]["name"])
        # a tier's budget leaves out the groups' pods (each group's Deployment has its own budget)
        no_group = [{"key": "fleet.dev/group", "operator": "DoesNotExist"}]
        apart = {} if group else {"matchExpressions": no_group}
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": labels, **apart}}
        if runs_rq(d):  # its RQ worker is named after the pod; no port, no probe: Ready while it runs
            assert c["command"][:3] == ["fleet", "rq-worker", "--queues"] and len(c["command"]) == 4
            assert set(env) == {"REDIS_URL", "FLEET_WORKER_POD_NAME"}  # RQ's node: Fleet's Redis
            assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe"} & set(c)
            continue
        assert c["command"] == ["fleet", "worker", "--tier", tier]
        assert env["FLEET_WORKER_NODE_NAME"]["valueFrom"] == field_ref("spec.nodeName")
        assert env["FLEET_WORKER_HEALTH_PORT"]["value"] == "8081"
        assert c["ports"] == [{"name": "health", "containerPort": 8081, "protocol": "TCP"}]
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "health"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_tiers_pods_and_its_policy_agree_on_memory_and_time(
        manifests: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """The policy Job writes memory_limit_mb and drain_timeout_s; the pods must match them:
    limit = request = memory_limit_mb MiB, grace = drain_timeout_s + the margin. An rq tier's
    Job writes kind=rq and drain_timeout_s (its grace is a warm shutdown's: the longest job's),
    and its pods consume the queues its policy names."""
    for d in workers(manifests[overlay]):
        tier = d["metadata"]["labels"]["fleet.dev/tier"]
        job = one(manifests[overlay], "Job", "fleet-policy-" + tier.replace("_", "-"))
        (setter,) = pod_spec(job)["containers"]
        assert setter["command"][:4] == ["fleet", "policy", "set", tier]
        assert setter["image"] == fleet_image(overlay)
        changes = parse_assignments(setter["command"][4:])
        policy = updated(TurnsPolicy(), changes)  # a valid policy, as `fleet policy set` checks it
        (c,) = pod_spec(d)["containers"]
        resources = c["resources"]
        if runs_rq(d):
            assert set(changes) == {"kind", "drain_timeout_s"} and policy.kind == "rq"
            assert c["command"][3] == ",".join(policy.rq_queues(tier))
            assert resources["limits"]["memory"] == resources["requests"]["memory"]
        else:
            assert set(changes) == {"memory_limit_mb", "drain_timeout_s"} and policy.kind == "turns"
            limit_mb = policy.scale_rules().scaling.occupancy.memory_limit_mb
            assert limit_mb is not None
            assert mebibytes(resources["limits"]["memory"]) == limit_mb
            assert mebibytes(resources["requests"]["memory"]) == limit_mb
        grace = pod_spec(d)["terminationGracePeriodSeconds"]
        assert grace == policy.controls.drain_timeout_s + GRACE_MARGIN_S
        # and a tier left at the default drains too
        assert grace >= TurnsPolicy().controls.drain_timeout_s + GRACE_MARGIN_S
        assert job["spec"]["ttlSecondsAfterFinished"] == 0, "deleted once done: the next apply runs it again"


# --- every pod ----------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_locked_down_with_resources(
        manifests: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    namespace = one(manifests[overlay], "Namespace", "fleet")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    pods = [o for kind in WORKLOADS for o in by_kind(manifests[overlay], kind)]
    assert pods
    for workload in pods:
        name = f"{workload['kind']}/{workload['metadata']['name']}"
        assert workload["metadata"].get("namespace") == "fleet", name
        security = pod_spec(workload)["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] > 0, name
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in containers(workload):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), name
            assert "memory" in c["resources"]["limits"], name
            assert not c["image"].endswith(":latest") and ":" in c["image"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_select_their_pods(manifests: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = manifests[overlay]
    pods = [o for kind in WORKLOADS for o in by_kind(objects, kind)]

    def selected(match: dict[str, str]) -> list[dict[str, Any]]:
        return [o for o in pods if match.items() <= o["spec"]["template"]["metadata"]["labels"].items()]

    for kind in ("Deployment", "StatefulSet"):
        for o in by_kind(objects, kind):
            assert selected(o["spec"]["selector"]["matchLabels"]) == [o], o["metadata"]["name"]
    budgets = by_kind(objects, "PodDisruptionBudget")
    for pdb in budgets:
        assert len(selected(pdb["spec"]["selector"]["matchLabels"])) == 1, pdb["metadata"]["name"]
    # a pod of a group's Deployment the runtime copies from a tier's (its labels plus the group
    # label) is under no budget of the manifests: only its own, made with it
    for d in workers(objects):
        copied = {**d["spec"]["template"]["metadata"]["labels"], "fleet.dev/group": "canary"}
        over = [b["metadata"]["name"] for b in budgets if selector_matches(b["spec"]["selector"], copied)]
        assert not over, (d["metadata"]["name"], over)
    for service in by_kind(objects, "Service"):
        name = service["metadata"]["name"]
        (target,) = selected(service["spec"]["selector"])
        ports = {p["name"] for c in containers(target) for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, name


# --- Redis and its secrets ----------------------------------------------------------------

def secret_refs(workload: dict[str, Any]) -> set[tuple[str, str | None]]:
    """(secret, key) for every secretKeyRef of the pod, (secret, None) for every secret volume."""
    refs: set[tuple[str, str | None]] = set()
    for c in containers(workload):
        for e in c.get("env", []):
            if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                refs.add((ref["name"], ref["key"]))
    for v in pod_spec(workload).get("volumes", []):
        if "secret" in v:
            refs.add((v["secret"]["secretName"], None))
    return refs


def test_the_demo_wires_its_own_redis(manifests: dict[str, list[dict[str, Any]]]) -> None:
    objects = manifests["demo"]
    redis = one(objects, "StatefulSet", "redis")
    (c,) = pod_spec(redis)["containers"]
    args = " ".join(c["args"])
    assert "--appendonly yes" in args and "--appendfsync always" in args
    assert c["image"] == REDIS_IMAGE
    assert [t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]] == ["data"]
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    assert c["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    service = one(objects, "Service", "redis")
    assert service["spec"]["ports"][0]["port"] == 6379
    # every secret a pod names is rendered, with the key it reads; the URL names the Service
    secrets = {s["metadata"]["name"]: s for s in by_kind(objects, "Secret")}
    for workload in (o for kind in WORKLOADS for o in by_kind(objects, kind)):
        for name, key in secret_refs(workload):
            assert name in secrets, f"{workload['metadata']['name']} names Secret {name}"
            assert key is None or key in secrets[name]["data"]
    by_base = {re.sub(r"-[a-z0-9]{10}$", "", name): s for name, s in secrets.items()}  # (generated)
    assert set(by_base) == {"fleet-redis-acl", "fleet-monitor-tokens", "fleet-redis-admin",
                            *(f"fleet-redis-{role}" for role in ROLE_OF.values())}
    passwords = {k: base64.b64decode(v).decode() for k, v in by_base["fleet-redis-acl"]["data"].items()}
    admin = urlsplit(base64.b64decode(by_base["fleet-redis-admin"]["data"]["url"]).decode())
    assert (admin.username, admin.password) == ("default", passwords["FLEET_ACL_PASSWORD_ADMIN"])
    for role in ROLE_OF.values():  # each URL: its role's user and the password the ACL file has for it
        url = urlsplit(base64.b64decode(by_base[f"fleet-redis-{role}"]["data"]["url"]).decode())
        assert (url.username, url.hostname, url.port) == (f"fleet-{role}", "redis", 6379), role
        assert url.password == passwords[f"FLEET_ACL_PASSWORD_{role.upper()}"], role
    # Redis runs with the ACL file `fleet acl` writes before it starts, from those passwords
    assert "--aclfile /acl/users.acl" in args
    (acl,) = pod_spec(redis)["initContainers"]
    assert acl["image"] == fleet_image("demo")
    assert acl["command"] == ["fleet", "acl", "--out", "/acl/users.acl"]
    assert [ref["secretRef"]["name"] for ref in acl["envFrom"]] == [
        next(n for n in secrets if n.startswith("fleet-redis-acl-"))]
    assert {"name": "acl", "mountPath": "/acl", "readOnly": True} in c["volumeMounts"]
    assert set(passwords) == {f"FLEET_ACL_PASSWORD_{r}" for r in ("CLIENT", "WORKER", "COMMANDER", "RELAY",
                                                                 "OPERATOR", "ADMIN")}
    policy = one(objects, "NetworkPolicy", "redis")
    assert policy["spec"]["podSelector"]["matchLabels"] == service["spec"]["selector"]
    # every Fleet pod may reach it: the relay of deferred jobs too
    (rule,) = policy["spec"]["ingress"][0]["from"]
    (admitted,) = rule["podSelector"]["matchExpressions"]
    components = {o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                  for kind in WORKLOADS for o in by_kind(objects, kind) if o["metadata"]["name"] != "redis"}
    assert components == {"commander", "worker", "policy", "relay"} and components <= set(admitted["values"])


@pytest.mark.parametrize("overlay", [*OVERLAYS, "production+rq"])
def test_each_process_connects_as_its_role_from_a_secret_of_its_own(
        manifests: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """No shared URL: a worker's Secret holds no commander's or operator's password, and the
    copies the commander makes of a worker Deployment (a group's) keep the worker's. No Fleet
    process gets the admin's password but the policy Job's `fleet install` (its init container)."""
    fleet_pods = [o for kind in WORKLOADS for o in by_kind(manifests[overlay], kind)
                  if o["metadata"]["labels"]["app.kubernetes.io/component"] != "redis"]
    seen, installs = set(), set()
    for workload in fleet_pods:
        name = workload["metadata"]["name"]
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        for c in containers(workload):
            env = env_of(c)
            if c["name"] == "install":  # loading Fleet's functions: the admin's, in the policy Job alone
                assert component == "policy" and c["command"] == ["fleet", "install"], name
                assert env["REDIS_URL"]["valueFrom"] == redis_url_ref("admin"), name
                installs.add(name)
                continue
            assert env["REDIS_URL"]["valueFrom"] == redis_url_ref(ROLE_OF[component]), name
            assert not any(var.startswith("FLEET_ACL_PASSWORD") for var in env), name
            seen.add(component)
    assert {"commander", "worker", "policy"} <= seen and installs
    for d in workers(manifests[overlay]):  # a group's copy, as the commander makes it
        copied = clone_for_group(d, "chat.copy", "fleet:other", "fleet-worker-chat-copy")
        (c,) = pod_spec(copied)["containers"]
        assert env_of(c)["REDIS_URL"]["valueFrom"] == redis_url_ref("worker"), d["metadata"]["name"]
    shared = [s["metadata"]["name"] for s in by_kind(manifests[overlay], "Secret")
              if re.sub(r"-[a-z0-9]{10}$", "", s["metadata"]["name"]) == "fleet-redis"]
    assert not shared, "one REDIS_URL for every process"


def test_the_demo_runs_a_relay_and_production_none(manifests: dict[str, list[dict[str, Any]]]) -> None:
    """RQ needs one Redis node: the demo's is one; production's may be a Cluster."""
    relay = one(manifests["demo"], "Deployment", "fleet-relay")
    (c,) = containers(relay)
    assert c["command"] == ["fleet", "relay"] and relay["spec"]["replicas"] == 1
    assert c["livenessProbe"]["exec"]["command"][:3] == ["fleet", "relay", "--check"]  # its heartbeat
    assert not pod_spec(relay)["automountServiceAccountToken"] and not c.get("ports")
    names = [o["metadata"]["name"] for o in by_kind(manifests["production"], "Deployment")]
    assert "fleet-relay" not in names


def test_production_runs_rq_tiers_with_the_component_on_a_node_of_their_own(
        manifests: dict[str, list[dict[str, Any]]]) -> None:
    """With components/rq and rq-node in, production gets the relay and the rq tier `writeback`;
    they, and the commander, find RQ's node in the Secret fleet-rq (RQ_URL), apart from Fleet's Redis."""
    objects = manifests["production+rq"]
    relay, writeback, commander = (one(objects, "Deployment", name) for name in
                                   ("fleet-relay", "fleet-worker-writeback", "fleet-commander"))
    assert runs_rq(writeback) and [d["metadata"]["name"] for d in workers(objects) if runs_rq(d)] == [
        "fleet-worker-writeback"]
    for workload in (relay, writeback, commander):
        (c,) = containers(workload)
        env = env_of(c)
        assert env["FLEET_RQ_URL"]["valueFrom"] == RQ_URL_REF, workload["metadata"]["name"]
        if workload is not commander:  # Fleet's own Redis too, as their roles
            role = "relay" if workload is relay else "worker"
            assert env["REDIS_URL"]["valueFrom"] == redis_url_ref(role)
    assert one(objects, "Job", "fleet-policy-writeback")  # it makes writeback an rq tier


@pytest.mark.parametrize("overlay", ["production", "production+rq"])
def test_production_commits_no_secret_and_mounts_tls_everywhere(
        manifests: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = manifests[overlay]
    assert not by_kind(objects, "Secret"), "production Secrets are made by hand, never committed"
    fleet_pods = [o for kind in WORKLOADS for o in by_kind(objects, kind)]
    rq = {"fleet-rq", "fleet-redis-relay"} if overlay.endswith("+rq") else set()  # RQ's node; the relay
    assert {name for o in fleet_pods for name, _ in secret_refs(o)} == USER_SECRETS | rq
    for workload in fleet_pods:
        name = workload["metadata"]["name"]
        assert ("fleet-redis-tls", None) in secret_refs(workload), name
        for c in pod_spec(workload)["containers"]:
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            assert mounts[TLS_DIR]["readOnly"] is True, name
            assert env_of(c)["FLEET_REDIS_CLUSTER"]["value"] in ("auto", "yes"), name
    # the files the TLS Secret holds are readable by the pods' group only (fsGroup), not by all
    for workload in fleet_pods:
        assert pod_spec(workload)["securityContext"]["fsGroup"] == 10001
        (volume,) = [v for v in pod_spec(workload)["volumes"] if "secret" in v]
        assert volume["secret"]["defaultMode"] == 0o440


def test_base_images_are_named_once_per_overlay() -> None:
    """The version in the image tag is the package's: a release bumps them together."""
    for path in ("base", "overlays/demo", "overlays/production"):
        doc = yaml.safe_load((ROOT / "compose" / "k8s" / path / "kustomization.yaml").read_text())
        (image,) = doc["images"]
        assert image["name"] == "fleet" and image["newTag"] == version(), path
    # the canary names green's build apart (`fleet-green`), so that a new tag moves green alone
    doc = yaml.safe_load((K8S / "overlays" / "canary" / "kustomization.yaml").read_text())
    assert {i["name"]: (i["newName"], i["newTag"]) for i in doc["images"]} == {
        "fleet": ("fleet", version()), "fleet-green": ("fleet", version())}


def test_the_docs_state_the_chat_tiers_numbers(manifests: dict[str, list[dict[str, Any]]]) -> None:
    """The docs' Kubernetes page quotes the chat tier's memory and grace period."""
    readme = (ROOT / "docs" / "guide" / "kubernetes.md").read_text()
    chat = one(manifests["demo"], "Deployment", "fleet-worker-chat")
    limit = pod_spec(chat)["containers"][0]["resources"]["limits"]["memory"]
    assert f"`memory_limit_mb` MiB ({mebibytes(limit):.0f})" in readme
    grace = pod_spec(chat)["terminationGracePeriodSeconds"]
    assert f"`drain_timeout_s` + {GRACE_MARGIN_S} s ({grace})" in readme
