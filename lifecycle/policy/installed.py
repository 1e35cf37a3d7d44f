"""What is installed that a policy depends on: megatron-core's and nvidia-resiliency-ext's versions, read from the
packages' metadata (nothing is imported), and the rules that refuse a policy this installation cannot run.

Why they matter here. megatron-core 0.17 and later plan a checkpoint save with one of two async implementations:
its own (``async_strategy="mcore"``, deprecated in 0.19) or nvidia-resiliency-ext's (``"nvrx"``, the default of
``dist_checkpointing.save``); 0.16 and older have only their own. megatron-core 0.18 and later also refuse an
nvidia-resiliency-ext older than :data:`NVRX_MIN` at import time — the whole of ``megatron.core``, not only the save
(an ``AttributeError`` from 0.4.x, which has no ``__version__``; an ``AssertionError`` from 0.5.x). pip installs such
an old one wherever glibc is older than 2.39, the platform tag of nvidia-resiliency-ext 0.5 and later wheels.

Pure Python: ``lifecycle validate`` and ``explain`` use it without torch.
"""

from __future__ import annotations

import functools
import re
from importlib import metadata

from lifecycle.errors import PolicyIssue

MEGATRON = "megatron-core"
NVRX = "nvidia-resiliency-ext"
NVRX_MIN = (0, 6, 0)
"""The oldest nvidia-resiliency-ext megatron-core 0.18 and 0.19 import (their ``NVRX_MIN_VERSION``)."""
NVRX_CHECKED_FROM = (0, 18)
"""The first megatron-core that checks :data:`NVRX_MIN` when ``megatron.core`` is imported."""
ASYNC_STRATEGY_FROM = (0, 17)
"""The first megatron-core whose ``dist_checkpointing.save`` takes ``async_strategy``."""
GTP_GROUPS_FROM = (0, 19)
"""The first megatron-core whose ``initialize_model_parallel`` creates the generalized-tensor-parallel groups."""

Version = tuple[int, ...]


def parse(text: str) -> Version:
    """The release numbers of a version string: ``0.19.2`` -> (0, 19, 2); ``0.16.0rc0.dev1`` -> (0, 16, 0)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


@functools.cache
def version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (as its metadata says), or None when it is not installed. Read once
    per process."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a broken dist-info: as good as absent for the rules below
        return None


def fmt(v: Version) -> str:
    return ".".join(map(str, v))


def megatron_version() -> Version | None:
    text = version(MEGATRON)
    return parse(text) if text else None


def gtp_groups() -> bool:
    """Whether the installed megatron-core makes the generalized-tensor-parallel groups (0.19+); the newest layout
    when megatron-core is not installed (``lifecycle explain`` on a machine without it)."""
    mc = megatron_version()
    return mc is None or mc[:2] >= GTP_GROUPS_FROM


def nvrx_conflict() -> str | None:
    """Why ``import megatron.core`` fails beside the installed nvidia-resiliency-ext (None when it does not)."""
    mc, nv = version(MEGATRON), version(NVRX)
    if mc is None or nv is None or parse(mc)[:2] < NVRX_CHECKED_FROM or parse(nv) >= NVRX_MIN:
        return None
    return (f"megatron-core {mc} cannot be imported beside nvidia-resiliency-ext {nv}: megatron-core checks for "
            f"{NVRX} >= {fmt(NVRX_MIN)} when it is imported. Upgrade it (pip install '{NVRX}>={fmt(NVRX_MIN)}'; its "
            f"wheels need glibc 2.39) or uninstall it (pip uninstall {NVRX}): lifecycle then saves with megatron-core's "
            f"own async code")


def issues(async_strategy: str) -> list[PolicyIssue]:
    """``checkpoint.async_strategy`` against what is installed: ``nvrx`` needs the package, a megatron-core that
    takes it, and a version that megatron-core imports. ``auto`` and ``mcore`` work with whatever is installed."""
    if async_strategy != "nvrx":
        return []
    key, mc, nv = "checkpoint.async_strategy", version(MEGATRON), version(NVRX)
    if nv is None:
        return [PolicyIssue(key, f"nvrx needs {NVRX}, which is not installed: pip install '{NVRX}>={fmt(NVRX_MIN)}' "
                                 f"(its wheels need glibc 2.39), or set checkpoint.async_strategy=auto (megatron-core's "
                                 f"own async save when {NVRX} is absent)", async_strategy)]
    if mc is not None and parse(mc)[:2] < ASYNC_STRATEGY_FROM:
        return [PolicyIssue(key, f"megatron-core {mc} saves with its own async code only (async_strategy came in "
                                 f"{fmt(ASYNC_STRATEGY_FROM)}): set checkpoint.async_strategy=auto or mcore, or upgrade "
                                 f"megatron-core", async_strategy)]
    if parse(nv) < NVRX_MIN:
        return [PolicyIssue(key, f"nvrx needs {NVRX} >= {fmt(NVRX_MIN)} (megatron-core's minimum), found {nv}: "
                                 f"upgrade it, or set checkpoint.async_strategy=auto", async_strategy)]
    return []
