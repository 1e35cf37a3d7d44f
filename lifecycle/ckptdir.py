"""The checkpoint directory: what is committed, what is complete, the tracker, pruning, setting bad ones aside.

::

    <checkpoint.dir>/
      iter_0000010/            a committed checkpoint: the step handler's files, ``metadata.json`` (written last
                               by the handler) and ``manifest.json`` (every file and its size, written at commit)
      iter_0000020.tmp/        a save in progress or torn by a crash: never committed, never counted
      iter_0000015.corrupt-20261123T101500Z/   set aside: incomplete or failed to load (never deleted silently)
      latest                   the tracker: the folder name of the newest committed checkpoint
      latest_checkpointed_iteration.txt        the same as Megatron-LM writes it (the iteration number)

Invariant kept by every function here: the tracker names a complete checkpoint that exists, or there is no
tracker. A commit renames the finished ``.tmp`` folder into place and then replaces the tracker atomically
(write, fsync, rename, fsync the folder); pruning deletes only complete checkpoints that are neither the
tracker's nor protected (the one this run resumed from), beyond the newest ``keep_last``.

Pure Python (no torch): the launcher checks a checkpoint folder before any rank starts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from lifecycle import safeio

log = logging.getLogger(__name__)

TRACKER = "latest"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
COMPLETE = "metadata.json"
_ITER = re.compile(r"^iter_(\d{7,})$")
_TRACKER_MAX_BYTES = 256


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def step_of(name: str) -> int | None:
    """The step of an ``iter_NNNNNNN`` folder name, else None (``.tmp`` and set-aside folders included)."""
    m = _ITER.match(name)
    return int(m.group(1)) if m else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    safeio.write_text(path, text, fsync=True)


# ---- completeness ----------------------------------------------------------------------------------
def write_manifest(folder: Path) -> None:
    """Record every file of ``folder`` and its size (rank 0, at commit, after every rank's writes are durable)."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            files[str(path.relative_to(folder))] = path.stat().st_size
    _atomic_write(folder / MANIFEST, json.dumps({"format": 1, "files": files}, indent=0))


def problem(folder: Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None when it is. Local; reads sizes, not contents.

    A checkpoint with a manifest is complete when every listed file exists with its size (a truncated or
    missing shard is named); one without (written by megatron-core's own save or an older lifecycle) when
    its ``metadata.json`` exists.
    """
    if not folder.is_dir():
        return "does not exist" if not folder.exists() else "is not a directory"
    if not (folder / COMPLETE).is_file():
        return f"{COMPLETE} is missing (the save never completed)"
    manifest = folder / MANIFEST
    if not manifest.exists():
        return None
    try:
        files = safeio.read_json(manifest, limit=16 << 20)["files"]  # type: ignore[index,call-overload]
        listed = {str(k): int(v) for k, v in files.items()}
    except safeio.RunDirError as exc:
        return f"{MANIFEST} is unreadable ({str(exc).split(': ', 1)[-1].split(';')[0]})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__})"
    for name, size in listed.items():
        path = folder / name
        try:
            actual = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written (truncated or overwritten)"
    return None


# ---- the tracker --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tracker:
    """What the tracker says: the committed folder name, or why it cannot be used (``error``)."""

    path: Path
    name: str | None = None
    error: str | None = None

    @property
    def present(self) -> bool:
        return self.name is not None or self.error is not None


def read_tracker(root: Path) -> Tracker:
    """Read ``latest`` (or Megatron-LM's ``latest_checkpointed_iteration.txt`` when it is the only one).

    Bounded (a few hundred bytes), strict: the content must name an ``iter_NNNNNNN`` folder directly inside
    ``root`` (a step number for Megatron's file). Garbage, non-UTF-8 bytes, paths and ``release`` are errors.
    """
    for fname, numeric in ((TRACKER, False), (MEGATRON_TRACKER, True)):
        path = root / fname
        if not path.exists() and not path.is_symlink():
            continue
        try:
            with safeio.open_regular(path) as f:  # a FIFO there would block a plain open() forever
                raw = f.read(_TRACKER_MAX_BYTES + 1)
        except safeio.RunDirError as exc:
            return Tracker(path, error=str(exc).split(": ", 1)[-1].split(";")[0])
        except OSError as exc:
            return Tracker(path, error=f"cannot be read ({exc.strerror or exc})")
        if len(raw) > _TRACKER_MAX_BYTES:
            return Tracker(path, error=f"is longer than {_TRACKER_MAX_BYTES} bytes (not a tracker)")
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            return Tracker(path, error=f"is not UTF-8 text (byte {exc.start})")
        if numeric:
            if not text.isdigit():
                return Tracker(path, error=f"holds {text[:40]!r}, not an iteration number")
            text = iter_name(int(text))
        if step_of(text) is None:
            return Tracker(path, error=f"holds {text[:40]!r}, which is not an iter_NNNNNNN folder inside "
                                       f"{root}")
        return Tracker(path, name=text)
    return Tracker(root / TRACKER)


def write_tracker(root: Path, step: int) -> None:
    """Point the trackers at ``iter_<step>`` atomically (``latest``, then Megatron-LM's file), fsync the folder."""
    _atomic_write(root / TRACKER, iter_name(step) + "\n")
    _atomic_write(root / MEGATRON_TRACKER, f"{step}\n")
    fsync_dir(root)


def drop_tracker(root: Path, why: str) -> None:
    """Rename the trackers aside (``latest.corrupt-<time>``): no tracker is better than a wrong one."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for name in (TRACKER, MEGATRON_TRACKER):
        path = root / name
        if path.exists() or path.is_symlink():
            os.replace(path, root / f"{name}.corrupt-{stamp}")
            log.warning("tracker %s set aside: %s", path, why)
    if root.is_dir():
        fsync_dir(root)


# ---- listing, pruning, setting aside ------------------------------------------------------------------
def committed(root: Path) -> list[Path]:
    """``iter_NNNNNNN`` folders, oldest first by step (``.tmp`` and set-aside folders are not committed)."""
    if not root.is_dir():
        return []
    found = [(step_of(p.name), p) for p in root.iterdir() if p.is_dir()]
    return [p for s, p in sorted((s, p) for s, p in found if s is not None)]


def set_aside(folder: Path, why: str, *, kind: str = "corrupt") -> Path:
    """Rename ``folder`` to ``<name>.<kind>-<UTC time>``: out of every listing, never deleted."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = folder.with_name(f"{folder.name}.{kind}-{stamp}")
    n = 1
    while target.exists():
        target = folder.with_name(f"{folder.name}.{kind}-{stamp}-{n}")
        n += 1
    os.replace(folder, target)
    fsync_dir(folder.parent)
    log.warning("checkpoint %s set aside as %s: %s", folder, target.name, why)
    return target


def prune(root: Path, keep_last: int, protect: set[str]) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` (0 keeps all), never the tracker's, never
    one in ``protect``, never an incomplete one (those are not counted either)."""
    if keep_last == 0:
        return []
    tracked = read_tracker(root).name
    complete = [p for p in committed(root) if problem(p) is None]
    keep = {p.name for p in complete[-keep_last:]} | set(protect) | ({tracked} if tracked else set())
    doomed = [p for p in complete if p.name not in keep]
    for path in doomed:
        shutil.rmtree(path)
    if doomed:
        fsync_dir(root)
    return doomed


def set_aside_untracked(root: Path, tracked: str | None) -> list[Path]:
    """Folders newer than the tracker (all of them when there is none): a commit that did not finish. Rank 0
    renames them aside (``corrupt`` when incomplete, ``uncommitted`` when complete) so they are never counted."""
    limit = step_of(tracked) if tracked else -1
    moved = []
    for folder in committed(root):
        step = step_of(folder.name)
        if step is not None and limit is not None and step > limit:
            why = problem(folder)
            moved.append(set_aside(folder, why or "complete but never committed (no tracker names it)",
                                   kind="corrupt" if why else "uncommitted"))
    return moved


# ---- resume candidates --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidates:
    """Checkpoints to try at resume, newest first, and what was found wrong on the way (path -> why)."""

    tracker: Tracker
    paths: list[Path]
    rejected: dict[str, str]


def candidates(root: Path) -> Candidates:
    """The tracker's checkpoint, then every older complete one, newest first. Local and read-only.

    A folder that is not complete is not a candidate; it is listed in ``rejected`` with the reason. With a
    bad or missing tracker beside committed folders, the complete ones are the candidates, newest first.
    """
    tracker = read_tracker(root)
    folders = committed(root)
    limit = step_of(tracker.name) if tracker.name else None
    rejected: dict[str, str] = {}
    out: list[Path] = []
    if tracker.name is not None:
        head = root / tracker.name
        why = problem(head)
        if why is None:
            out.append(head)
        else:
            rejected[str(head)] = why
    for folder in reversed(folders):
        step = step_of(folder.name)
        if limit is not None and (step is None or step >= limit):
            continue
        why = problem(folder)
        if why is None:
            out.append(folder)
        else:
            rejected[str(folder)] = why
    return Candidates(tracker, out, rejected)
