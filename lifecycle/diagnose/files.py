"""The inputs of ``lifecycle diagnose``: files and folders, walked and read so that no file can hang or flood it.

A folder is walked without following links to folders (a link loop cannot recurse); a file is opened only when it
is a regular file (a FIFO, device or socket is refused, never opened: that could block) and read in chunks, never
whole. What a file is comes from its first bytes (a pickle, JSON, text) and, for text, from the name (an elastic
error file, lifecycle's hang report). A file that cannot be used is a :class:`RunDirError` naming it (exit 2): a
link loop, a file that cannot be read, binary junk named on the command line, a line longer than
:data:`MAX_LINE`. Binary files met while walking a folder (checkpoints, core files), JSON-lines files (lifecycle's
events) and pickles that are no Flight Recorder dump are skipped and counted.

Pure Python: no torch.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lifecycle.errors import RunDirError

CHUNK = 1 << 20
MAX_LINE = 1 << 20
"""A log line longer than this (1 MiB) is not one any launcher wrote: the file is refused."""
MAX_DUMP = 256 << 20
"""The largest Flight Recorder dump read (a dump of 20,000 entries with stacks is ~100 MB)."""
MAX_JSON = 64 << 20
SNIFF = 4096
JSON_LINES = (".jsonl", ".ndjson")
MAX_FILES = 200_000


@dataclass(frozen=True)
class Input:
    """One file to read: its path, what it is (``log``, ``pickle``, ``json``, ``jsonl``) and whether the command
    line named it (a file met while walking a folder that is no input of ours is skipped, not refused)."""

    path: Path
    kind: str
    named: bool = False


def _refuse(path: Path, why: str) -> RunDirError:
    return RunDirError(f"{path}: {why}", path=str(path))


def _stat(path: Path, *, follow: bool) -> os.stat_result:
    try:
        return os.stat(path) if follow else os.lstat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link loop (it never reaches a file); remove it or name the target "
                          "instead") from None
        raise _refuse(path, f"cannot be read ({exc.strerror or exc})") from None


def collect(paths: list[str]) -> tuple[list[Input], int]:
    """Every input file under ``paths`` (files and folders in any mix), sorted; and how many binary files met
    while walking folders were skipped."""
    found: list[Input] = []
    skipped = 0
    for name in paths:
        path = Path(name)
        st = _stat(path, follow=True)
        if stat.S_ISDIR(st.st_mode):
            inputs, skip = _walk(path)
            found.extend(inputs)
            skipped += skip
        else:
            found.append(_classify(path, st, named=True))
    if len(found) > MAX_FILES:
        raise RunDirError(f"{len(found)} files to read, more than the {MAX_FILES} this reads: name fewer folders")
    return sorted(set(found), key=lambda i: str(i.path)), skipped


def _walk(root: Path) -> tuple[list[Input], int]:
    found: list[Input] = []
    skipped = 0
    for folder, dirs, files in os.walk(root, followlinks=False, onerror=_walk_error):
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            st = _stat(path, follow=True)
            if not stat.S_ISREG(st.st_mode):
                continue  # a link to a folder, a FIFO, a socket: never opened
            item = _classify(path, st, named=False)
            if item.kind == "binary":
                skipped += 1
            else:
                found.append(item)
        if len(found) > MAX_FILES:
            break
    return found, skipped


def _walk_error(exc: OSError) -> None:
    raise _refuse(Path(exc.filename or "?"), f"cannot be listed ({exc.strerror or exc})")


def _classify(path: Path, st: os.stat_result, *, named: bool) -> Input:
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "is not a regular file (a FIFO, device or socket is never opened: that could block)")
    head = read_head(path)
    kind = sniff(head)
    if kind == "binary" and named:
        raise _refuse(path, "binary data that is neither a log, a Flight Recorder dump nor a JSON file")
    if kind in ("json", "log") and path.suffix in JSON_LINES:
        kind = "jsonl"  # lifecycle's events/rank_<R>.jsonl, restarts.jsonl: records, not one JSON document
    return Input(path, kind, named)


def sniff(head: bytes) -> str:
    """``pickle``, ``json``, ``log`` or ``binary`` from the first bytes of a file."""
    if head[:1] == b"\x80" and len(head) > 1 and head[1] <= 5:
        return "pickle"
    text = head.lstrip()
    if text[:1] in (b"{", b"[") and b"\x00" not in head:
        # a JSON array ("[[", "[{", "[]"): read as JSON (bounded, depth-checked); "[rank0]: ..." is a log
        return "json" if text[:1] == b"{" or text[1:].lstrip()[:1] in (b"[", b"{", b"]") else "log"
    if not head:
        return "log"
    if b"\x00" in head:
        return "binary"
    printable = sum(1 for b in head if b >= 32 or b in (9, 10, 13, 27))
    return "log" if printable >= 0.9 * len(head) else "binary"


def open_file(path: Path) -> int:
    """A read-only descriptor of a regular file that never blocks on open (a FIFO swapped in is refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link loop") from None
        raise _refuse(path, f"cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refuse(path, "is not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_head(path: Path) -> bytes:
    fd = open_file(path)
    try:
        return _read(fd, SNIFF, path)
    finally:
        os.close(fd)


def _read(fd: int, size: int, path: Path) -> bytes:
    try:
        return os.read(fd, size)
    except OSError as exc:
        raise _refuse(path, f"cannot be read ({exc.strerror or exc})") from None


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """The whole file when it is at most ``limit`` bytes (dumps, error files); larger is a RunDirError."""
    fd = open_file(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise _refuse(path, f"{size} bytes, more than the {limit} a {what} can have")
        parts = []
        total = 0
        while total <= limit:
            part = _read(fd, CHUNK, path)
            if not part:
                break
            parts.append(part)
            total += len(part)
        if total > limit:
            raise _refuse(path, f"grew past {limit} bytes while read")
        return b"".join(parts)
    finally:
        os.close(fd)


def chunks(path: Path) -> Iterator[bytes]:
    """The file in chunks of whole lines (the last may lack its newline); a line over :data:`MAX_LINE` bytes is a
    RunDirError naming the file and the line."""
    fd = open_file(path)
    try:
        rest = b""
        lines = 0
        while True:
            part = _read(fd, CHUNK, path)
            if not part:
                break
            data = rest + part
            cut = data.rfind(b"\n") + 1
            first = data.find(b"\n", 0, MAX_LINE + 1)
            if first == -1 and len(data) > MAX_LINE:
                raise _refuse(path, f"line {lines + 1} is longer than {MAX_LINE} bytes: not a log a launcher wrote")
            if cut:
                yield data[:cut]
                lines += data.count(b"\n", 0, cut)
            rest = data[cut:]
        if rest:
            yield rest
    finally:
        os.close(fd)
