"""The checkpoint directory: what is committed, what is complete, the tracker, pruning, setting bad ones aside.

::

    <checkpoint.dir>/
      iter_0000010/            a committed checkpoint: the step handler's files, ``metadata.json`` (written last
                               by the handler) and ``manifest.json`` (every file, its size and sha256, written at commit)
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

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from lifecycle.checkpoint.binding import MAX_STEP
from lifecycle.jsontypes import JsonDict
from lifecycle.rundir import safeio

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
    """The step of an ``iter_NNNNNNN`` folder name, else None (``.tmp`` and set-aside folders included, and a step
    beyond :data:`~lifecycle.checkpoint.binding.MAX_STEP`, which no run reaches: a forged name)."""
    m = _ITER.match(name)
    if not m or len(m.group(1)) > 19:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    safeio.write_text(path, text, fsync=True)


# ---- completeness ----------------------------------------------------------------------------------
def listing(folder: Path) -> dict[str, int]:
    """Every file of ``folder`` (relative name → size), the manifest excluded, in name order."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            files[str(path.relative_to(folder))] = path.stat().st_size
    return files


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` digests (at commit) or checks (at resume): every world-th name."""
    return sorted(names)[rank::max(world, 1)]


def digest(path: Path) -> str:
    """The sha256 of ``path``'s content (read in 4 MiB blocks; a FIFO there is an error, never a hang)."""
    h = hashlib.sha256()
    with safeio.open_regular(path) as f:
        while block := f.read(4 << 20):
            h.update(block)
    return h.hexdigest()


def digests(folder: Path, names: list[str]) -> dict[str, str]:
    return {name: digest(folder / name) for name in names}


def write_manifest(folder: Path, sha256: dict[str, str] | None = None, *, step: int | None = None,
                   layout: JsonDict | None = None, options: JsonDict | None = None,
                   loss: float | None = None) -> None:
    """Record every file of ``folder`` with its size and, for those in ``sha256``, its content digest (rank 0, at
    commit, after every rank's writes are durable; the ranks digest their shares, see :func:`share`), and what the
    files are bound to: the ``step`` they hold and the ``layout`` they were written with
    (:mod:`lifecycle.checkpoint.binding`)."""
    sha256 = sha256 or {}
    files: dict[str, object] = {}
    for name, size in listing(folder).items():
        files[name] = {"bytes": size, "sha256": sha256[name]} if name in sha256 else size
    bound: dict[str, object] = {"step": step, "layout": layout, "options": options} if step is not None else {}
    if loss is not None and math.isfinite(loss):
        bound["loss"] = loss  # the saved step's loss: the first step after a restore is checked against it
    _atomic_write(folder / MANIFEST, json.dumps({"format": 3 if bound else 2, **bound, "files": files}, indent=0))


@dataclass(frozen=True)
class Binding:
    """What a manifest says its files are bound to (None: a manifest written before it was recorded)."""

    step: int | None
    layout: JsonDict | None
    options: JsonDict | None = None
    loss: float | None = None
    """The saved step's loss (None: not recorded)."""


def read_binding(folder: Path) -> Binding:
    """The step and layout ``folder``'s manifest records; Binding(None, None) when it records none or cannot be
    read (:func:`problem` names an unreadable manifest)."""
    try:
        data = safeio.read_json(folder / MANIFEST, limit=64 << 20)
    except (safeio.RunDirError, OSError):
        return Binding(None, None)
    if not isinstance(data, dict):
        return Binding(None, None)
    step, layout, opts, loss = data.get("step"), data.get("layout"), data.get("options"), data.get("loss")
    return Binding(step if isinstance(step, int) and not isinstance(step, bool) else None,
                   layout if isinstance(layout, dict) else None, opts if isinstance(opts, dict) else None,
                   float(loss) if isinstance(loss, int | float) and not isinstance(loss, bool)
                   and math.isfinite(loss) else None)


@dataclass(frozen=True)
class Listed:
    bytes: int
    sha256: str | None


def read_manifest(folder: Path) -> dict[str, Listed] | None:
    """The manifest's files (None when there is no manifest); a ValueError/RunDirError when it is malformed.
    Format 1 lists sizes only; format 2 a size and a sha256 per file."""
    manifest = folder / MANIFEST
    if not manifest.exists() and not manifest.is_symlink():
        return None
    files = safeio.read_json(manifest, limit=64 << 20)["files"]  # type: ignore[index,call-overload]
    out = {}
    for name, value in files.items():
        if isinstance(value, dict):
            sha = value.get("sha256")
            out[str(name)] = Listed(_size(value.get("bytes")), sha if isinstance(sha, str) else None)
        else:
            out[str(name)] = Listed(_size(value), None)
    return out


def _size(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"not a file size: {value!r}")
    return value


def problem(folder: Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None when it is. Local; reads sizes, not contents
    (:func:`changed` checks contents at resume).

    A checkpoint with a manifest is complete when every listed file exists with its size (a truncated or
    missing shard is named); one without (written by megatron-core's own save or an older lifecycle) when
    its ``metadata.json`` exists.
    """
    if not folder.is_dir():
        return "does not exist" if not folder.exists() else "is not a directory"
    if not (folder / COMPLETE).is_file():
        return f"{COMPLETE} is missing (the save never completed)"
    try:
        listed = read_manifest(folder)
    except safeio.RunDirError as exc:
        return f"{MANIFEST} is unreadable ({str(exc).split(': ', 1)[-1].split(';')[0]})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__})"
    bound = read_binding(folder).step
    if bound is not None and bound != step_of(folder.name):
        return (f"{MANIFEST} records step {bound}: the folder holds the files of another save (copied or moved "
                f"there), not step {step_of(folder.name)}")
    for name, entry in (listed or {}).items():
        path = folder / name
        try:
            actual = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != entry.bytes:
            return f"{name} has {actual} bytes, {entry.bytes} were written (truncated or overwritten)"
    return None


def changed(folder: Path, rank: int, world: int) -> str | None:
    """This rank's share of the content check at resume: the first file whose sha256 differs from the one recorded
    at commit, named, or None. Every rank checks a different share, so the whole checkpoint is read once, in
    parallel; a checkpoint without digests (format 1, megatron-core's own save) passes."""
    try:
        listed = read_manifest(folder) or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # problem() names an unreadable manifest
    recorded = {name: e.sha256 for name, e in listed.items() if e.sha256}
    for name in share(list(recorded), rank, world):
        try:
            actual = digest(folder / name)
        except OSError as exc:
            return f"{name} cannot be read ({getattr(exc, 'strerror', None) or exc})"
        if actual != recorded[name]:
            return (f"{name} does not hold what was committed (sha256 {actual[:12]}..., {recorded[name][:12]}... "
                    f"at commit): overwritten or corrupted since")
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
    one in ``protect``, never an incomplete one (those are not counted either), and never through a symbolic link
    (a linked checkpoint is not the run's own: it is left, and counted). A folder that cannot be deleted is logged
    and left: pruning happens after the commit, which it must never undo or fail."""
    if keep_last == 0:
        return []
    tracked = read_tracker(root).name
    complete = [p for p in committed(root) if problem(p) is None]
    keep = {p.name for p in complete[-keep_last:]} | set(protect) | ({tracked} if tracked else set())
    doomed = [p for p in complete if p.name not in keep]
    pruned = []
    for path in doomed:
        if path.is_symlink():
            log.warning("checkpoint %s is a symbolic link (to %s): not pruned, lifecycle deletes only its own "
                        "folders", path, os.readlink(path))
            continue
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("checkpoint %s could not be pruned (%s); it stays", path, exc.strerror or exc)
            continue
        pruned.append(path)
    if pruned:
        fsync_dir(root)
    return pruned


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
