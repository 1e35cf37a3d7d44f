"""Where each value of a composed policy came from: a file (built-in, pack, user dir), the command line,
or the schema default.

Hydra keeps no per-key origin, but it tells the merge order: ``ConfigLoader.compute_defaults_list`` (part
of the public ``hydra.core.config_loader`` interface) returns every config file in the order Hydra merges
them, each with its target package. Replaying that order over the files' own keys — the last file that
sets a key wins, as in Hydra's merge — and then the command-line overrides gives each key's origin.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifecycle.errors import PolicyError
from lifecycle.policy import yamlguard
from lifecycle.policy.load import Loaded, hydra_session, normalize_overrides, to_plain
from lifecycle.policy.roots import ConfigRoot

COMMAND_LINE = "command line"
DEFAULT = "default"


@dataclass(frozen=True)
class Origin:
    """Where one key was last set: ``source`` is an origin label, ``file`` a config path or None."""

    source: str
    file: str | None = None
    path: str | None = None
    """Absolute path of the file."""
    order: int = field(default=0, compare=False)
    """Position in the merge order (files in Hydra's order, then the command line)."""

    def __str__(self) -> str:
        return f"{self.source} {self.file}" if self.file else self.source

    def as_dict(self) -> dict[str, str | int | None]:
        return {"source": self.source, "file": self.file, "path": self.path, "order": self.order}


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Leaf key paths of nested dicts; lists and scalars are leaves, empty dicts vanish."""
    if isinstance(node, dict) and (node or not prefix):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _defaults(loaded: Loaded) -> list[tuple[str, str]]:
    """(config path, package) of every policy file, in Hydra's merge order."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    with hydra_session(loaded.roots) as searchpath:
        loader = GlobalHydra.instance().config_loader()
        result = loader.compute_defaults_list(
            loaded.config_name, [*normalize_overrides(loaded.overrides), searchpath], RunMode.RUN)
    out = []
    for d in getattr(result, "defaults", []):
        path, package = getattr(d, "config_path", None), getattr(d, "package", None) or ""
        if path and not path.startswith("hydra/") and package.split(".")[0] != "hydra":
            out.append((path, package))
    return out


def _find(config_path: str, roots: tuple[ConfigRoot, ...]) -> tuple[ConfigRoot, Path] | None:
    for root in roots:  # Hydra's rule: the first folder of the search path that has the file
        file = root.path / f"{config_path}.yaml"
        if file.is_file():
            return root, file
    return None


def _file_keys(file: Path, package: str) -> list[str]:
    data = yamlguard.load_file(file) or {}
    if not isinstance(data, dict):
        return []
    data = {k: v for k, v in data.items() if k != "defaults"}
    for part in reversed([p for p in package.split(".") if p]):
        data = {part: data}
    return list(flatten(data)) if data else []


def _set(origins: dict[str, Origin], key: str, origin: Origin) -> None:
    for k in [k for k in origins if k.startswith(key + ".")]:
        del origins[k]
    origins[key] = origin


def _is_group(key: str, roots: tuple[ConfigRoot, ...]) -> bool:
    return any((r.path / key.replace(".", "/")).is_dir() for r in roots)


def _apply_override(origins: dict[str, Origin], override: str, roots: tuple[ConfigRoot, ...]) -> None:
    key, _, value = override.lstrip("+").partition("=")
    if key.startswith("~"):
        key = key[1:]
        for k in [k for k in origins if k == key or k.startswith(key + ".")]:
            del origins[k]
        return
    if not key or _is_group(key, roots):  # a group choice: already in the defaults list
        return
    try:
        parsed = yamlguard.load_text(value, key)
    except PolicyError:
        parsed = value
    # A mapping value merges into the node (Hydra's update), so only its own leaves change origin.
    leaves = flatten(parsed, key) if isinstance(parsed, dict) and parsed else {key: parsed}
    for leaf in leaves:
        _set(origins, leaf, Origin(COMMAND_LINE, order=1 << 30))


def last_writers(loaded: Loaded) -> dict[str, Origin]:
    """For each key some file or override set: the origin of its final value."""
    origins: dict[str, Origin] = {}
    for i, (config_path, package) in enumerate(_defaults(loaded)):
        found = _find(config_path, loaded.roots)
        if found is None:
            continue
        root, file = found
        origin = Origin(root.origin, f"{config_path}.yaml", str(file), i)
        for key in _file_keys(file, package):
            _set(origins, key, origin)
    for override in loaded.overrides:
        _apply_override(origins, override, loaded.roots)
    return origins


def provenance(loaded: Loaded) -> dict[str, Origin]:
    """Every leaf key of the resolved policy -> its origin (``default`` when no file or override set it)."""
    if not loaded.roots:
        return {}
    writers = last_writers(loaded)
    out = {}
    for key in flatten(to_plain(loaded.policy)):
        parts = key.split(".")
        prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
        out[key] = next((writers[p] for p in prefixes if p in writers), Origin(DEFAULT))
    return out


def _compress(keys: list[str]) -> list[str]:
    """``checkpoint.every_steps checkpoint.keep_last`` -> ``checkpoint.{every_steps,keep_last}``."""
    by_parent: dict[str, list[str]] = {}
    for key in keys:
        parent, _, leaf = key.rpartition(".")
        by_parent.setdefault(parent, []).append(leaf)
    out = []
    for parent, leaves in by_parent.items():
        if not parent:
            out.extend(leaves)
        else:
            out.append(f"{parent}.{leaves[0]}" if len(leaves) == 1 else f"{parent}.{{{','.join(leaves)}}}")
    return out


def render(origins: dict[str, Origin], width: int = 110) -> list[str]:
    """Text lines: each origin in merge order with the keys whose final value it set."""
    groups: dict[Origin, list[str]] = {}
    for key, origin in origins.items():
        if origin.source != DEFAULT:
            groups.setdefault(origin, []).append(key)
    lines = ["sources  (the last file or override that set each key; unlisted keys are schema defaults)"]
    for origin in sorted(groups, key=lambda o: o.order):
        lines.append(f"  {origin}")
        lines += textwrap.wrap(" ".join(_compress(groups[origin])), width, initial_indent=" " * 6,
                               subsequent_indent=" " * 6, break_on_hyphens=False)
    return lines
