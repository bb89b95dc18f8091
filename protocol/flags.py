"""Command-line flags derived from a settings model, so each option is declared once.

Every field of a pydantic(-settings) model is the flag ``--field-name`` (dashes for the
underscores), of its type: an int or a float is parsed by argparse (a bad number is a usage
error), a ``Literal`` gives the choices, a bool is a switch that sets it, a tuple takes a
list of values. Its help is the field's description, with its default and its environment
variable. A field's ``json_schema_extra`` may say more:

- ``"flag"``: another name for the flag (``"--interval"`` for ``interval_s``), or None for
  none (a secret: a command line shows in ``ps``);
- ``"off_flag"``: ``(name, help)`` of a switch that sets the field to None (``--no-metrics``).

A flag that is not given is not in the namespace (``argparse.SUPPRESS``), so the model reads
its environment: flags override the environment, which overrides the defaults.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Iterable
from typing import Any, Literal, NoReturn, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)
_NONE = "__none__"  # what an off_flag stores: the field is None


class Parser(argparse.ArgumentParser):
    """A parser whose usage errors are one line (and exit 2), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], *, skip: Iterable[str] = (),
              required: Iterable[str] = ()) -> None:
    """Add a flag per field of ``model`` to ``parser``, but those in ``skip``; those in
    ``required`` must be given."""
    skip, required = set(skip), set(required)
    prefix = str(model.model_config.get("env_prefix", ""))
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag = extra.get("flag", "--" + name.replace("_", "-"))
        if name in skip or flag is None:
            continue
        options = _options(name, field.annotation)
        need = name in required
        parser.add_argument(str(flag), dest=name, default=argparse.SUPPRESS, required=need,
                            help=_help(field, prefix + name.upper(), need), **options)
        off = extra.get("off_flag")
        if isinstance(off, (list, tuple)):
            parser.add_argument(str(off[0]), dest=name, action="store_const", const=_NONE,
                                default=argparse.SUPPRESS, help=str(off[1]).replace("%", "%%"))


def flag_values(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The fields given as flags in ``args`` (None, from a parser's own default, is not given)."""
    given = {name: getattr(args, name) for name in model.model_fields
             if getattr(args, name, None) is not None}
    return {name: None if value == _NONE else value for name, value in given.items()}


def settings_from_flags(model: type[M], args: argparse.Namespace, prog: str) -> M | None:
    """The settings from the flags and the environment; None, with one line on stderr, if they
    are not valid (the caller exits 2)."""
    try:
        return model(**flag_values(args, model))
    except ValueError as exc:  # pydantic's ValidationError, or pydantic-settings' SettingsError
        errors = getattr(exc, "errors", None)
        if callable(errors):
            err = errors()[0]
            print(f"{prog}: {'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}", file=sys.stderr)
        else:
            print(f"{prog}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return None


def _options(name: str, annotation: Any) -> dict[str, Any]:
    kind = _strip_none(annotation)
    origin = get_origin(kind)
    if origin is Literal:
        return {"choices": list(get_args(kind))}
    if kind is bool:
        return {"action": "store_const", "const": True}
    if origin is tuple:
        item = get_args(kind)[0] if get_args(kind) else str
        return {"nargs": "*", "type": item if item in (int, float) else str, "metavar": name.upper()[:-1]}
    if kind in (int, float):
        return {"type": kind}
    if kind is str:
        return {}
    raise TypeError(f"no flag for {name}: {annotation!r}")  # a new kind of field: say how here


def _strip_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _help(field: FieldInfo, env: str, required: bool) -> str:
    text = field.description or ""
    default = field.default
    if required:
        text += " (required)"
    elif not (default is None or default is False or default in ("", ())) and "default" not in text:
        shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
        text += f" (default: {shown})"
    return f"{text.strip()}; env {env}".lstrip("; ").replace("%", "%%")
