"""scripts/bench_shards: the setups it is asked for."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

from bench_shards import Setup, parse_setup  # noqa: E402  (after the path)


@pytest.mark.parametrize(("text", "setup", "describe"), [
    ("node", Setup("node", cluster=False), "one redis-server"),
    ("c1", Setup("c1", cluster=True, masters=1, replicas=1, shards=1),
     "1 master + 1 replica, ready_shards 1"),
    ("c3", Setup("c3", cluster=True, masters=3, replicas=1, shards=3),
     "3 masters + 3 replicas, ready_shards 3"),
    ("c3s1", Setup("c3s1", cluster=True, masters=3, replicas=1, shards=1),
     "3 masters + 3 replicas, ready_shards 1"),
    ("c1r0", Setup("c1r0", cluster=True, masters=1, replicas=0, shards=1),
     "1 master + 0 replicas, ready_shards 1"),
])
def test_parse_setup(text: str, setup: Setup, describe: str) -> None:
    assert parse_setup(text) == setup
    assert setup.describe() == describe


@pytest.mark.parametrize("text", ["", "c", "c0", "c17", "c3r3", "c3s0", "c3s65", "n0de", "c3x"])
def test_parse_setup_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text)):
        parse_setup(text)
