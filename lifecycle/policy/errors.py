"""Turn pydantic, OmegaConf and Hydra failures into PolicyErrors that name key paths.

Values and messages are cut (:func:`clip`, :func:`clip_error`): an error about a 5 MB value prints
~200 characters of it, never the whole value again.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from lifecycle.errors import PolicyError, PolicyIssue

_UNION_TAG = re.compile(r"[\[\(<]|^function-|^literal|^union")

CLIP_VALUE = 200
"""Characters of a value shown in an error."""
CLIP_MESSAGE = 600
"""Characters of one error message (it may quote an override)."""
MAX_ISSUES = 50
"""Issues printed per error; the rest are counted."""


def clip(text: str, limit: int = CLIP_VALUE) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"


class Clipped:
    """Stands for a value in a :class:`PolicyIssue`: its ``repr`` cut to :data:`CLIP_VALUE` characters."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def clip_value(value: object) -> object:
    """``value`` itself when its repr is short, else a :class:`Clipped` stand-in."""
    if isinstance(value, Clipped | bool | float | type(None)):
        return value
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int of more than 4300 digits, a structure nested too deep
        return Clipped(f"<{type(value).__name__} too large to show>")
    return value if len(text) <= CLIP_VALUE else Clipped(clip(text))


def clip_issue(issue: PolicyIssue) -> PolicyIssue:
    return PolicyIssue(clip(issue.path), clip(issue.message, CLIP_MESSAGE), clip_value(issue.value),
                       issue.has_value)


def clip_error(exc: PolicyError) -> PolicyError:
    """The same error with every path, message and value cut, and at most :data:`MAX_ISSUES` issues."""
    issues = [clip_issue(i) for i in exc.issues[:MAX_ISSUES]]
    if len(exc.issues) > MAX_ISSUES:
        issues.append(PolicyIssue("<policy>", f"... and {len(exc.issues) - MAX_ISSUES} more errors; fix these "
                                  "first", has_value=False))
    return PolicyError(issues, source=clip(exc.source, CLIP_MESSAGE) if exc.source else None)


def _path(loc: Sequence[int | str], prefix: str) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and _UNION_TAG.search(p))]
    parts = ["async" if p == "async_" else p for p in parts]
    return ".".join([prefix, *parts] if prefix else parts)


def _message(err: Any) -> str:
    msg = str(err["msg"])
    for noise in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(noise)
    if err["type"] == "extra_forbidden":
        msg = "unknown key; check the spelling against `lifecycle schema` or the policy table in docs/policy.md"
    elif err["type"] == "finite_number":
        msg = "Input should be a finite number (inf and nan are refused); give a plain number"
    return msg


def issues_from_validation(exc: ValidationError, prefix: str = "") -> list[PolicyIssue]:
    """One issue per error; union branches that a deeper error explains are dropped."""
    issues = []
    errors = exc.errors(include_url=False)
    # A value of a `number | "auto"` key: one error per union member; the literal one only says "or auto".
    tagged = {tuple(e["loc"][:-1]) for e in errors if e["loc"] and _is_union_tag(e["loc"][-1])}
    for err in errors:
        loc = tuple(err["loc"])
        if loc and _is_union_tag(loc[-1]) and loc[:-1] in tagged:
            if err["type"] == "literal_error":
                continue
            loc = loc[:-1]
        has_value = err["type"] != "missing"
        message = _message(err) + (" (or auto)" if tuple(err["loc"])[:-1] in tagged and "auto" in str(
            errors) else "")
        issues.append(PolicyIssue(clip(_path(loc, prefix)), clip(message, CLIP_MESSAGE),
                                  clip_value(err.get("input")) if has_value else None, has_value))
    paths = {i.path for i in issues}
    keep = [i for i in issues if not any(p.startswith(i.path + ".") for p in paths if i.path)]
    seen: set[tuple[str, str]] = set()
    unique = []
    for issue in keep:
        if (issue.path, issue.message) not in seen:
            seen.add((issue.path, issue.message))
            unique.append(issue)
    return unique


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union an error comes from in the location: ``constrained-float``,
    ``literal['auto']``, ``function-after[...]``. Policy keys never contain ``-``, ``[`` or ``'``."""
    return isinstance(part, str) and any(c in part for c in "-['")


def from_validation(exc: ValidationError, source: str | None, prefix: str = "") -> PolicyError:
    return clip_error(PolicyError(issues_from_validation(exc, prefix), source=source))


def from_omegaconf(exc: Exception, source: str) -> PolicyError:
    """Interpolation, missing-value and syntax errors carry ``full_key``."""
    key = clip(str(getattr(exc, "full_key", None) or "<policy>"))
    text = clip(str(exc).split("\n")[0], CLIP_MESSAGE)
    name = type(exc).__name__
    if name == "MissingMandatoryValue":
        text = "value is missing (???); set it in the policy or with an override"
    elif "Interpolation" in name:
        text = f"interpolation failed: {text}; check the ${{...}} reference or set the env variable"
    return PolicyError.single(key, text, has_value=False, source=source)


def from_hydra(exc: Exception, source: str, overrides: Sequence[str]) -> PolicyError:
    """Hydra's own errors: a missing config or group option, a bad override, a composition error."""
    name = type(exc).__name__
    text = [clip(t, CLIP_MESSAGE) for t in str(exc).strip().split("\n")[:20]]
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
        cause = exc.__cause__
        if not head and cause is not None:  # Hydra wrapped an OmegaConf error (a !!binary value...)
            text = [clip(str(cause).strip().split("\n")[0], CLIP_MESSAGE)]
            key = getattr(cause, "full_key", None)
            if key:
                return PolicyError.single(clip(str(key)), f"{text[0]}; fix the value", has_value=False,
                                          source=source)
        bad = _override_in(head + " " + " ".join(text[1:]), overrides)
        what = clip(" ".join(t.strip() for t in text), CLIP_MESSAGE)
        return PolicyError.single(bad or source, f"{what}; fix the override or the file it names",
                                  has_value=False, source=source)
    # Anything else Hydra raised while composing comes from the policy files or overrides it was given.
    bad = _override_in(head, overrides)
    return PolicyError.single(bad or "<policy>", f"cannot compose the policy: {name}: {head}; check the "
                              "overrides and the policy files", has_value=False, source=source)


def _override_in(message: str, overrides: Sequence[str]) -> str | None:
    if not overrides:
        return None
    for override in overrides:
        key = override.lstrip("+~").split("=")[0]
        if override in message or (key and f"'{key}'" in message) or (key and key in message):
            return key
    return overrides[0].lstrip("+~").split("=")[0] if len(overrides) == 1 else None
