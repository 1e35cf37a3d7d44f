"""States rejected after a restore: ``<checkpoint.dir>/.restore-rejected.json``.

When the first step after a restore gives a non-finite loss (or one above ``checkpoint.restore_loss_factor`` x the
loss recorded at save), the state it came from is recorded here and the attempt fails; the next attempt then skips
it — a commit (``persistent``, by folder name) or a step of the memory tier (``memory``, by lineage and step) — and
falls back to the one before, once per state. Attempts that keep failing without a newer commit end with the
no-progress code (``restart.max_no_progress``), as any other failure.

::

    {"persistent": {"iter_0000040": "why"}, "memory": {"<lineage>:<step>": "why"}}

Pure Python: no torch. Read with safeio (a hostile or damaged file counts as empty, with a warning).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lifecycle.errors import RunDirError
from lifecycle.rundir import safeio

log = logging.getLogger(__name__)

NAME = ".restore-rejected.json"
TIERS = ("persistent", "memory")
_MAX = 1000  # entries kept per tier (the newest by insertion)


def memory_key(lineage: int, step: int) -> str:
    return f"{lineage}:{step}"


def read(root: str | Path) -> dict[str, dict[str, str]]:
    """The rejected states by tier (empty when there is no file or it cannot be used)."""
    path = Path(root) / NAME
    try:
        data = safeio.read_json(path, limit=1 << 20)
    except (RunDirError, OSError) as exc:
        log.warning("%s cannot be read (%s): no state counts as rejected", path, exc)
        return {t: {} for t in TIERS}
    out: dict[str, dict[str, str]] = {t: {} for t in TIERS}
    if isinstance(data, dict):
        for tier in TIERS:
            entries = data.get(tier)
            if isinstance(entries, dict):
                out[tier] = {str(k)[:200]: str(v)[:500] for k, v in list(entries.items())[-_MAX:]}
    return out


def add(root: str | Path, tier: str, key: str, why: str) -> None:
    """Record ``key`` of ``tier`` as rejected (an atomic rewrite: concurrent ranks rejecting the same state agree)."""
    if tier not in TIERS:
        raise ValueError(f"not a checkpoint tier: {tier}")
    data = read(root)
    data[tier][key] = why[:500]
    data[tier] = dict(list(data[tier].items())[-_MAX:])
    Path(root).mkdir(parents=True, exist_ok=True)
    safeio.write_text(Path(root) / NAME, json.dumps(data, indent=1) + "\n", fsync=True)


def memory_steps(root: str | Path, lineage: int) -> list[int]:
    """The memory-tier steps of ``lineage`` that were rejected, newest first."""
    prefix = f"{lineage}:"
    steps = [int(k[len(prefix):]) for k in read(root)["memory"] if k.startswith(prefix) and k[len(prefix):].isdigit()]
    return sorted(set(steps), reverse=True)
