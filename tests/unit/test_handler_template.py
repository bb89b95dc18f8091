"""``fleet handler new NAME``: the names it refuses, and where it will not write.
(tests/integration/test_handler_package.py installs what it writes and serves turns through it.)"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fleet.cli import main


@pytest.mark.parametrize("name, why", [
    ("MyBot", "not a handler name"),  # a policy could never name it
    ("my-bot", "not a handler name"),
    ("x" * 41, "not a handler name"),
    ("class", "keyword"),  # no module can be called that
    ("echo", "exists already"),  # a built-in handler would win over it
    ("json", "importable here already"),  # the package would clash with the module
    ("worker", "importable here already"),  # ... even with Fleet's own
])
def test_a_name_that_cannot_be_a_handler_package_and_module_is_refused(
        name: str, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["handler", "new", name, "--dir", str(tmp_path / "pkg")]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1
    assert not (tmp_path / "pkg").exists()


def test_it_writes_into_a_missing_or_empty_directory_only(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep me")
    assert main(["handler", "new", "mybot", "--dir", str(tmp_path / "full")]) == 2
    assert "nothing was written" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["mine.txt"]
    (tmp_path / "empty").mkdir()
    assert main(["handler", "new", "mybot", "--dir", str(tmp_path / "empty")]) == 0


def test_the_package_registers_the_handler_under_its_name(tmp_path: Path) -> None:
    assert main(["handler", "new", "support_bot", "--dir", str(tmp_path / "support_bot")]) == 0
    project = tomllib.loads((tmp_path / "support_bot" / "pyproject.toml").read_text())
    assert project["project"]["name"] == "support_bot" and project["project"]["version"]
    entry_points = project["project"]["entry-points"]
    assert entry_points["fleet.handlers"] == {"support_bot": "support_bot.handlers:answer"}
    assert project["tool"]["setuptools"]["packages"] == ["support_bot"]
    assert (tmp_path / "support_bot" / "support_bot" / "handlers.py").is_file()
    compile((tmp_path / "support_bot" / "support_bot" / "handlers.py").read_text(), "handlers.py", "exec")
    compile((tmp_path / "support_bot" / "tests" / "test_handlers.py").read_text(), "test_handlers.py", "exec")
