"""Policy packs: installed packages that ship YAML config groups (entry-point group
``lifecycle.policy_packs``). Each is added to Hydra's search path after the user's own config and the
built-ins, so the user can always override. No Hydra SearchPathPlugin: nothing leaks into other apps.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from lifecycle import SCHEMA_VERSION
from lifecycle.errors import PolicyError

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "lifecycle.policy_packs"


@dataclass(frozen=True)
class Pack:
    """One installed policy pack."""

    name: str
    module: str
    distribution: str
    version: str
    conf_dir: Path
    schema_version: int


def _pack_from_entry_point(ep: EntryPoint) -> Pack:
    name = ep.name
    module = ep.value.split(":")[0]
    dist = ep.dist
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PolicyError.single(f"pack {name}", f"module '{module}' is not an importable package",
                                 module, source=ENTRY_POINT_GROUP)
    conf_dir = Path(list(spec.submodule_search_locations)[0])
    version = _schema_version(conf_dir)
    return Pack(name, module, dist.name if dist else "?", dist.version if dist else "?", conf_dir, version)


def _schema_version(conf_dir: Path) -> int:
    marker = conf_dir / "SCHEMA_VERSION"
    try:
        return int(marker.read_text().strip()) if marker.is_file() else SCHEMA_VERSION
    except ValueError:
        return -1


def installed_packs() -> list[Pack]:
    """Every installed pack, sorted by name. A pack for another schema version is an error."""
    packs = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        pack = _pack_from_entry_point(ep)
        if pack.schema_version != SCHEMA_VERSION:
            raise PolicyError.single(
                f"pack {pack.name}", f"{pack.distribution} {pack.version} targets lifecycle schema "
                f"version {pack.schema_version}, this lifecycle reads version {SCHEMA_VERSION}; install a "
                f"matching version of the pack or of lifecycle", pack.schema_version)
        packs.append(pack)
    return packs


def pack_conf_dirs() -> list[Path]:
    """Config dirs of the installed packs, in name order."""
    return [p.conf_dir for p in installed_packs()]
