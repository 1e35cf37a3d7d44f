"""Files of a run or checkpoint directory, read and written so that nothing in the folder can block or mislead.

Anyone can leave anything in a run directory: a FIFO where the tracker or ``summary.json`` should be (a plain
``open()`` blocks forever), a device, a socket, a huge file, JSON nested 100,000 levels deep (``RecursionError``).
Reads here open the path non-blocking, accept only a regular file of bounded size, and turn every other case into
a :class:`RunDirError` (exit 2) that names the file and what to do; writes replace the path atomically (a FIFO there
is replaced, never opened) or, for appends, open it non-blocking and refuse anything but a regular file.

Pure Python: no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from lifecycle.errors import RunDirError
from lifecycle.jsontypes import Json

SMALL = 1 << 20
"""Default limit for the small files lifecycle keeps (trackers, markers, summaries, manifests): 1 MiB."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: Path, mode: int) -> RunDirError:
    return RunDirError(f"{path}: is {_kind(mode)}, not a regular file; lifecycle never opens it (that could block "
                       f"forever): remove it or move it out of the run directory", path=str(path))


_NOCTTY = getattr(os, "O_NOCTTY", 0)


def _regular_fd(path: Path, flags: int) -> int:
    """``os.open(path, flags)`` without blocking; anything but a regular file is a :class:`RunDirError` naming it
    (``FileNotFoundError`` passes through). The descriptor is blocking again once it is known to be a file."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | _NOCTTY, 0o644)
    except FileNotFoundError:
        raise
    except OSError as exc:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode) from None  # e.g. a FIFO with no reader, opened for writing
        raise RunDirError(f"{path}: cannot be opened ({exc.strerror or exc}); fix its permissions or remove it",
                          path=str(path)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(path, st.st_mode)
    os.set_blocking(fd, True)
    return fd


def open_regular(path: str | Path) -> BinaryIO:
    """``open(path, "rb")`` that never blocks: anything but a regular file is a :class:`RunDirError` naming it
    (``FileNotFoundError`` when missing)."""
    return os.fdopen(_regular_fd(Path(path), os.O_RDONLY), "rb")


def read_bytes(path: str | Path, *, limit: int = SMALL) -> bytes | None:
    """The whole file, or None when it does not exist. Never blocks: a FIFO, device, socket or directory, a file
    over ``limit`` bytes or one that cannot be read is a :class:`RunDirError` naming it."""
    path = Path(path)
    try:
        f = open_regular(path)
    except FileNotFoundError:
        return None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise RunDirError(f"{path}: {size} bytes, more than the {limit} such a file can have; it is not one "
                              f"lifecycle wrote: remove it", path=str(path))
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise RunDirError(f"{path}: cannot be read ({exc.strerror or exc})", path=str(path)) from None
    if len(data) > limit:
        raise RunDirError(f"{path}: grew past {limit} bytes while read; remove it", path=str(path))
    return data


def read_text(path: str | Path, *, limit: int = SMALL) -> str | None:
    """:func:`read_bytes` as UTF-8 text (an undecodable file is a :class:`RunDirError`)."""
    data = read_bytes(path, limit=limit)
    if data is None:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise RunDirError(f"{path}: not UTF-8 (byte offset {exc.start}); it is not one lifecycle wrote: remove it",
                          path=str(path)) from None


def read_json(path: str | Path, *, limit: int = SMALL) -> Json:
    """The JSON in ``path`` (None when missing). Invalid, or nested too deep for the parser: a RunDirError."""
    text = read_text(path, limit=limit)
    if text is None:
        return None
    try:
        value: Json = json.loads(text)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else f"not valid JSON ({exc})"
        raise RunDirError(f"{path}: {why}; it is not one lifecycle wrote: remove it", path=str(path)) from None
    return value


def try_json(path: str | Path, *, limit: int = SMALL) -> Json:
    """:func:`read_json`, but None for anything that cannot be used (for readers that must go on regardless)."""
    try:
        return read_json(path, limit=limit)
    except RunDirError:
        return None


def write_text(path: str | Path, text: str, *, fsync: bool = False) -> None:
    """Replace ``path`` atomically with ``text`` (a temporary beside it, then ``os.replace``): whatever was at
    ``path`` (a FIFO included) is replaced, never opened. A directory there is a :class:`RunDirError`."""
    write_bytes(path, text.encode(), fsync=fsync)


def write_bytes(path: str | Path, data: bytes, *, fsync: bool = False) -> None:
    """:func:`write_text` for bytes."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary name beside ``path`` to write; it replaces ``path`` atomically when the block ends without an
    error (a FIFO or stale file at ``path`` is replaced, never opened), and is removed when it does not."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise RunDirError(f"{path}: is a directory where lifecycle keeps a file; remove it", path=str(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_rw(path: str | Path) -> int:
    """A file descriptor to read and write ``path`` (created when missing); anything but a regular file there is a
    :class:`RunDirError` naming it, never a hang."""
    return _regular_fd(Path(path), os.O_RDWR | os.O_CREAT)


def open_append(path: str | Path) -> int:
    """A file descriptor to append to ``path`` (created when missing). Never blocks: anything but a regular file
    there is a :class:`RunDirError` naming it."""
    return _regular_fd(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
