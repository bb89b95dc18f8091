"""The fenced blocks of the README and the docs site, and the marker beside each.

Every fenced block of README.md, SECURITY.md, CHANGELOG.md and docs/**/*.md carries, on the
last non-blank line before its opening fence, a marker that says how it is tested:

``<!-- snippet: session -->``
    the one quick start: run as a bash script in a fresh directory against a fleet it brings up
    and down (tests/integration/test_docs_snippets.py);
``<!-- snippet: run [expect=REGEX] -->``
    a bash or python block run against that fleet, before its ``fleet down``; it must exit 0,
    and its output must match REGEX (``re.M``) when one is given;
``<!-- snippet: import -->``
    a python block run alone, with no Redis: its imports resolve and its definitions run;
``<!-- snippet: file example=NAME path=PATH -->``
    a file of example NAME, which the test of ``EXAMPLES[NAME]`` writes out and builds;
``<!-- snippet: same-as PAGE -->``
    the same text as a block of PAGE, which is itself run or checked;
``<!-- snippet: prometheus-rules -->``
    Prometheus rules: parsed, and every metric they name is one the commander serves;
``<!-- snippet: checked-by PATH [PATH ...] -->``
    what the test files named check (a manifest validated by tests/deploy, an ACL line run by
    the security tests); each must exist;
``<!-- snippet: skip reason="…" -->``
    not runnable, and why.

A block with no marker, or a marker this module does not know, is a problem that fails the
suite (``problems``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("session", "run", "import", "file", "same-as", "prometheus-rules", "checked-by", "skip")
# an example's files are written out and built by this test
EXAMPLES = {"handler": "tests/integration/test_handler_package.py"}
RUNNABLE = {"run": ("bash", "python"), "session": ("bash",), "import": ("python",),
            "prometheus-rules": ("yaml",)}

_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*?)[ \t]*$")
_MARKER = re.compile(r"^<!--\s*snippet:\s*(?P<body>.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text (indent removed), its marker."""

    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    kind: str | None  # None: no marker
    args: tuple[str, ...] = ()
    options: dict[str, str] = field(default_factory=dict)

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """Every page whose blocks are held to a marker: the README, SECURITY.md and CHANGELOG.md,
    then the site's pages in the order of its nav (any page not in the nav after them)."""
    root_pages = [ROOT / name for name in ("README.md", "SECURITY.md", "CHANGELOG.md")]
    docs = ROOT / "docs"
    found = sorted(p for p in docs.rglob("*.md") if "bench-out" not in p.relative_to(docs).parts)
    ordered = [docs / rel for rel in nav_pages() if (docs / rel).exists()]
    return [p for p in root_pages if p.exists()] + ordered + [p for p in found if p not in ordered]


def nav_pages() -> list[str]:
    """The site's pages in the order of mkdocs.yml's nav."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    out: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)

    walk(config.get("nav", []))
    return out


def parse_marker(text: str) -> tuple[str | None, tuple[str, ...], dict[str, str]]:
    """(kind, positional arguments, key=value options) of a marker line, or (None, (), {})."""
    m = _MARKER.match(text.strip())
    if not m:
        return None, (), {}
    try:
        tokens = shlex.split(m["body"])
    except ValueError:
        return "", (), {}  # an unbalanced quote: an unknown kind, reported as such
    if not tokens:
        return "", (), {}
    args = tuple(t for t in tokens[1:] if "=" not in t)
    options = dict(t.split("=", 1) for t in tokens[1:] if "=" in t)
    return tokens[0], args, options


def blocks_of(text: str, page: str) -> list[Block]:
    """The fenced blocks of a Markdown text, each with the marker on its last non-blank line
    before the opening fence (indented blocks too: a block inside a list item)."""
    lines = text.split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), len(lines))
        body = "".join(line[indent:] if line[:indent].strip() == "" else line.lstrip()
                       for line in (f"{x}\n" for x in lines[i + 1:end]))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        kind, args, options = parse_marker(before)
        out.append(Block(page, i + 1, m["info"].split()[0] if m["info"] else "", body, kind, args, options))
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks_of(p.read_text(), str(p.relative_to(ROOT)))]


def problems(blocks: list[Block], root: Path = ROOT) -> list[str]:
    """Why each block is neither run nor explicitly marked as checked or not runnable."""
    found: list[str] = []
    for b in blocks:
        found += [f"{b.where()}: {why}" for why in _problems_of(b, blocks, root)]
    sessions = [b for b in blocks if b.kind == "session"]
    if len(sessions) != 1:
        found.append(f"want exactly one `snippet: session` block, found {len(sessions)}: "
                     f"{[b.where() for b in sessions]}")
    return found


def _problems_of(b: Block, blocks: list[Block], root: Path) -> list[str]:
    if b.kind is None:
        return [f"a ```{b.lang} block with no `<!-- snippet: … -->` marker on the line before it: "
                f"mark it run, import, checked-by, same-as, … or skip with a reason"]
    if b.kind not in KINDS:
        return [f"unknown snippet kind {b.kind!r} (known: {', '.join(KINDS)})"]
    if b.kind in RUNNABLE and b.lang not in RUNNABLE[b.kind]:
        return [f"a `{b.kind}` block must be {' or '.join(RUNNABLE[b.kind])}, not {b.lang!r}"]
    if b.kind == "skip" and not b.options.get("reason", "").strip():
        return ['`skip` needs reason="why it cannot run"']
    if b.kind == "checked-by":
        missing = [p for p in b.args if not (root / p).exists()]
        return (["`checked-by` names no test file"] if not b.args else
                [f"`checked-by` names {p}, which does not exist" for p in missing])
    if b.kind == "file":
        example, path = b.options.get("example"), b.options.get("path")
        if example not in EXAMPLES or not path:
            return [f"`file` needs example=NAME (one of {sorted(EXAMPLES)}) and path=PATH"]
        if not (root / EXAMPLES[example]).exists():
            return [f"example {example!r} is built by {EXAMPLES[example]}, which does not exist"]
    if b.kind == "same-as":
        return _same_as_problems(b, blocks)
    if b.kind == "run" and "expect" in b.options:
        try:
            re.compile(b.options["expect"])
        except re.error as exc:
            return [f"expect= is no regular expression: {exc}"]
    return []


def _same_as_problems(b: Block, blocks: list[Block]) -> list[str]:
    if len(b.args) != 1:
        return ["`same-as` names one page"]
    twins = [o for o in blocks if o.page == b.args[0] and o.body == b.body and o is not b]
    if not twins:
        return [f"no block of {b.args[0]} has the same text"]
    if all(o.kind in (None, "skip", "same-as") for o in twins):
        return [f"its twin in {b.args[0]} is not run or checked itself"]
    return []


def by_kind(kind: str, blocks: list[Block] | None = None) -> list[Block]:
    return [b for b in (all_blocks() if blocks is None else blocks) if b.kind == kind]


def example_files(name: str) -> dict[str, str]:
    """The files of example ``name``: path (as the marker gives it) -> text."""
    files: dict[str, str] = {}
    for b in by_kind("file"):
        if b.options.get("example") == name:
            assert b.options["path"] not in files, f"{b.where()}: {b.options['path']} twice"
            files[b.options["path"]] = b.body
    return files
