"""The docs agree with the code: every fenced block is run or marked, and the names the pages
give (metrics, environment variables, policy fields, RBAC, modules) are ones the code has.

The blocks that need a fleet run in tests/integration/test_docs_snippets.py, the handler example
in tests/integration/test_handler_package.py; here are the checks that need no server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import TypeAdapter

from tests.docs_blocks import ROOT, all_blocks, blocks_of, by_kind, problems

DOCS = ROOT / "docs"
METRIC = re.compile(r"\bfleet_[a-z]+(?:_[a-z]+)*\b")  # a whole name: `fleet_tier_` in a grep is none
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def page(rel: str) -> str:
    return (ROOT / rel).read_text()


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table of a page: (its header cells, its rows' cells)."""
    found: list[list[list[str]]] = []
    previous = False
    for line in text.splitlines():
        row = line.startswith("|")
        if row and not previous:
            found.append([])
        if row:
            found[-1].append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
        previous = row
    return [(t[0], t[2:]) for t in found if len(t) >= 2]


def table_rows(text: str, first_header: str) -> list[list[str]]:
    """The rows of every table of a page whose header begins with ``first_header``."""
    return [row for header, rows in tables(text) if header[0] == first_header for row in rows]


# --- every block is run or marked ---------------------------------------------------------------
def test_every_block_of_the_readme_and_the_docs_is_run_or_marked() -> None:
    assert not problems(all_blocks()), "\n".join(problems(all_blocks()))


def test_an_unmarked_or_badly_marked_block_is_a_problem(tmp_path: Path) -> None:
    text = "\n".join([
        "# page", "", "```bash", "echo unmarked", "```", "",
        "<!-- snippet: skip -->", "```text", "no reason", "```", "",
        "<!-- snippet: checked-by tests/nowhere.py -->", "```yaml", "a: 1", "```", "",
        "<!-- snippet: frobnicate -->", "```bash", "echo", "```", "",
        "<!-- snippet: run -->", "```toml", "a = 1", "```", "",
        "- an item", "", "  ```python", "  print('indented, unmarked')", "  ```", "",
        "<!-- snippet: session -->", "```bash", "fleet up", "```", ""])
    blocks = blocks_of(text, "page.md")
    assert [b.line for b in blocks] == [3, 8, 13, 18, 23, 29, 34]
    assert blocks[5].body == "print('indented, unmarked')\n"
    found = problems(blocks, root=tmp_path)
    assert [p.split(":")[1] for p in found] == ["3", "8", "13", "18", "23", "29"], found
    assert "no `<!-- snippet" in found[0] and "reason" in found[1] and "does not exist" in found[2]
    assert "unknown snippet kind" in found[3] and "must be bash or python" in found[4]


def test_a_same_as_block_must_equal_a_checked_block_of_its_page() -> None:
    readme = blocks_of("<!-- snippet: same-as b.md -->\n```bash\necho a\n```\n", "a.md")
    twin = blocks_of("<!-- snippet: run -->\n```bash\necho a\n```\n", "b.md")
    skipped = blocks_of('<!-- snippet: skip reason="x" -->\n```bash\necho a\n```\n', "b.md")
    other = blocks_of("<!-- snippet: run -->\n```bash\necho b\n```\n", "b.md")
    session = blocks_of("<!-- snippet: session -->\n```bash\nfleet up\n```\n", "c.md")
    assert not problems(readme + twin + session)
    assert "not run or checked" in problems(readme + skipped + session)[0]
    assert "same text" in problems(readme + other + session)[0]


def test_import_blocks_run_alone(tmp_path: Path) -> None:
    """A python block marked `import` runs in a fresh interpreter with no Redis: its imports
    resolve and its definitions (decorators included) run."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("FLEET_")}
    env["PYTHONPATH"] = str(ROOT)
    blocks = by_kind("import")
    assert blocks
    for b in blocks:
        script = tmp_path / "block.py"
        script.write_text(b.body)
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{b.where()}:\n{done.stderr}"


# --- names the pages give are the code's ------------------------------------------------------------
def exported_metrics() -> set[str]:
    from commander.metrics import Metrics

    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def test_the_metrics_and_alerts_pages_name_only_metrics_the_commander_serves() -> None:
    exported = exported_metrics()
    for rel in ("docs/operations/metrics.md", "docs/operations/alerts.md"):
        named = set(METRIC.findall(page(rel)))
        assert named and not named - exported, (rel, sorted(named - exported))
    listed = {name for row in table_rows(page("docs/operations/metrics.md"), "metric")
              for name in re.findall(r"`(fleet_[a-z_]+)`", row[0])}
    assert {"fleet_turns_total", "fleet_turn_latency_seconds", "fleet_tier_backlog"} <= listed


def test_the_alert_rules_parse_and_read_counters_as_rates() -> None:
    (block,) = by_kind("prometheus-rules")
    doc: dict[str, Any] = yaml.safe_load(block.body)
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert rules and all({"alert", "expr", "labels", "annotations"} <= set(r) for r in rules), rules
    exported = exported_metrics()
    for rule in rules:
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        assert set(METRIC.findall(expr)) <= exported, expr
        for counter in re.findall(r"\bfleet_[a-z_]+_total\b", expr):
            assert re.search(rf"(rate|increase)\({counter}\b", expr), f"a counter read raw: {expr}"
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule


def known_environment() -> set[str]:
    """The environment variables Fleet reads: its settings' fields under their prefixes, and the
    names its code reads by hand."""
    from commander.settings import CommanderSettings
    from worker.settings import WorkerSettings

    names = {"REDIS_URL"}
    for model in (CommanderSettings, WorkerSettings):
        prefix = model.model_config.get("env_prefix", "")
        names |= {prefix + f.upper() for f in model.model_fields}
    for package in ("protocol", "stores", "worker", "commander", "fleet", "sim"):
        for path in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"\bFLEET_[A-Z0-9_]+\b", path.read_text()))
    return names


def test_every_environment_variable_the_docs_name_is_one_fleet_reads() -> None:
    known = known_environment()
    for p in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        named = set(re.findall(r"\bFLEET_[A-Z0-9_]+\b", p.read_text()))
        assert not named - known, (p.relative_to(ROOT), sorted(named - known))


def policy_fields() -> set[str]:
    """Every field name of the policy and its nested models (any shape: a model or a union)."""
    from protocol.policy import Policy

    names: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            names.update(node.get("properties", {}) if isinstance(node.get("properties"), dict) else ())
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(TypeAdapter(Policy).json_schema())
    return names


@pytest.mark.parametrize("rel, header", [("docs/guide/policy.md", "field"),
                                         ("docs/guide/deferred-jobs.md", "field (rq tiers only)")])
def test_the_policy_tables_name_policy_fields(rel: str, header: str) -> None:
    named = {name for row in table_rows(page(rel), header) for name in re.findall(r"`([a-z_]+)`", row[0])}
    assert len(named) > 3 and not named - policy_fields(), sorted(named - policy_fields())


def test_the_kubernetes_rbac_table_is_the_role() -> None:
    docs = {(row[0].strip("`").strip('"'), row[1].strip("`")): {v.strip("` ") for v in row[2].split(",")}
            for row in table_rows(page("docs/guide/kubernetes.md"), "API group")}
    docs = {(("" if g == '""' else g), r): v for (g, r), v in docs.items()}
    role = next(d for d in yaml.safe_load_all((ROOT / "compose/k8s/base/commander-rbac.yaml").read_text())
                if d and d["kind"] == "Role")
    granted = {(group, resource): set(rule["verbs"])
               for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]}
    assert docs == granted


def test_the_architecture_pages_module_table_names_what_exists() -> None:
    rows = [row for header, rows in tables(page("docs/internals/architecture.md"))
            if header == ["what", "where"] for row in rows]
    named = [p for row in rows for p in re.findall(r"`([^`]+)`", row[1])]
    assert named
    lua = ROOT / "stores" / "lua"
    missing = [p for p in named if not (ROOT / p).exists() and not (lua / p).exists()]
    assert not missing, f"update the table of docs/internals/architecture.md: {missing}"


def test_the_docs_cite_no_issue_hole_or_outside_design_document() -> None:
    pattern = re.compile(r"\b(issue|hole) \d+|DESIGN §|docs/ARCHITECTURE\.md|docs/KUBERNETES\.md", re.I)
    for p in [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "CHANGELOG.md", *DOCS.rglob("*.md")]:
        hits = [line for line in p.read_text().splitlines() if pattern.search(line)]
        assert not hits, (p.relative_to(ROOT), hits)


def test_the_readme_is_a_page() -> None:
    assert len(page("README.md").splitlines()) <= 250
