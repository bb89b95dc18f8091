"""The security page's threat model names the test that proves each row: every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "operations" / "security.md"
# `tests/x.py::test_a`, then `::test_b` for another test of the same file
CITED = re.compile(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`")


def cited_tests(text: str) -> list[tuple[str, str | None]]:
    found: list[tuple[str, str | None]] = []
    current: str | None = None
    for path, name in CITED.findall(text):
        current = path or current
        if current is not None and (path or name):
            found.append((current, name or None))
    return found


def test_every_test_the_threat_model_names_exists() -> None:
    page = PAGE.read_text()
    model = page[page.index("## Threat model"):page.index("## HTTP")]
    cited = cited_tests(model)
    assert len(cited) >= 20, cited
    for path, name in cited:
        source = (ROOT / path).read_text()
        if name is not None:
            defined = re.search(rf"^(async )?def {name}\(", source, re.MULTILINE)
            assert defined, f"{path}::{name}: no such test"


def test_a_name_without_its_file_belongs_to_the_file_before_it() -> None:
    assert cited_tests("`tests/a.py::t1`, `::t2` and `tests/b.py`") == [
        ("tests/a.py", "t1"), ("tests/a.py", "t2"), ("tests/b.py", None)]
