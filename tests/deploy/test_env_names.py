"""Every environment variable the deployables set is one that Fleet reads, with a value it
accepts: a misspelled FLEET_COMMANDER_METRICS_PORT would be ignored in silence (pydantic-settings
skips unknown names), and the commander would bind its default address.

The commander's names are CommanderSettings fields under FLEET_COMMANDER_, the workers' are
WorkerSettings fields under FLEET_WORKER_, and the few read elsewhere are listed in OTHER with
the code that reads them. The values are checked by building the settings from them.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stores.connection
import worker.rq.rq_worker
from commander.monitor.access import access_of, refusal
from commander.settings import CommanderSettings
from tests.deploy.tools import OVERLAYS, compose_config, render
from worker.settings import WorkerSettings

# name -> the module that reads it (checked: the name is in that module's source)
OTHER = {"REDIS_URL": stores.connection, "FLEET_REDIS_CLUSTER": stores.connection,
         "FLEET_RQ_URL": worker.rq.rq_worker}  # (the commander's settings take it too: checked below)
# name prefix -> the module that reads the names (checked: the prefix is in its source)
OTHER_PREFIXES = {"FLEET_ACL_PASSWORD_": "stores.roles"}  # a role's password: `fleet acl`, the cli
PREFIXES = {"commander": ("FLEET_COMMANDER_", CommanderSettings),
            "worker": ("FLEET_WORKER_", WorkerSettings)}
# what a fieldRef or a Secret gives at run time, to build the settings with
SAMPLE = {"metadata.name": "fleet-commander-5d9c7b8f6d-x2x9z", "metadata.namespace": "fleet",
          "spec.nodeName": "node-1", "url": "redis://fleet-role:pw@redis:6379/0", "operator": "0" * 48,
          "read": "1" * 48, "RQ_URL": "redis://redis:6379/0"}


def settings_names(prefix: str, model: type[Any]) -> set[str]:
    return {prefix + field.upper() for field in model.model_fields}


def k8s_envs() -> Iterator[tuple[str, str, dict[str, str]]]:
    """(where, component, env) of every container of the rendered overlays, fieldRefs and
    secretKeyRefs replaced by sample values."""
    for overlay in OVERLAYS:
        for obj in render(overlay):
            if obj["kind"] not in ("Deployment", "Job"):
                continue
            component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            for c in obj["spec"]["template"]["spec"]["containers"]:
                env = {}
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {})
                    env[e["name"]] = (e["value"] if "value" in e
                                      else SAMPLE[ref["fieldRef"]["fieldPath"]] if "fieldRef" in ref
                                      else SAMPLE[ref["secretKeyRef"]["key"]])
                yield f"{overlay}: {obj['kind']}/{obj['metadata']['name']}", component, env


def compose_envs() -> Iterator[tuple[str, str, dict[str, str]]]:
    for name, service in compose_config()["services"].items():
        if name != "redis":
            component = name if name in PREFIXES else "cli"
            yield f"compose: {name}", component, {k: str(v) for k, v in service["environment"].items()}


@pytest.fixture(scope="module")
def envs() -> list[tuple[str, str, dict[str, str]]]:
    return [*k8s_envs(), *compose_envs()]


def test_every_name_set_is_read_by_fleet(envs: list[tuple[str, str, dict[str, str]]]) -> None:
    unknown = []
    for where, component, env in envs:
        prefix, model = PREFIXES.get(component, ("", None))
        known = set(OTHER) | (settings_names(prefix, model) if model else set())
        unknown += [f"{where}: {name}" for name in env
                    if name not in known and not name.startswith(tuple(OTHER_PREFIXES))]
    assert not unknown, "set but read by nothing:\n" + "\n".join(unknown)


def test_other_names_are_read_where_they_are_listed() -> None:
    for name, module in OTHER.items():
        assert module.__file__ and name in Path(module.__file__).read_text(), name
    for prefix, module_name in OTHER_PREFIXES.items():
        source = importlib.import_module(module_name).__file__
        assert source and prefix in Path(source).read_text(), prefix


def test_the_values_set_are_valid_settings(envs: list[tuple[str, str, dict[str, str]]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for where, component, env in envs:
        if component not in PREFIXES:
            continue
        prefix, model = PREFIXES[component]
        for name in list(os.environ):
            if name.startswith("FLEET_"):
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        settings = model()  # raises on a value it does not accept
        if component == "commander":
            assert settings.rq_url == env.get("FLEET_RQ_URL"), where  # RQ's node, when rq tiers run
            assert settings.metrics_host == "0.0.0.0", where
            assert settings.metrics_port == 9464, where
            # every interface: the commander would refuse to start without a token
            assert refusal(settings.metrics_host, access_of(settings)) is None, where
            assert settings.operator_token, where
        monkeypatch.undo()
