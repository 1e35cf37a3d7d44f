"""The policy table of docs/policy.md, generated from the schema (a test keeps the page in sync).

``python -m lifecycle.policy.doc`` prints it; ``python -m lifecycle.policy.doc --write`` rewrites the table
between :data:`BEGIN` and :data:`END` in docs/policy.md, and ``lifecycle.schema.json``.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from lifecycle.policy import registry
from lifecycle.policy.schema import Policy

BEGIN, END = "<!-- policy-table:begin -->", "<!-- policy-table:end -->"
PAGE = Path("docs") / "policy.md"
"""Where the table lives, relative to the source tree's root."""


def _type(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(ann))
    if origin is list:
        return f"list[{_type(typing.get_args(ann)[0])}]"
    if origin is typing.Annotated:
        return _type(typing.get_args(ann)[0])
    if ann is type(None):
        return "null"
    return getattr(ann, "__name__", str(ann))


def _default(info: Any) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value)}`"


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.append(f"| `{key}` | section | | {info.description or ''} |")
            out.extend(rows(ann, key + "."))
            continue
        if key == "train.options":
            out.append(f"| `{key}` | mapping | `{{}}` | {info.description} |")
            for spec in registry.all_specs("train"):
                out.extend(_kind_rows(spec))
            continue
        out.append(f"| `{key}` | {_type(ann)} | {_default(info)} | {info.description or ''} |")
        inner = _inner_model(ann)
        if inner is not None:
            out.extend(rows(inner, key + ("[]." if typing.get_origin(ann) is list else ".")))
    return out


def _inner_model(ann: Any) -> type[BaseModel] | None:
    for arg in typing.get_args(ann):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _kind_rows(spec: registry.HandlerSpec) -> list[str]:
    return [f"| `train.options.{info.alias or n}` ({spec.kind}) | {_type(info.annotation)} | "
            f"{_default(info)} | {info.description or ''} |" for n, info in spec.options.model_fields.items()]


def table() -> str:
    head = ["| key | type / values | default | meaning |", "|---|---|---|---|"]
    return "\n".join([BEGIN, *head, *rows(Policy), END])


def write(root: Path) -> None:
    """Refresh the policy table of docs/policy.md and ``lifecycle.schema.json`` in a source tree."""
    from lifecycle.policy.jsonschema import policy_json_schema

    page = root / PAGE
    text = page.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    page.write_text(text[:start] + table() + text[end:])
    (root / "lifecycle.schema.json").write_text(json.dumps(policy_json_schema(), indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write(Path(__file__).resolve().parents[2])
    else:
        print(table())
