"""Command-line overrides checked one by one before Hydra composes them.

Hydra parses overrides with an ANTLR grammar (about 0.1 ms per list element, recursive in the nesting), so
their total length and nesting are bounded first. Each override is then parsed on its own, so an error names
the override it comes from; ``hydra.*`` overrides are refused (a policy configures lifecycle, not Hydra,
and Hydra would silently ignore most of them in a compose); a config group (``preset=``, ``checkpoint=``)
takes an option name, not a number or null.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lifecycle.errors import PolicyError, PolicyIssue
from lifecycle.policy.roots import ConfigRoot

MAX_OVERRIDE_CHARS = 4096
"""All overrides of one policy together; longer values belong in a policy file."""
MAX_NESTING = 32
"""Brackets ([ and {) open at once in one override."""
MAX_KEY_PARTS = 16
MAX_KEY_CHARS = 255

SYNTAX_HINT = "use key=value, +key=value, ~key or group=option"


def check_overrides(overrides: Sequence[str], roots: Sequence[ConfigRoot]) -> None:
    """Every problem of every override at once, as one PolicyError (nothing when all are fine)."""
    total = sum(len(o) for o in overrides)
    if total > MAX_OVERRIDE_CHARS:
        raise PolicyError.single("<overrides>", f"the overrides are longer than {MAX_OVERRIDE_CHARS} characters "
                                 "together; put long values in a policy file (--config-dir)", total)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    issues = [issue for text in overrides if (issue := _check_one(text, parser, roots)) is not None]
    if issues:
        raise PolicyError(issues)


def key_of(text: str) -> str:
    """The key an override names, without ``+``/``~`` and value: ``+a.b=1`` -> ``a.b``."""
    return text.partition("=")[0].lstrip("+~").split("@")[0] or "<overrides>"


def _check_one(text: str, parser: Any, roots: Sequence[ConfigRoot]) -> PolicyIssue | None:
    key = key_of(text)
    if "\x00" in text:
        return PolicyIssue(key, "contains a NUL character; remove it", text)
    depth = nesting(text)
    if depth > MAX_NESTING:
        return PolicyIssue(key, f"the value nests {depth} brackets deep; the limit is {MAX_NESTING}", text)
    try:
        override = parser.parse_overrides([text])[0]
    except Exception as exc:  # noqa: BLE001 - ANTLR, int() and recursion errors: all a bad override here
        head = str(exc).strip().split("\n")[0]
        if type(exc).__name__ == "OverrideParseException":
            return PolicyIssue(key, f"bad override syntax: {head}; {SYNTAX_HINT}", text)
        return PolicyIssue(key, f"cannot parse the override ({type(exc).__name__}: {head}); {SYNTAX_HINT}", text)
    key = str(override.key_or_group)
    parts = key.replace("/", ".").split(".")
    package = str(override.package or "")
    if parts[0] == "hydra" or package.split(".")[0] == "hydra":
        return PolicyIssue(key, "policies configure lifecycle, not Hydra: `hydra.*` overrides are refused "
                           "(Hydra would ignore them here); drop it and set policy keys (see `lifecycle schema`)",
                           text)
    if len(parts) > MAX_KEY_PARTS or any(len(p) > MAX_KEY_CHARS for p in parts):
        return PolicyIssue(key[:80], f"the key has {len(parts)} parts or a part longer than {MAX_KEY_CHARS} "
                           f"characters; policy keys are a few parts deep (see `lifecycle schema`)", text)
    if not override.is_delete() and is_group(key, roots):
        return _group_issue(key, override.value(), roots)
    return None


def _group_issue(group: str, value: Any, roots: Sequence[ConfigRoot]) -> PolicyIssue | None:
    names = value if isinstance(value, list) else [value]
    if all(isinstance(n, str) for n in names):
        return None  # an unknown option: Hydra's error lists the available ones
    options = ", ".join(group_options(group, roots)) or "(none)"
    return PolicyIssue(group, f"a config group takes the name of one of its options: {options}; to use none, "
                       f"leave it out (or ~{group})", value)


def is_group(key: str, roots: Sequence[ConfigRoot]) -> bool:
    """Whether ``key`` (``preset``, ``a.b`` or ``a/b``) is a config group folder in any root."""
    rel = key.replace(".", "/")
    return any(_is_dir(r.path / rel) for r in roots)


def group_options(group: str, roots: Sequence[ConfigRoot]) -> list[str]:
    """The option names of a config group over the whole search path."""
    rel = group.replace(".", "/")
    names: set[str] = set()
    for root in roots:
        folder = root.path / rel
        if _is_dir(folder):
            names.update(p.stem for p in folder.glob("*.yaml"))
    return sorted(names)


def nesting(text: str) -> int:
    """The deepest bracket nesting of ``text`` outside quotes."""
    depth = deepest = 0
    quote = ""
    escaped = False
    for ch in text:
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(depth - 1, 0)
    return deepest


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False
