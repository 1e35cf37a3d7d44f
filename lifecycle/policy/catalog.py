"""`lifecycle policies`: every config a user can choose, where it comes from, and its one-line description."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lifecycle.errors import PolicyError
from lifecycle.policy import yamlguard
from lifecycle.policy.packs import Pack
from lifecycle.policy.roots import ConfigRoot

_SKIP_DIRS = {"__pycache__"}


@dataclass(frozen=True)
class Entry:
    """One choosable config: ``group=name`` (or ``--config-name name`` when ``group`` is empty)."""

    group: str
    name: str
    origin: str
    file: str
    description: str
    shadowed_by: str | None = None
    """The origin of an earlier folder on the search path with the same config (which Hydra picks)."""
    error: str | None = None
    """``file[:line[:column]]: why`` the file cannot be used (not UTF-8, too large, not YAML...);
    `policies` then exits 2."""

    @property
    def choose(self) -> str:
        return f"{self.group}={self.name}" if self.group else f"--config-name {self.name}"


def describe(file: Path) -> str:
    """The ``description`` key, else the first comment line that is not a directive."""
    return _read(file)[0]


def _read(file: Path) -> tuple[str, str | None]:
    """(description, error): the file is read with the same limits as a compose."""
    try:
        text = yamlguard.check_file(file)
        data = yamlguard.parse(text, str(file))
    except PolicyError as exc:
        issue = exc.issues[0]
        return "(unreadable: see the error)", f"{issue.path}: {issue.message}"
    if isinstance(data, dict) and isinstance(data.get("description"), str):
        return (data["description"].strip().splitlines()[0] if data["description"].strip() else ""), None
    return _first_sentence(_leading_comment(text)), None


def _leading_comment(text: str) -> str:
    """The first block of comment lines, directives (``@package``, ``yaml-language-server``) skipped."""
    block: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        comment = stripped.lstrip("#").strip()
        if stripped.startswith("#") and comment.startswith(("@package", "yaml-language-server")):
            continue
        if not stripped.startswith("#") or not comment:
            if block or (stripped and not stripped.startswith("#")):
                break
            continue
        block.append(comment)
    return " ".join(block)


def _first_sentence(text: str) -> str:
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _files(root: ConfigRoot, primary: bool) -> list[tuple[str, str, Path]]:
    """(group, name, file) under one root.

    Top-level files count only in the first folder: Hydra looks a ``--config-name`` up there alone (it
    reads the primary config before the rest of the search path is in place).
    """
    out = []
    try:
        files = sorted(root.path.rglob("*.yaml"))
    except (OSError, RecursionError) as exc:
        why = getattr(exc, "strerror", None) or type(exc).__name__
        raise PolicyError.single(str(root.path), f"cannot list the folder ({why}); check it and its "
                                 "sub-folders", has_value=False) from None
    for file in files:
        rel = file.relative_to(root.path)
        if any(part.startswith(".") or part in _SKIP_DIRS for part in rel.parts):
            continue
        group = "/".join(rel.parts[:-1])
        if not group and not primary:
            continue
        out.append((group, file.stem, file))
    return out


def catalog(roots: list[ConfigRoot]) -> list[Entry]:
    """Every config under the search path, grouped, in search order; later duplicates are shadowed."""
    first: dict[tuple[str, str], str] = {}
    entries = []
    for i, root in enumerate(roots):
        for group, name, file in _files(root, primary=i == 0):
            winner = first.setdefault((group, name), root.origin)
            shadowed = winner if winner != root.origin else None
            entries.append(Entry(group, name, root.origin, str(file), *_describe(file, shadowed)))
    return sorted(entries, key=lambda e: (e.group == "", e.group, e.name))


def _describe(file: Path, shadowed: str | None) -> tuple[str, str | None, str | None]:
    description, error = _read(file)
    return description, shadowed, error


def as_dict(entries: list[Entry], packs: list[Pack], kinds: list[Any]) -> dict[str, Any]:
    """The --json output."""
    return {
        "configs": [{**asdict(e), "choose": e.choose} for e in entries],
        "handler_kinds": [{"phase": s.phase, "kind": s.kind, "source": s.source, "description": s.description}
                          for s in kinds],
        "packs": [{**asdict(p), "conf_dir": str(p.conf_dir) if p.conf_dir else None, "usable": p.error is None}
                  for p in packs],
    }


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]).rstrip() for r in rows]


def render(entries: list[Entry], packs: list[Pack], kinds: list[Any]) -> str:
    """Human text: configs by group, handler kinds, installed packs."""
    lines: list[str] = []
    groups = sorted({e.group for e in entries}, key=lambda g: (g == "", g))
    for group in groups:
        members = [e for e in entries if e.group == group]
        how = f"choose with {group}=NAME" if group else "choose with --config-name NAME"
        lines.append(f"{group or 'configs'}  ({how})")
        lines += _table([(e.name, e.origin, e.description + (f"  [shadowed by {e.shadowed_by}]"
                                                              if e.shadowed_by else "")) for e in members])
        lines.append("")
    lines.append("handler kinds  (choose with train.kind=NAME)")
    lines += _table([(s.kind, s.source, s.description) for s in kinds])
    lines += ["", "packs  (entry-point group lifecycle.policy_packs; searched after your dir and the built-ins)"]
    if not packs:
        lines.append("  (none installed)")
    rows = [(p.name, f"{p.distribution} {p.version}",
             f"UNUSABLE: {p.error}" if p.error else f"schema {p.schema_version}  {p.conf_dir}") for p in packs]
    lines += _table(rows) if rows else []
    return "\n".join(lines)
