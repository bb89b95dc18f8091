"""``fleet handler new NAME``: a handler package that installs and serves as written.

The package is named NAME, its module ``NAME/handlers.py`` holds the handler ``answer``, and its
``pyproject.toml`` registers it in the ``fleet.handlers`` entry-point group under NAME, the name a
policy then gives (``fleet policy set chat handler=NAME``). A test beside it finds the handler by
that name and calls it as a worker does. Fleet itself is no dependency of the package: it is
installed into the environment the workers run from, where Fleet already is.
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
from pathlib import Path
from typing import Any

from fleet.cli_base import EXIT_USAGE, CliError

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1.0"
description = "The {name} handler for Fleet"
requires-python = ">=3.11"
# no dependency on Fleet: install this into the environment Fleet's workers run from

[project.entry-points."fleet.handlers"]
{name} = "{name}.handlers:answer"

[tool.setuptools]
packages = ["{name}"]
'''

INIT = '''\
"""The {name} handler for Fleet: see handlers.py."""
'''

HANDLERS = '''\
"""The {name} handler: a turn in, a reply out, and what to remember of it."""

from __future__ import annotations

from protocol.models import HandlerResult
from worker.handlers import TurnContext


async def model_call(text: str, history: list[str], facts: list[str], profile: dict[str, str]) -> str:
    """A stand-in for your model: replace it with the real call (an HTTP request, a local model)."""
    return f"you said: {{text}} ({{len(history)}} earlier turns, {{len(facts)}} memories)"


async def answer(ctx: TurnContext) -> HandlerResult:
    """One turn: read the user's context, call the model, say what to write back."""
    history = [entry.text for entry in ctx.pack.session]  # recent turns, oldest first
    facts = [memory.text for memory in ctx.pack.memories]  # the top memories
    text = await model_call(ctx.turn.text, history, facts, ctx.pack.profile)
    return HandlerResult(text=text, memories=[(f"asked: {{ctx.turn.text[:200]}}", 0.6)],
                         profile={{"last_topic": ctx.turn.text[:50]}})
'''

TEST = '''\
"""The {name} handler, found by the name a policy gives and called as a worker calls it."""

import asyncio
import time

from protocol.models import Turn
from stores.turns import ContextPack
from worker import handlers


def test_the_handler_answers_a_turn() -> None:
    handler = handlers.get("{name}")  # the entry point: install the package first (pip install .)
    turn = Turn(turn_id="t1", user="alice", text="hello", ts=time.time())
    ctx = handlers.TurnContext(turn=turn, pack=ContextPack())
    result = asyncio.run(handlers.call(handler, ctx, timeout_s=5.0))
    assert "hello" in result.text
'''


def skeleton(name: str) -> dict[str, str]:
    """The package's files (path relative to its directory -> text)."""
    return {
        "pyproject.toml": PYPROJECT.format(name=name),
        f"{name}/__init__.py": INIT.format(name=name),
        f"{name}/handlers.py": HANDLERS.format(name=name),
        "tests/test_handlers.py": TEST.format(name=name),
    }


def check_name(name: str) -> None:
    """Raise CliError unless ``name`` can be a handler, a package and a module all at once."""
    from protocol.policy import PolicyError, parse_policy
    from worker.handlers import registered_names

    try:
        parse_policy({"handler": name})
    except PolicyError:
        raise CliError(f"{name!r} is not a handler name: 1-40 of a-z 0-9 _, starting with a letter",
                       EXIT_USAGE) from None
    if keyword.iskeyword(name):
        raise CliError(f"{name!r} is a Python keyword: it cannot name a module", EXIT_USAGE)
    if name in registered_names():
        raise CliError(f"a handler named {name!r} exists already (built in, or installed)", EXIT_USAGE)
    if importlib.util.find_spec(name) is not None:
        raise CliError(f"a module named {name!r} is importable here already, and the package would "
                       f"clash with it: pick another name", EXIT_USAGE)


def write_skeleton(name: str, dest: Path) -> list[Path]:
    """Write the package of handler ``name`` into ``dest`` (which must be missing or empty)."""
    check_name(name)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise CliError(f"{dest} exists and is not an empty directory: nothing was written", EXIT_USAGE)
    written = []
    for rel, text in skeleton(name).items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def cmd_handler_new(args: argparse.Namespace) -> int:
    dest = Path(args.dir) if args.dir else Path(args.name)
    for path in write_skeleton(args.name, dest):
        print(path)
    spec = str(dest) if dest.is_absolute() or str(dest).startswith(".") else f"./{dest}"  # not a PyPI name
    print(f"next: pip install {spec}   (into the environment the workers run from), then\n"
          f"      fleet policy set <tier> handler={args.name}")
    return 0


def add_handler_commands(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    """``fleet handler new NAME``."""
    h = sub.add_parser("handler", help="make a handler package")
    hsub = h.add_subparsers(dest="handler_command", required=True, parser_class=parser_class)
    new = hsub.add_parser("new", help="write a handler package skeleton that installs and serves as written",
                          description=__doc__.split("\n\n")[0] if __doc__ else None)
    new.add_argument("name", help="the handler's name, also its package's: 1-40 of a-z 0-9 _, "
                                  "starting with a letter")
    new.add_argument("--dir", default=None, help="where to write it (default: ./NAME; missing or empty)")
    new.set_defaults(func=cmd_handler_new)
