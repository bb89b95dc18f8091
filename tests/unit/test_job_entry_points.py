"""A ``fleet.jobs`` entry point that fails to load makes that job unavailable, with its error;
every other job is still deferrable, and nothing that lists or looks up jobs raises."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import EntryPoint

import pytest

from worker import jobs


@pytest.fixture
def entry_points(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    eps = [EntryPoint("broken", "no_such_module_anywhere:fn", "fleet.jobs"),
           EntryPoint("Bad Name!", "worker.jobs:run", "fleet.jobs"),
           EntryPoint("fine_one", "worker.jobs:run", "fleet.jobs")]
    monkeypatch.setattr(jobs, "entry_points", lambda group: [ep for ep in eps if ep.group == group])
    monkeypatch.setattr(jobs, "_REGISTRY", dict(jobs._REGISTRY))
    monkeypatch.setattr(jobs, "_UNAVAILABLE", {})
    jobs._load_entry_points.cache_clear()
    yield
    jobs._load_entry_points.cache_clear()


@pytest.mark.usefixtures("entry_points")
def test_a_broken_job_entry_point_is_one_job_unavailable() -> None:
    names = jobs.names()
    assert "fine_one" in names and "broken" not in names and "memory_summary" in names
    errors = jobs.unavailable()
    assert set(errors) == {"broken", "Bad Name!"}
    assert "ModuleNotFoundError" in errors["broken"] and "no_such_module_anywhere" in errors["broken"]
    with pytest.raises(KeyError, match="could not be loaded.*ModuleNotFoundError"):
        jobs.get("broken")
    assert jobs.get("fine_one").name == "fine_one"
