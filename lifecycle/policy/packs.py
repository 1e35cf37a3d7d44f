"""Policy packs: installed packages that ship YAML config groups, and where every config comes from.

A pack is a normal Python package declared under the entry-point group ``lifecycle.policy_packs``::

    [project.entry-points."lifecycle.policy_packs"]
    acme = "acme_lifecycle_policies"        # name = the package whose folder holds preset/, warmup/, ...

Its ``__init__`` declares the policy schema it targets with ``LIFECYCLE_SCHEMA_VERSION = 1`` and must
import without torch (``validate`` imports it). Why an attribute and not a marker file: it always ships
with the package (no package-data glob to forget), and a pack's handler entry points import the same
package anyway.

Each usable pack's folder is added to Hydra's search path as ``file://<folder>`` *after* the user's own
folder and the built-ins, through the ``hydra.searchpath`` override of one compose call — no Hydra
SearchPathPlugin, so nothing leaks into other Hydra apps, and a pack can never shadow a built-in or a user
file. The resolved folder rather than ``pkg://<module>``: it is the folder whose version was checked, the
one ``lifecycle policies`` lists and ``explain`` cites, and Hydra's ``pkg://`` source silently drops a
package that fails to import instead of saying why.

A broken pack (import error, no or wrong schema version) is left off the search path and breaks nothing
else; its error is raised when one of its configs is asked for, and shown by ``lifecycle policies``. A pack whose
import does not return within ``LIFECYCLE_IMPORT_TIMEOUT_S`` (default 5 s) is such a pack too, with a warning
(:mod:`lifecycle.policy.imports`); what a pack prints while it imports goes to stderr.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from lifecycle.errors import PolicyError
from lifecycle.policy import imports
from lifecycle.policy.versions import LIBRARY_VERSION, SCHEMA_VERSION

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "lifecycle.policy_packs"
VERSION_ATTR = "LIFECYCLE_SCHEMA_VERSION"


@dataclass(frozen=True)
class Pack:
    """One installed policy pack; ``error`` says why it is unusable (None when usable)."""

    name: str
    module: str
    distribution: str
    version: str
    conf_dir: Path | None
    schema_version: int | None
    summary: str = ""
    error: str | None = None

    @property
    def label(self) -> str:
        """How listings and ``explain`` name it: ``pack acme (acme-lifecycle-policies 1.0.0)``."""
        return f"pack {self.name} ({self.distribution} {self.version})"

    def check(self, wanted: str | None = None) -> None:
        """Raise the pack's PolicyError (exit 2) when it is unusable; ``wanted`` is the config asked for."""
        if self.error is not None:
            why = f" (it ships {wanted}.yaml, which this policy asks for)" if wanted else ""
            raise PolicyError.single(self.label, f"unusable pack{why}: {self.error}", has_value=False)


def _conf_dir(module: str) -> Path | None:
    """The package folder, found without running the package (for packs that fail to import)."""
    if "." in module and imports.hung(module) is not None:
        return None  # finding a sub-package imports its parent, whose import hangs
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations and Path(locations[0]).is_dir() else None


def _declared_version(module: str) -> tuple[int | None, str | None]:
    """(schema version, error) read from the pack package's ``LIFECYCLE_SCHEMA_VERSION``."""
    torch_before = "torch" in sys.modules
    try:
        mod = imports.bounded(module, lambda: importlib.import_module(module))
    except KeyboardInterrupt:
        raise
    except TimeoutError as exc:
        return None, (f"importing package '{module}' {exc}; the pack is skipped (raise {imports.ENV_TIMEOUT} if "
                      f"it is only slow)")
    except BaseException as exc:  # noqa: BLE001 - any failure (SystemExit too) makes the pack unusable, not lifecycle
        return None, f"cannot import package '{module}': {type(exc).__name__}: {exc}"
    if not torch_before and "torch" in sys.modules:
        log.warning("policy pack package '%s' imports torch; `lifecycle validate` gets slow", module)
    declared = getattr(mod, VERSION_ATTR, None)
    if declared is None:
        return None, (f"declares no schema version; add `{VERSION_ATTR} = {SCHEMA_VERSION}` to "
                      f"{module}/__init__.py")
    if isinstance(declared, bool) or not isinstance(declared, int):
        return None, f"{module}.{VERSION_ATTR} must be an int, got {declared!r}"
    return declared, None


def _load(ep: EntryPoint) -> Pack:
    dist = ep.dist
    dist_name, version = (dist.name, dist.version) if dist is not None else ("?", "?")
    summary = str(dist.metadata.json.get("summary") or "") if dist is not None else ""
    module = ep.module
    schema, error = _declared_version(module)
    conf_dir = _conf_dir(module)
    if error is None and conf_dir is None:
        error = f"package '{module}' is not a folder on disk (a zipped install?); reinstall it unzipped"
    if error is None and schema != SCHEMA_VERSION:
        error = (f"targets lifecycle policy schema version {schema}, but this "
                 f"lifecycle ({LIBRARY_VERSION}) reads schema version {SCHEMA_VERSION}; install a release of "
                 f"{dist_name} that targets schema {SCHEMA_VERSION}, or a lifecycle that reads schema {schema}")
    pack = Pack(ep.name, module, dist_name, version, conf_dir, schema, summary, error)
    if error is not None and module not in _warned and imports.hung(module) is not None:
        _warned.add(module)  # once per process: every compose lists the packs again
        log.warning("%s: %s", pack.label, error)
    elif error is not None:
        log.debug("policy pack %s is unusable: %s", ep.name, error)
    return pack


_warned: set[str] = set()


def installed_packs() -> list[Pack]:
    """Every pack declared by an installed distribution, usable or not, in name order.

    One entry-point scan (a few ms) and one import of each pack's small ``__init__`` per call.
    """
    eps = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value))
    return [_load(ep) for ep in eps]


def unusable_pack_for(config_path: str, packs: list[Pack] | None = None) -> Pack | None:
    """The unusable pack that ships ``config_path`` (``preset/old``), if any: its error explains the miss."""
    for pack in installed_packs() if packs is None else packs:
        if pack.error is not None and pack.conf_dir is not None:
            if (pack.conf_dir / f"{config_path}.yaml").is_file():
                return pack
    return None
