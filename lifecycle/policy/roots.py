"""Where policy configs come from, in search order: the user's folder, the built-in presets, installed packs.

One module owns the search path so that loading, listing (``lifecycle policies``) and provenance
(``explain``) agree on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lifecycle.errors import PolicyError
from lifecycle.policy.packs import Pack, installed_packs


@dataclass(frozen=True)
class ConfigRoot:
    """One folder of the Hydra search path and where it comes from."""

    path: Path
    origin: str
    """``user dir``, ``built-in`` or a pack's label."""
    pack: Pack | None = None


def builtin_conf_dir() -> Path:
    """The built-in presets: ``lifecycle/conf`` when installed, ``conf/`` in a source tree."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"lifecycle's built-in conf/ is missing next to {here}")


def search_roots(config_dir: Path | None, packs: list[Pack] | None = None) -> list[ConfigRoot]:
    """The search path in order: the user's folder, the built-ins, then each usable pack by name."""
    roots = [ConfigRoot(config_dir, "user dir")] if config_dir is not None else []
    builtin = builtin_conf_dir()
    if config_dir != builtin:
        roots.append(ConfigRoot(builtin, "built-in"))
    seen = {r.path for r in roots}
    for pack in installed_packs() if packs is None else packs:
        if pack.error is None and pack.conf_dir is not None and pack.conf_dir not in seen:
            seen.add(pack.conf_dir)
            roots.append(ConfigRoot(pack.conf_dir, pack.label, pack))
    return roots


def config_roots(config_dir: str | Path | None, packs: list[Pack] | None = None) -> list[ConfigRoot]:
    """The search path: ``--config-dir`` (checked), the built-ins, the usable installed packs."""
    return search_roots(user_dir(config_dir), packs)


def user_dir(config_dir: str | Path | None) -> Path | None:
    """``--config-dir`` resolved, or a PolicyError when it is not a folder."""
    if config_dir is None:
        return None
    try:
        path = Path(config_dir).expanduser().resolve()
        is_dir = path.is_dir()
    except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        why = getattr(exc, "strerror", None) or str(exc).split(":")[0]
        raise PolicyError.single("--config-dir", f"cannot be resolved ({why}); pass the folder that holds "
                                 "your policy YAML", str(config_dir)) from None
    if not is_dir:
        raise PolicyError.single("--config-dir", "is not a directory; pass the folder that holds your "
                                 "policy YAML", str(config_dir))
    _no_shadows(path)
    return path


def _no_shadows(path: Path) -> None:
    """A ``*.yaml`` in the user's folder (or one group folder down) that is not a readable regular file (a dangling
    symlink, a FIFO, a device) would be skipped by the search and the built-in of the same name used instead,
    silently: refuse it, naming it."""
    import stat

    bad = []
    try:
        entries = [*path.glob("*.yaml"), *path.glob("*/*.yaml")]
    except OSError:
        return
    for entry in entries[:10_000]:
        try:
            mode = entry.stat().st_mode
        except OSError:
            bad.append(f"{entry.relative_to(path)} (a dangling symlink)" if entry.is_symlink() else
                       str(entry.relative_to(path)))
            continue
        if not stat.S_ISREG(mode):
            bad.append(f"{entry.relative_to(path)} (not a regular file)")
    if bad:
        raise PolicyError.single("--config-dir", f"holds {', '.join(sorted(bad)[:5])}: a config there would "
                                 f"silently fall back to the built-in of the same name; fix or remove it",
                                 str(path), has_value=False)
