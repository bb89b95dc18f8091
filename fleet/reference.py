"""``python -m fleet.reference > docs/reference.md``: the reference page, made from the code.

Every policy field of each kind (from the models: path, type, default, bounds, description),
where each key of the flat policy layout lives now, every setting of every process (the
settings models, and the options of the processes that have no settings model), and the other
environment variables Fleet reads. ``tests/unit/test_reference.py`` fails when the committed page
differs from a fresh one.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from protocol.flags import flag_of

COMMAND = "python -m fleet.reference > docs/reference.md"

# the environment variables read by hand (not through a settings model), and what they do
ENVIRONMENT: dict[str, tuple[str, str]] = {
    "REDIS_URL": ("every process", "Fleet's Redis: a process given no URL of its own (flag or "
                  "setting) connects here, else to the local fleet `fleet up` started"),
    "FLEET_RQ_URL": ("commander, relay, RQ workers, CLI", "RQ's Redis, one node (rq tiers' queues and "
                     "RQ's worker registry); default: Fleet's own, which must then be one node"),
    "FLEET_REDIS_CLUSTER": ("every process", "`yes`: Fleet's Redis is a Redis Cluster; `no`: one node; "
                            "`auto` (the default): ask the node at connect"),
    "FLEET_HOME": ("CLI", "the local fleet's state directory (`fleet up`); default: the nearest "
                   "`.fleet/` here or above, up to `$HOME`, else `./.fleet`"),
    "EDITOR": ("CLI", "the editor `fleet policy edit` opens (default: vi)"),
    "FLEET_SPAWN_PROOF": ("workers of the process runtime", "set by the commander on every process "
                          "it starts (the secret of its run dir's `spawn-proof`): adoption signals "
                          "only a process that carries it; never set it yourself"),
    "FLEET_LIBRARY_CHECK_S": ("worker, commander, relay", "seconds between two looks of a process "
                              "waiting for Fleet's functions library (`fleet install`); default: 3"),
    "FLEET_ACL_PASSWORD_CLIENT": ("every process, CLI", "the password of ACL role `fleet-client` (and "
                                  "`_WORKER`, `_COMMANDER`, `_RELAY`, `_OPERATOR` of the others): a "
                                  "process or command connects as its role when its password is known "
                                  "(else from `fleet acl`'s passwords file); `fleet acl` uses them"),
    "FLEET_OPENAI_BASE_URL": ("workers running `openai_chat`", "the model server's API root when the "
                              "tier's `handler_options` name no `base_url` (guide/openai.md)"),
    "FLEET_OPENAI_MODEL": ("workers running `openai_chat`", "the model when the options name none"),
    "FLEET_OPENAI_API_KEY": ("workers running `openai_chat`", "the model server's API key (else "
                             "`OPENAI_API_KEY`; never read from a policy or a turn)"),
    "FLEET_ACL_PASSWORD_ADMIN": ("CLI", "the admin's (Redis's default user's) password in the ACL file "
                                 "`fleet acl` and `fleet up` write; default: generated"),
}


# --- rendering a model --------------------------------------------------------------------------
def _cell(text: str) -> str:
    """Text fit for a Markdown table cell: one line, no unescaped pipe, Markdown's code quotes."""
    parts = " ".join(text.split()).replace("|", "\\|").replace("``", "`").split("`")
    for i in range(0, len(parts), 2):  # outside code spans, <tier> is text, not an HTML tag
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _json(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value, default=str)}`"


def _default(info: FieldInfo) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    return _json(info.get_default(call_default_factory=True))


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return defs[ref.rsplit("/", 1)[-1]] if isinstance(ref, str) else node


def _type(node: dict[str, Any], defs: dict[str, Any]) -> str:
    """A JSON schema node as a short type name (``integer or null``, ``list of object``)."""
    if "anyOf" in node:
        return " or ".join(dict.fromkeys(_type(n, defs) for n in node["anyOf"]))
    node = _resolve(node, defs)
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    if "enum" in node:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    kind = node.get("type", "object" if "properties" in node else "any")
    if kind == "array":
        return f"list of {_type(node.get('items', {}), defs)}"
    return str(kind)


_BOUNDS = (("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}"),
           ("exclusiveMaximum", "< {}"), ("maxItems", "at most {} items"),
           ("maxLength", "at most {} characters"))


def _bounds(node: dict[str, Any], defs: dict[str, Any]) -> str:
    found: list[str] = []
    for branch in node.get("anyOf", [node]):
        branch = _resolve(branch, defs) if "$ref" in branch and "properties" not in branch else branch
        found += [text.format(_number(branch[key])) for key, text in _BOUNDS if key in branch]
    found += [text.format(_number(node[key])) for key, text in _BOUNDS if key in node and "anyOf" in node]
    return ", ".join(dict.fromkeys(found))


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _inner(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds (directly, or as the items of a list), and whether in a list."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for arg in typing.get_args(annotation) if union else (annotation,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg, False
        if typing.get_origin(arg) in (tuple, list):
            items = [a for a in typing.get_args(arg) if isinstance(a, type) and issubclass(a, BaseModel)]
            if items:
                return items[0], True
    return None, False


def field_rows(model: type[BaseModel], prefix: str = "") -> Iterator[list[str]]:
    """(path, type, default, bounds, description) of every field of ``model``, and of the models
    its fields hold (a list's items as ``path[].field``), depth first."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        node = schema["properties"][name]
        inner, listed = _inner(info.annotation)
        opened = inner is not None and isinstance(info.get_default(call_default_factory=True), BaseModel)
        default = "the fields below" if opened else _default(info)
        yield [f"`{path}`", _type(node, defs), default, _bounds(node, defs), _cell(info.description or "")]
        if inner is not None:
            yield from field_rows(inner, f"{path}[]." if listed else f"{path}.")


def _table(header: list[str], rows: Iterator[list[str]] | list[list[str]]) -> list[str]:
    return [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}", *(f"| {' | '.join(r)} |" for r in rows)]


# --- the sections -------------------------------------------------------------------------------
def policy_section() -> list[str]:
    from protocol.policy import RqPolicy, TurnsPolicy
    from protocol.policy_legacy import FLAT_KEYS, RQ_ONLY

    lines = ["## Policy", "",
             "A tier's policy is JSON in `fleet:policy:{T}` ([Policies and autoscaling](guide/policy.md)). "
             "It is one of two kinds, told apart by `kind`. `fleet policy set T name=value` takes a "
             "field's dotted path, or its last name where that is unique in the kind (`paused` for "
             "`controls.paused`), or its key in the flat layout below.", ""]
    header = ["field", "type", "default", "bounds", "description"]
    for title, model in (("A turns tier (`kind: turns`, the default)", TurnsPolicy),
                         ("An rq tier (`kind: rq`)", RqPolicy)):
        lines += [f"### {title}", "", _cell(model.__doc__ or ""), "", *_table(header, field_rows(model)), ""]

    def where(path: str | None, key: str, rq: bool) -> str:
        if path is not None:
            return f"`{path}`"
        return "refused unless null" if not rq and key in RQ_ONLY else "dropped"
    rows = [[f"`{key}`", where(turns, key, False), where(rq, key, True)]
            for key, (turns, rq) in FLAT_KEYS.items()]
    lines += ["### The flat layout", "",
              "Policies stored before the kinds have every field at the top level. They are read "
              "through this table (a key with no place in the tier's kind is dropped, as it was "
              "ignored) and written back nested by the next `fleet policy set`.", "",
              *_table(["flat key", "turns tier", "rq tier"], rows), ""]
    return lines


def _settings_rows(model: type[BaseModel]) -> Iterator[list[str]]:
    prefix = str(model.model_config.get("env_prefix", ""))
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        flag = flag_of(model, name)
        flags = [f"`{flag}`"] if flag is not None else ["(environment only)"]
        off = extra.get("off_flag")
        if isinstance(off, (list, tuple)):
            flags.append(f"`{off[0]}`")
        node = schema["properties"][name]
        kind = ", ".join(t for t in (_type(node, defs), _bounds(node, defs)) if t)
        yield [f"`{name}`", f"`{prefix}{name.upper()}`", " ".join(flags), kind, _default(info),
               _cell(info.description or "")]


def _option_rows(add_arguments: Callable[[argparse.ArgumentParser], None]) -> Iterator[list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    for action in parser._actions:
        flag = ", ".join(f"`{s}`" for s in action.option_strings)
        default = "" if action.default in (None, False) else _json(action.default)
        help_text = (action.help or "") % {"default": action.default, "prog": ""} if action.help else ""
        yield [flag, "required" if action.required else default, _cell(help_text)]


def settings_section() -> list[str]:
    from commander.settings import CommanderSettings
    from worker.rq.relay import add_arguments as relay_arguments
    from worker.rq.rq_worker import add_arguments as rq_worker_arguments
    from worker.settings import WorkerSettings

    lines = ["## Settings", "",
             "A process with a settings model reads each setting from its flag, else its "
             "environment variable, else the default.", ""]
    header = ["setting", "environment", "flag", "type", "default", "description"]
    for title, model in (("The commander (`fleet commander`, `python -m commander`)", CommanderSettings),
                         ("A worker (`fleet worker`, `python -m worker`)", WorkerSettings)):
        lines += [f"### {title}", "", _cell(model.__doc__ or ""), "",
                  *_table(header, _settings_rows(model)), ""]
    for title, add in (("The relay (`fleet relay`): options", relay_arguments),
                       ("An RQ worker (`fleet rq-worker`, `python -m worker.rq.rq_worker`): options",
                        rq_worker_arguments)):
        lines += [f"### {title}", "", *_table(["flag", "default", "description"], _option_rows(add)), ""]
    return lines


def environment_section() -> list[str]:
    rows = [[f"`{name}`", read_by, _cell(what)] for name, (read_by, what) in ENVIRONMENT.items()]
    return ["## Other environment variables", "",
            "Read by hand, besides the settings' own (`FLEET_COMMANDER_*`, `FLEET_WORKER_*` above).", "",
            *_table(["variable", "read by", "description"], rows), ""]


def render() -> str:
    """The whole page."""
    head = ["# Reference", "",
            f"<!-- generated by `{COMMAND}`: edit the code's descriptions, not this page -->", "",
            "Every policy field, setting and environment variable of Fleet, made from the code "
            f"(`{COMMAND}`).", ""]
    return "\n".join(head + policy_section() + settings_section() + environment_section()).rstrip() + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
