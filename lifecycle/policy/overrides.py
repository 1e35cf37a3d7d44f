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
_STRUCTURE = frozenset("'\"\\$[]{}(),")
"""Characters with a meaning in Hydra's grammar: a value holding one is left as written."""


def quote_unicode(text: str) -> str:
    """``key=value`` whose plain value holds non-ASCII characters (``run.name=训练``) -> ``key='value'``.

    Hydra's override grammar takes only ASCII in an unquoted value and reports "bad override syntax" for any other
    letter; the quoted value is the same string."""
    key, sep, value = text.partition("=")
    if not sep or value.isascii() or not key.isascii() or _STRUCTURE & set(value):
        return text
    return f"{key}='{value.strip()}'"


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
        override = parser.parse_overrides([quote_unicode(text)])[0]
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
    return _key_issue(key, text, roots, is_delete=override.is_delete())


def _key_issue(key: str, text: str, roots: Sequence[ConfigRoot], *, is_delete: bool) -> PolicyIssue | None:
    """A key the schema does not know: named with the closest keys it does (never Hydra's "use +key" advice,
    which only leads to an unknown-key error)."""
    from lifecycle.policy.kinds import is_schema_path, schema_paths

    dotted = key.replace("/", ".")
    if is_schema_path(dotted) or dotted.split(".")[0] in ("defaults", "_self_") or "_target_" in dotted.split("."):
        return None  # (_target_ has its own error: a policy never names code)
    if dotted.split(".")[0] == "train" and dotted.split(".")[:2] == ["train", "options"]:
        return None  # options of the chosen kind: validated against the kind's model after composing
    if is_delete:
        return None  # ~key of a key the files set but the schema does not know: the schema check names it
    import difflib

    groups = sorted({p.name for r in roots if _is_dir(r.path) for p in r.path.iterdir() if _is_dir(p)})
    known = schema_paths() + [f"{g} (config group: {g}=OPTION)" for g in groups]
    close = [c for c in difflib.get_close_matches(dotted, [k.split(" ")[0] for k in known], n=3, cutoff=0.6)]
    close = [next(k for k in known if k.split(" ")[0] == c) for c in close]
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return PolicyIssue(dotted, f"unknown key; {hint}every key is listed by `lifecycle schema` and in the policy "
                       f"table of docs/policy.md", text.partition("=")[2] or None)


def _group_issue(group: str, value: Any, roots: Sequence[ConfigRoot]) -> PolicyIssue | None:
    names = value if isinstance(value, list) else [value]
    options = group_options(group, roots)
    listed = ", ".join(options) or "(none)"
    if not all(isinstance(n, str) for n in names):
        return PolicyIssue(group, f"a config group takes the name of one of its options: {listed}; to use none, "
                           f"leave it out (or ~{group})", value)
    unknown = [n for n in names if n not in options]
    if not unknown:
        return None
    from lifecycle.policy.packs import unusable_pack_for

    for name in unknown:  # an option only an unusable pack ships: the pack's own error says why
        pack = unusable_pack_for(f"{group.replace('.', '/')}/{name}")
        if pack is not None:
            pack.check(f"{group.replace('.', '/')}/{name}")
    import difflib

    close = [m for n in unknown for m in difflib.get_close_matches(n, options, n=1)]
    hint = f"did you mean {close[0]}? " if close else ""
    return PolicyIssue(group, f"unknown option of config group {group}; {hint}its options are: {listed} (built-in, "
                       f"installed packs and --config-dir); to use none, leave it out", value)


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
