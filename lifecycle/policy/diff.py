"""`lifecycle diff`: the resolved difference between two policies, key path by key path."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from lifecycle.errors import PolicyError
from lifecycle.policy.errors import clip
from lifecycle.policy.load import Loaded, load, to_plain


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT: Any = _Absent()
"""A key one side does not have (e.g. the options of a different train kind)."""


@dataclass(frozen=True)
class Change:
    """One key whose resolved value differs: ``a`` -> ``b`` (either may be :data:`ABSENT`)."""

    path: str
    a: Any
    b: Any

    def __str__(self) -> str:
        return f"{self.path}: {render_value(self.a)} -> {render_value(self.b)}"


def render_value(value: Any) -> str:
    """JSON, compact: ``true``, ``"store"``, ``["barrier", "all_reduce"]``; ``(absent)``."""
    return repr(value) if value is ABSENT else json.dumps(value)


def _descend(value: Any) -> bool:
    """Mappings and lists of mappings are compared item by item; scalars and plain lists as a whole."""
    return isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, dict) for v in value))


def _items(value: Any) -> dict[str, Any]:
    return {str(k): v for k, v in (value.items() if isinstance(value, dict) else enumerate(value))}


def diff_values(a: Any, b: Any, path: str = "") -> list[Change]:
    """Every leaf that differs, in ``a``'s key order then ``b``'s extra keys."""
    if a == b:
        return []
    if a is ABSENT or b is ABSENT or type(a) is not type(b) or not (_descend(a) or _descend(b)):
        return [Change(path, a, b)]
    ia, ib = _items(a), _items(b)
    changes = []
    for key in [*ia, *(k for k in ib if k not in ia)]:
        sub = f"{path}.{key}" if path else key
        changes.extend(diff_values(ia.get(key, ABSENT), ib.get(key, ABSENT), sub))
    return changes


def parse_side(text: str, default_name: str) -> tuple[str, list[str]]:
    """One side of a diff: ``"[CONFIG_NAME] [OVERRIDE ...]"`` -> (config name, overrides).

    A first word without ``=`` that does not start with ``~`` or ``+`` names a config
    (like ``--config-name``); ``""`` is the default policy.
    """
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise PolicyError.single("<diff>", f"cannot split the side into words ({exc}); balance its quotes",
                                 clip(text)) from None
    if words and "=" not in words[0] and words[0][0] not in "~+":
        return words[0], words[1:]
    return default_name, words


@dataclass(frozen=True)
class Diff:
    """Both sides as loaded and their differences."""

    a: Loaded
    b: Loaded
    changes: list[Change]

    def as_dict(self) -> dict[str, Any]:
        side = {"a": self.a, "b": self.b}
        return {
            **{k: {"config_name": s.config_name, "overrides": list(s.overrides), "source": s.source}
               for k, s in side.items()},
            "changes": [{"path": c.path, "a": None if c.a is ABSENT else c.a, "b": None if c.b is ABSENT
                         else c.b, "absent": [s for s, v in (("a", c.a), ("b", c.b)) if v is ABSENT]}
                        for c in self.changes],
        }


def _load_side(label: str, text: str, common: list[str], config_dir: str | None, config_name: str) -> Loaded:
    name, overrides = parse_side(text, config_name)
    try:
        return load([*common, *overrides], config_dir=config_dir, config_name=name)
    except PolicyError as exc:
        raise PolicyError(exc.issues, source=f"{label}: {clip(repr(text))}" + (f", {exc.source}" if exc.source
                                                                                   else "")) from None


def diff(a: str, b: str, common: list[str] | None = None, *, config_dir: str | None = None,
         config_name: str = "config") -> Diff:
    """Compose and validate both sides (``common`` overrides first, then each side's own) and compare."""
    la = _load_side("A", a, list(common or []), config_dir, config_name)
    lb = _load_side("B", b, list(common or []), config_dir, config_name)
    return Diff(la, lb, diff_values(to_plain(la.policy), to_plain(lb.policy)))


def render(d: Diff, a: str, b: str, common: list[str] | None = None) -> str:
    """Human text: one ``key.path: old -> new`` line per difference."""
    both = f"  [both: {' '.join(common)}]" if common else ""
    lines = [f"--- A: {a or '(default policy)'}{both}", f"+++ B: {b or '(default policy)'}{both}"]
    lines += [f"  {c}" for c in d.changes]
    n = len(d.changes)
    lines.append("no differences" if not n else f"{n} key{'s' if n > 1 else ''} differ")
    return "\n".join(lines)
