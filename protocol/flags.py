"""Command-line flags derived from a settings model, so each option is declared once.

The fields a settings model lists in its ``FLAGS`` class variable (every field when it has
none) are the flags ``--field-name`` (dashes for the underscores), of their type: an int or a
float is parsed by argparse (a bad number is a usage error), a ``Literal`` gives the choices, a
bool is a switch that sets it, a tuple takes a list of values. Its help is the field's
description, with its default and its environment variable. A field's ``json_schema_extra``
may say more:

- ``"flag"``: another name for the flag (``"--interval"`` for ``interval_s``), or None for
  none (a secret: a command line shows in ``ps``);
- ``"off_flag"``: ``(name, help)`` of a switch that sets the field to None (``--no-metrics``).

The other fields (tuning) are read from the environment only; docs/reference.md lists them. A
flag that is not given is not in the namespace (``argparse.SUPPRESS``), so the model reads its
environment: flags override the environment, which overrides the defaults.
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


def flag_of(model: type[BaseModel], name: str) -> str | None:
    """The command-line flag of field ``name`` of ``model``; None: environment only."""
    listed = getattr(model, "FLAGS", None)
    if listed is not None and name not in listed:
        return None
    field = model.model_fields[name]
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    flag = extra.get("flag", "--" + name.replace("_", "-"))
    return None if flag is None else str(flag)


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], *, skip: Iterable[str] = (),
              required: Iterable[str] = ()) -> None:
    """Add the flags of ``model`` (``flag_of``) to ``parser``, but those in ``skip``; those in
    ``required`` must be given. The epilog says where the other settings are."""
    skip, required = set(skip), set(required)
    prefix = str(model.model_config.get("env_prefix", ""))
    if getattr(model, "FLAGS", None) is not None and not parser.epilog:
        parser.epilog = (f"Every other setting is an environment variable ({prefix}<SETTING>): "
                         "see docs/reference.md.")
    for name, field in model.model_fields.items():
        flag = flag_of(model, name)
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
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
