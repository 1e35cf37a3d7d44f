"""Turn pydantic, OmegaConf and Hydra failures into PolicyErrors that name key paths."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from lifecycle.errors import PolicyError, PolicyIssue

_UNION_TAG = re.compile(r"[\[\(<]|^function-|^literal|^union")


def _path(loc: Sequence[int | str], prefix: str) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and _UNION_TAG.search(p))]
    parts = ["async" if p == "async_" else p for p in parts]
    return ".".join([prefix, *parts] if prefix else parts)


def _message(err: Any) -> str:
    msg = str(err["msg"])
    for noise in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(noise)
    if err["type"] == "extra_forbidden":
        msg = "unknown key; check the spelling against `lifecycle schema` or the README's policy table"
    return msg


def issues_from_validation(exc: ValidationError, prefix: str = "") -> list[PolicyIssue]:
    """One issue per error; union branches that a deeper error explains are dropped."""
    issues = []
    for err in exc.errors(include_url=False):
        has_value = err["type"] != "missing"
        issues.append(PolicyIssue(_path(err["loc"], prefix), _message(err),
                                  err.get("input") if has_value else None, has_value))
    paths = {i.path for i in issues}
    keep = [i for i in issues if not any(p.startswith(i.path + ".") for p in paths if i.path)]
    seen: set[tuple[str, str]] = set()
    unique = []
    for issue in keep:
        if (issue.path, issue.message) not in seen:
            seen.add((issue.path, issue.message))
            unique.append(issue)
    return unique


def from_validation(exc: ValidationError, source: str | None, prefix: str = "") -> PolicyError:
    return PolicyError(issues_from_validation(exc, prefix), source=source)


def from_omegaconf(exc: Exception, source: str) -> PolicyError:
    """Interpolation, missing-value and syntax errors carry ``full_key``."""
    key = getattr(exc, "full_key", None) or "<policy>"
    text = str(exc).split("\n")[0]
    name = type(exc).__name__
    if name == "MissingMandatoryValue":
        text = "value is missing (???); set it in the policy or with an override"
    elif "Interpolation" in name:
        text = f"interpolation failed: {text}; check the ${{...}} reference or set the env variable"
    return PolicyError.single(key, text, has_value=False, source=source)


def from_hydra(exc: Exception, source: str, overrides: Sequence[str]) -> PolicyError:
    """Hydra's own errors: a missing config or group option, a bad override, a composition error."""
    name = type(exc).__name__
    text = str(exc).strip().split("\n")
    head = text[0]
    if name == "OverrideParseException":
        bad = _override_in(head, overrides)
        return PolicyError.single(bad or "<overrides>", "bad override syntax: " + head +
                                  "; use key=value, +key=value, ~key or group=option", has_value=False,
                                  source=source)
    if name == "MissingConfigException":
        options = getattr(exc, "options", None)
        hint = f"; available: {', '.join(sorted(options))}" if options else ""
        path = getattr(exc, "config_name", None) or source
        return PolicyError.single(str(path), f"config not found: {head}{hint}", has_value=False,
                                  source=source)
    if name == "ConfigCompositionException":
        bad = _override_in(head + " " + " ".join(text[1:]), overrides)
        return PolicyError.single(bad or "<overrides>", " ".join(t.strip() for t in text),
                                  has_value=False, source=source)
    raise exc


def _override_in(message: str, overrides: Sequence[str]) -> str | None:
    for override in overrides:
        key = override.lstrip("+~").split("=")[0]
        if override in message or (key and f"'{key}'" in message) or (key and key in message):
            return key
    return overrides[0].lstrip("+~").split("=")[0] if len(overrides) == 1 else None
