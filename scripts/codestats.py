"""How the code base is shaped, measured: the table of a refactor's before and after.

    scripts/codestats            # a table on stdout
    scripts/codestats --json     # the same figures as JSON

It reads the tree it sits in (no git, no network), and runs one turn and one commander pass
in-process against a private redis-server on a free port, with a profiler on, to see which
product files they reach. Every figure is defined here, next to the code that takes it:

- **lines per package**: lines of ``.py`` and ``.lua`` files under each product package;
- **turn path**: the product files whose functions run while one turn is submitted, served and
  its reply read (a client and a worker in one event loop, after a warm-up turn), and the
  deepest nesting of product frames seen then ("hops"), of all and of the worker's alone;
- **commander pass**: the same for one pass of the leading commander over one tier;
- **mixin classes**: product classes that inherit from another product class other than
  interfaces (an ABC with abstract methods, a Protocol), models, settings and exceptions;
- **sync/async twins**: a function ``f`` beside ``f_async`` (or ``async_f``) in one module, and
  a class ``X`` beside ``AsyncX``/``SyncX``/``_AsyncX`` in one module with a repeated method body;
- **policy fields**: the policy models' fields (top level: the fields of a tier's policy; all:
  with every nested model); **settings**: fields of every ``BaseSettings`` class;
  **environment variables**: distinct ``FLEET_*`` names in product code, plus the settings'
  prefixed fields;
- **CLI**: subcommands (leaves) and flags of ``fleet``'s parser;
- **docs**: README lines, pages of the docs site;
- **history comments**: product, script and test lines that cite an issue ("issue 12"),
  a hole ("hole 3") or a document that is not in the repository ("DESIGN §").
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PACKAGES = ("protocol", "stores", "worker", "commander", "fleet", "sim")
HISTORY = re.compile(r"\bissues? #?\d+|\bholes? #?\d+|DESIGN\s*§|DESIGN\.md|\bexplorer seeds? \d+",
                     re.IGNORECASE)  # as tests/unit/test_house.py


def product_files(ext: tuple[str, ...] = (".py", ".lua")) -> Iterator[Path]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in ext and "__pycache__" not in path.parts:
                yield path


def lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def lines_per_package() -> dict[str, int]:
    out = {p: 0 for p in PACKAGES}
    for path in product_files():
        out[path.relative_to(ROOT).parts[0]] += lines(path)
    out["scripts"] = sum(lines(p) for p in (ROOT / "scripts").rglob("*.py"))
    out["tests"] = sum(lines(p) for p in (ROOT / "tests").rglob("*.py"))
    return out


# --- classes and twins -------------------------------------------------------------------------
def mixin_classes() -> list[str]:
    """Product classes (defined at a module's top level) that inherit from another product class
    which is not an interface (an ABC with abstract methods, a Protocol), a model, settings or
    an exception: the rule ``tests/unit/test_house.py`` enforces."""
    import importlib
    import inspect
    import typing

    import pydantic
    import pydantic_settings

    def may_be_inherited(base: type) -> bool:
        if getattr(base, "_is_protocol", False) or inspect.isabstract(base) or typing.is_typeddict(base):
            return True
        return issubclass(base, (BaseException, pydantic.BaseModel, pydantic_settings.BaseSettings))

    found = []
    for path in product_files((".py",)):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            module = importlib.import_module(name)
        except ImportError:  # an extra that is not installed
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != name:
                continue
            for base in cls.__bases__:
                if base.__module__.split(".")[0] in PACKAGES and not may_be_inherited(base):
                    found.append(f"{base.__module__}.{base.__qualname__} <- {name}.{cls.__qualname__}")
    return sorted(found)


def _bodies(cls: ast.ClassDef) -> dict[str, int]:
    """method name -> statements in its body (a docstring aside)."""
    out = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) and \
                isinstance(getattr(node.body[0], "value", None), ast.Constant) else node.body
            out[node.name] = sum(1 for _ in ast.walk(ast.Module(body=body, type_ignores=[]))
                                 if isinstance(_, ast.stmt))
    return out


def twins() -> list[str]:
    """Two implementations of one operation: a function ``f`` beside ``f_async`` (or ``async_f``)
    in one module; or a class ``X`` beside ``AsyncX``/``SyncX``/``_AsyncX`` in one module that
    repeats a method body of more than five statements (two thin faces of one core are not
    twins)."""
    pairs = []
    for path in product_files((".py",)):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        scopes: list[list[ast.stmt]] = [tree.body]
        scopes += [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        rel = str(path.relative_to(ROOT))
        for body in scopes:
            names = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for name in sorted(names):
                for twin in (f"{name}_async", f"async_{name}"):
                    if twin in names:
                        pairs.append(f"{rel}:{name}/{twin}")
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        for name in sorted(classes):
            for twin in (f"Async{name}", f"Sync{name}", f"_Async{name.lstrip('_')}"):
                if twin in classes and twin != name:
                    a, b = _bodies(classes[name]), _bodies(classes[twin])
                    if any(a[m] > 5 and b[m] > 5 for m in set(a) & set(b) if m != "__init__"):
                        pairs.append(f"{rel}:{name}/{twin}")
    return pairs


def history_lines() -> dict[str, int]:
    out = {}
    for where, paths in (("product", list(product_files())),
                         ("scripts", list((ROOT / "scripts").rglob("*.py"))),
                         ("tests", list((ROOT / "tests").rglob("*.py")))):
        out[where] = sum(1 for p in paths for line in p.read_text(encoding="utf-8").splitlines()
                         if HISTORY.search(line))
    return out


# --- policy, settings, CLI -------------------------------------------------------------------
def _model_fields(model: Any, seen: set[Any]) -> int:
    from pydantic import BaseModel

    total = 0
    for info in model.model_fields.values():
        total += 1
        for arg in _type_args(info.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel) and arg not in seen:
                seen.add(arg)
                total += _model_fields(arg, seen)
    return total


def _type_args(annotation: Any) -> Iterator[Any]:
    import typing

    yield annotation
    for arg in typing.get_args(annotation):
        yield from _type_args(arg)


def policy_fields() -> dict[str, int]:
    from pydantic import BaseModel

    import protocol.policy as policy

    models = [getattr(policy, name) for name in ("TurnsPolicy", "RqPolicy") if hasattr(policy, name)]
    if not models:
        models = [policy.Policy]
    out = {}
    for model in models:
        assert isinstance(model, type) and issubclass(model, BaseModel)
        out[f"{model.__name__} top-level"] = len(model.model_fields)
        out[f"{model.__name__} with nested"] = _model_fields(model, {model})
    return out


def settings_fields() -> tuple[int, list[str]]:
    import importlib
    import pkgutil

    from pydantic_settings import BaseSettings

    count, names = 0, set()
    for package in PACKAGES:
        for info in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
            with contextlib.suppress(Exception):
                module = importlib.import_module(info.name)
                for value in vars(module).values():
                    if (isinstance(value, type) and issubclass(value, BaseSettings)
                            and value is not BaseSettings and value.__module__ == module.__name__):
                        prefix = str(value.model_config.get("env_prefix", ""))
                        for field in value.model_fields:
                            names.add(f"{prefix}{field}".upper())
                        count += len(value.model_fields)
    return count, sorted(names)


def env_vars(settings_names: list[str]) -> int:
    found = set(settings_names)
    pattern = re.compile(r"\bFLEET_[A-Z][A-Z0-9_]*[A-Z0-9]\b")
    for path in product_files((".py",)):
        found |= {m for m in pattern.findall(path.read_text(encoding="utf-8")) if not m.endswith("_")}
    return len(found)


def cli_shape() -> tuple[int, int]:
    from fleet.cli import build_parser

    leaves, flags = 0, 0

    def walk(parser: argparse.ArgumentParser) -> None:
        nonlocal leaves, flags
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        flags += sum(1 for a in parser._actions
                     if a.option_strings and not isinstance(a, argparse._HelpAction))
        if not subs:
            leaves += 1
        for action in subs:
            for child in dict.fromkeys(action.choices.values()):
                walk(child)

    walk(build_parser())
    return leaves, flags


def docs_shape() -> dict[str, int]:
    docs = ROOT / "docs"
    pages = [p for p in docs.rglob("*.md")] if docs.exists() else []
    return {"README lines": lines(ROOT / "README.md"), "docs pages": len(pages)}


# --- the paths: a turn and a commander pass, traced ------------------------------------------------
class _Tracer:
    """Records the product files whose functions are called, and the deepest product stack (of
    all, and of those whose outermost product frame is the worker's: a turn served)."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.depth = 0
        self.chain: list[str] = []
        self.worker_depth = 0
        self.worker_chain: list[str] = []
        self.worker = str(ROOT / "worker") + os.sep
        self.prefixes = tuple(str(ROOT / p) + os.sep for p in PACKAGES)

    def _product(self, frame: FrameType | None) -> bool:
        return frame is not None and frame.f_code.co_filename.startswith(self.prefixes)

    def __call__(self, frame: FrameType, event: str, _arg: object) -> None:
        if event != "call" or not self._product(frame) or frame.f_code.co_name == "<module>":
            return
        self.files.add(str(Path(frame.f_code.co_filename).relative_to(ROOT)))
        depth, chain, outermost = 0, [], ""
        f: FrameType | None = frame
        while f is not None:
            if self._product(f) and not f.f_code.co_name.startswith("<"):
                depth += 1
                chain.append(f.f_code.co_name)
                outermost = f.f_code.co_filename
            f = f.f_back
        if depth > self.depth:
            self.depth, self.chain = depth, chain[::-1]
        if outermost.startswith(self.worker) and depth > self.worker_depth:
            self.worker_depth, self.worker_chain = depth, chain[::-1]

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        sys.setprofile(self)
        threading.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="codestats-")
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port),
                             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(200):
            with contextlib.suppress(redis.ConnectionError):
                client.ping()
                break
            time.sleep(0.02)
        from stores import functions

        functions.install(client)  # Fleet's functions library, as an admin would (`fleet install`)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def trace_turn(url: str) -> _Tracer:
    from fleet.client import AsyncFleet
    from worker.app import Worker
    from worker.settings import WorkerSettings

    tracer = _Tracer()

    async def main() -> None:
        settings = WorkerSettings(redis_url=url, tier="chat", worker_id="chat-codestats",
                                  reclaim_interval_s=3600,
                                  housekeeping_interval_s=3600, policy_refresh_s=3600)
        worker = Worker(settings)
        task = asyncio.ensure_future(worker.run())
        client = AsyncFleet(url)
        await client.ask("warmup", "hello", timeout=10, create_tier=True)
        with tracer.on():
            await client.ask("alice", "hello", timeout=10)
        worker.drain("done")
        await asyncio.wait_for(task, 20)
        await client.aclose()

    asyncio.run(main())
    return tracer


def trace_pass(url: str) -> _Tracer:
    from commander.__main__ import _runtime
    from commander.commander import Commander
    from commander.settings import CommanderSettings
    from protocol.policy import TurnsPolicy
    from stores.connection import connect_sync
    from stores.policies import write_policy

    r = connect_sync(url)
    write_policy(r, "chat", TurnsPolicy(min_workers=0))
    settings = CommanderSettings(redis_url=url, commander_id="codestats", metrics_port=None)
    runtime = _runtime(settings, url)
    assert runtime is not None
    commander = Commander(r, runtime, settings)
    tracer = _Tracer()
    try:
        assert commander.campaign()
        commander.pass_once(time.time())
        with tracer.on():
            commander.pass_once(time.time())
    finally:
        runtime.close()
        r.close()
    return tracer


def measure() -> dict[str, Any]:
    settings_count, settings_names = settings_fields()
    leaves, flags = cli_shape()
    with redis_server() as url:
        turn = trace_turn(url)
    with redis_server() as url:
        commander_pass = trace_pass(url)
    return {
        "lines": lines_per_package(),
        "turn path": {"files": len(turn.files), "hops": turn.depth, "deepest": turn.chain,
                      "worker hops": turn.worker_depth, "worker deepest": turn.worker_chain,
                      "file list": sorted(turn.files)},
        "commander pass": {"files": len(commander_pass.files), "hops": commander_pass.depth,
                           "deepest": commander_pass.chain, "file list": sorted(commander_pass.files)},
        "mixin classes": mixin_classes(),
        "sync/async twins": twins(),
        "policy fields": policy_fields(),
        "settings fields": settings_count,
        "environment variables": env_vars(settings_names),
        "CLI": {"subcommands": leaves, "flags": flags},
        "docs": docs_shape(),
        "history comment lines": history_lines(),
    }


def table(m: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    for package, n in m["lines"].items():
        rows.append((f"lines: {package}", f"{n:,}"))
    rows.append(("lines: product total", f"{sum(m['lines'][p] for p in PACKAGES):,}"))
    for what in ("turn path", "commander pass"):
        rows.append((f"{what}: files", str(m[what]["files"])))
        rows.append((f"{what}: hops (deepest product stack)", str(m[what]["hops"])))
        if "worker hops" in m[what]:
            rows.append((f"{what}: hops in the worker", str(m[what]["worker hops"])))
    bases = {edge.split(" <- ")[0] for edge in m["mixin classes"]}
    rows.append(("mixin classes (bases inherited from)", str(len(bases))))
    rows.append(("sync/async twin pairs", str(len(m["sync/async twins"]))))
    for name, n in m["policy fields"].items():
        rows.append((f"policy fields: {name}", str(n)))
    rows.append(("settings fields", str(m["settings fields"])))
    rows.append(("environment variables", str(m["environment variables"])))
    rows.append(("CLI subcommands", str(m["CLI"]["subcommands"])))
    rows.append(("CLI flags", str(m["CLI"]["flags"])))
    for name, n in m["docs"].items():
        rows.append((name, str(n)))
    for where, n in m["history comment lines"].items():
        rows.append((f"history comment lines: {where}", str(n)))
    width = max(len(r[0]) for r in rows)
    out = [f"| {'measure'.ljust(width)} | value |", f"|{'-' * (width + 2)}|------:|"]
    out += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/codestats", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON (with the file lists)")
    args = p.parse_args(argv)
    import logging

    logging.disable(logging.CRITICAL)
    m = measure()
    if args.json:
        print(json.dumps(m, indent=2))
    else:
        print(table(m))
        print()
        print("mixins:", ", ".join(m["mixin classes"]) or "none")
        print("twins:", ", ".join(m["sync/async twins"]) or "none")
        print("turn path, deepest:", " -> ".join(m["turn path"]["deepest"]))
        print("turn path, deepest in the worker:", " -> ".join(m["turn path"]["worker deepest"]))
        print("commander pass, deepest:", " -> ".join(m["commander pass"]["deepest"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
