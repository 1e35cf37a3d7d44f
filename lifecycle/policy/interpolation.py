"""A bound on what ``${...}`` interpolations expand to, checked before OmegaConf resolves them.

OmegaConf resolves an interpolation afresh every time it is used, so sixteen lines of ``b: ${a}${a}``,
``c: ${b}${b}``, ... take minutes and gigabytes to resolve (the interpolation twin of a YAML alias bomb).
This walks the unresolved policy once, memoizing each node's cost (characters and resolutions it expands to)
and refuses a policy over the limits with the key path that crosses them.
"""

from __future__ import annotations

import re
from typing import Any

from lifecycle.errors import PolicyError

MAX_RESOLUTIONS = 2_000
"""Interpolations resolved to build the whole policy (each use of a node counts its own again)."""
MAX_CHARS = 1 << 22
"""Characters (and values) of the resolved policy."""

_INNERMOST = re.compile(r"\$\{([^${}]*)\}")
_INDEX = re.compile(r"\[([^\[\]]*)\]")

Path = tuple[str, ...]


class _Walk:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.memo: dict[Path, tuple[int, int]] = {}
        self.active: set[Path] = set()

    def cost(self, path: Path, node: Any) -> tuple[int, int]:
        """(characters, resolutions) that ``node`` at ``path`` expands to."""
        if path in self.memo:
            return self.memo[path]
        if path in self.active:  # a cycle: OmegaConf reports it by name
            return 1, 1
        self.active.add(path)
        if isinstance(node, dict):
            parts = [self.cost((*path, str(k)), v) for k, v in node.items()]
            chars, res = 1 + sum(len(str(k)) + c for k, (c, _) in zip(node, parts, strict=True)), \
                sum(r for _, r in parts)
        elif isinstance(node, list):
            parts = [self.cost((*path, str(i)), v) for i, v in enumerate(node)]
            chars, res = 1 + sum(c for c, _ in parts), sum(r for _, r in parts)
        elif isinstance(node, str) and "${" in node:
            chars, res = len(_INNERMOST.sub("", node)), 0
            for ref in _INNERMOST.findall(node):
                c, r = self._ref(path, ref)
                chars, res = chars + c, res + r + 1
        else:
            chars, res = max(len(str(node)), 1), 0
        self.active.discard(path)
        self.memo[path] = (chars, res)
        if chars > MAX_CHARS or res > MAX_RESOLUTIONS:
            raise _too_big(path, chars, res)
        return chars, res

    def _ref(self, at: Path, ref: str) -> tuple[int, int]:
        if ":" in ref:  # a resolver (oc.env, oc.select, ...): its arguments were counted as refs
            return len(ref), 0
        target = _target(at, ref.strip())
        if target is None:
            return 1, 0
        node: Any = self.root
        for part in target:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return 1, 0  # OmegaConf reports the missing key
        return self.cost(target, node)


def _target(at: Path, ref: str) -> Path | None:
    """The absolute path of ``${ref}`` used at ``at`` (``.x`` is a sibling, ``..x`` the parent's ...)."""
    dots = len(ref) - len(ref.lstrip("."))
    parts = [p for p in _INDEX.sub(r".\1", ref[dots:]).split(".") if p]
    if not dots:
        return tuple(parts)
    base = at[:-1]
    up = dots - 1
    if up > len(base):
        return None
    return (*base[:len(base) - up], *parts)


def _too_big(path: Path, chars: int, res: int) -> PolicyError:
    what = (f"needs {res} resolutions (the limit is {MAX_RESOLUTIONS})" if res > MAX_RESOLUTIONS
            else f"gives {chars} characters (the limit is {MAX_CHARS})")
    return PolicyError.single(".".join(path) or "<policy>", f"resolving the interpolations here {what}: each "
                              "use of ${...} is resolved in full again; reference fewer or smaller values",
                              has_value=False)


def check_interpolations(data: Any) -> None:
    """Raise a PolicyError when the unresolved ``data`` (plain containers) expands past the limits."""
    try:
        _Walk(data).cost((), data)
    except RecursionError:
        raise PolicyError.single("<policy>", "interpolations reference each other in a chain too long to "
                                 "resolve; shorten the chain of ${...} references", has_value=False) from None
