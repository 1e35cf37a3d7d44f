"""The in-memory checkpoint tier's files: each rank's copies of its own state, and the copies it holds for its buddy,
in a node-local folder (``checkpoint.memory.dir``, tmpfs: they outlive the rank's process, not the node).

::

    <memory.dir>/lifecycle-<key>/          one folder per run (key: its checkpoint folder)
      own/rank_<R>/step_<N>.bin|.json      rank R's state at step N, written by rank R
      held/rank_<R>/step_<N>.bin|.json     rank R's state at step N, held by R's buddy (another node's rank)

A copy is the blob (``torch.save`` of the step handler's state) and its record (``.json``, written last: a copy
without one is torn): the step, the blob's size and sha256, and what it is bound to — the world size, the layout, the
kind's options and the run's *lineage*, a number kept in the checkpoint folder (``.memory-lineage``) that a run
starting over (``resume: never``, or a checkpoint folder emptied) replaces. A copy bound to anything else, or whose
bytes do not hash to its record, is never used (:func:`usable`, :func:`read`). No torch here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from lifecycle.checkpoint import ckptdir
from lifecycle.errors import RunDirError
from lifecycle.jsontypes import JsonDict
from lifecycle.rundir import safeio

LINEAGE = ".memory-lineage"
"""The lineage file in the checkpoint folder."""
_COPY = re.compile(r"^step_(\d{1,12})\.json$")
_RECORD_LIMIT = 1 << 20
MAX_BLOB = 1 << 44
"""16 TiB: no one rank's state is larger (a record naming more is forged)."""


def root(memory_dir: str | Path, checkpoint_dir: str | Path) -> Path:
    """The run's folder under ``memory_dir``: one per checkpoint folder — the run's, whatever launches it again
    (each ``lifecycle run`` of the same run directory has a run id of its own)."""
    key = hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:16]
    return Path(memory_dir) / f"lifecycle-{key}"


def own_dir(base: Path, rank: int) -> Path:
    return base / "own" / f"rank_{rank}"


def held_dir(base: Path, rank: int) -> Path:
    return base / "held" / f"rank_{rank}"


def lineage(checkpoint_dir: str | Path, *, new: bool) -> int:
    """The lineage number of the checkpoint folder (global rank 0 only): read, or written when missing or ``new``.
    A number in 1 .. 2**62."""
    path = Path(checkpoint_dir) / LINEAGE
    if not new:
        try:
            text = safeio.read_text(path, limit=64)
        except RunDirError:
            text = None
        if text is not None and text.strip().isdigit() and 0 < int(text.strip()) <= 1 << 62:
            return int(text.strip())
    value = secrets.randbelow(1 << 62) + 1
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    safeio.write_text(path, f"{value}\n", fsync=True)
    return value


@dataclass(frozen=True)
class Bound:
    """What a copy must match to be used: the world size, layout, kind options and lineage of this run."""

    world: int
    layout: JsonDict
    options: JsonDict | None
    lineage: int

    def as_json(self) -> JsonDict:
        return {"world": self.world, "layout": self.layout, "options": self.options, "lineage": self.lineage}


def write(folder: Path, step: int, owner: int, blob: bytes, bound: Bound, loss: float | None = None) -> int:
    """Write one copy (the blob, then its record: with the step's ``loss`` when finite) into ``folder``; the bytes
    written."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"step_{step}"
    safeio.write_bytes(folder / f"{name}.bin", blob)
    record = {"step": step, "owner": owner, "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
              **bound.as_json()}
    if loss is not None and math.isfinite(loss):
        record["loss"] = loss
    safeio.write_text(folder / f"{name}.json", json.dumps(record))
    return len(blob)


def saved_loss(folder: Path, step: int) -> float | None:
    """The loss the record of ``folder``'s copy of ``step`` holds (None: none recorded, or no usable record)."""
    record = safeio.try_json(folder / f"step_{step}.json")
    loss = record.get("loss") if isinstance(record, dict) else None
    return float(loss) if isinstance(loss, int | float) and math.isfinite(loss) else None


def steps(folder: Path) -> list[int]:
    """The steps of the copies recorded in ``folder``, newest first (unchecked)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = [int(m.group(1)) for m in map(_COPY.match, names) if m]
    return sorted(found, reverse=True)


def usable(folder: Path, step: int, owner: int, bound: Bound, *, digest: bool = False) -> str | None:
    """Why the copy of ``step`` in ``folder`` cannot be used for rank ``owner`` of this run, or None: its record,
    and with ``digest`` its bytes' size and sha256 (streamed, not held; :func:`read` checks them again as it reads)."""
    try:
        record = safeio.read_json(folder / f"step_{step}.json", limit=_RECORD_LIMIT)
    except RunDirError as exc:
        return str(exc)
    if not isinstance(record, dict):
        return "no record"
    size = record.get("size")
    if record.get("step") != step or record.get("owner") != owner:
        return f"its record names step {record.get('step')} of rank {record.get('owner')}"
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_BLOB:
        return f"its record names no size ({str(size)[:40]})"
    if not isinstance(record.get("sha256"), str):
        return "its record has no digest"
    for key, value in bound.as_json().items():
        if record.get(key) != value:
            return f"it belongs to another {'run' if key == 'lineage' else key} ({key} {str(record.get(key))[:80]})"
    if digest:
        blob = folder / f"step_{step}.bin"
        try:
            if blob.stat().st_size != size or ckptdir.digest(blob) != record["sha256"]:
                return f"{blob} does not match its record (its size or its sha256): the copy is damaged"
        except (OSError, RunDirError) as exc:
            return f"{blob}: {exc}"
    return None


def read(folder: Path, step: int) -> bytes:
    """The blob of a usable copy, checked against its record's size and sha256 (ValueError: why not)."""
    record = safeio.read_json(folder / f"step_{step}.json", limit=_RECORD_LIMIT)
    if not isinstance(record, dict) or not isinstance(record.get("size"), int):
        raise ValueError(f"{folder}/step_{step}.json: no record")
    try:
        data = safeio.read_bytes(folder / f"step_{step}.bin", limit=int(record["size"]))
    except RunDirError as exc:
        raise ValueError(str(exc)) from None
    if data is None:
        raise ValueError(f"{folder}/step_{step}.bin is missing")
    if len(data) != record["size"] or hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise ValueError(f"{folder}/step_{step}.bin does not match its record (size {len(data)} of "
                         f"{record['size']}, or its sha256): the copy is damaged")
    return data


def prune(folder: Path, keep: int) -> None:
    """Keep the newest ``keep`` copies of ``folder``; remove the rest and anything torn (a blob without a record)."""
    kept = set(steps(folder)[:keep])
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = re.match(r"^step_(\d{1,12})\.(bin|json)$", name)
        if m is None or int(m.group(1)) not in kept:
            _remove(folder / name)


def drop(folder: Path, step: int) -> None:
    """Remove one copy (its record first: never a record without its blob)."""
    _remove(folder / f"step_{step}.json")
    _remove(folder / f"step_{step}.bin")


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def remove(base: Path) -> None:
    """Remove the run's whole folder (the launcher, once the run is over)."""
    shutil.rmtree(base, ignore_errors=True)


def remove_rank(base: Path, rank: int, ward: int | None) -> None:
    """Remove what rank ``rank`` wrote: its own copies and those it holds for ``ward``; then the run's folder, once
    no rank's copies are left in it."""
    shutil.rmtree(own_dir(base, rank), ignore_errors=True)
    if ward is not None:
        shutil.rmtree(held_dir(base, ward), ignore_errors=True)
    for folder in (base / "own", base / "held", base):
        try:
            folder.rmdir()
        except OSError:
            pass


def free_bytes(folder: str | Path) -> int | None:
    """The bytes free in the file system of ``folder`` (its nearest existing parent), or None."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
