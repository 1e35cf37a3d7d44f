"""Files of a run or checkpoint directory, read and written so that nothing in the folder can block or mislead.

Anyone can leave anything in a run directory: a FIFO where the tracker or ``summary.json`` should be (a plain
``open()`` blocks forever), a device, a socket, a huge file, JSON nested 100,000 levels deep (``RecursionError``).
Reads here open the path non-blocking, accept only a regular file of bounded size, and turn every other case into
a :class:`RunDirError` (exit 2) that names the file and what to do. Writes touch regular files only: a device, FIFO
or socket at the path is refused, never replaced nor opened (``--out /dev/full`` must not replace the device);
replacing writes go through a temporary file beside the path (a symbolic link at the path is replaced, its target
untouched), and appends open the path itself without following a symbolic link (``events/rank_0.jsonl ->
/etc/passwd`` is refused, never appended to).

Pure Python: no torch.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from lifecycle.errors import LifecycleError, PhaseError, RunDirError, StorageError
from lifecycle.jsontypes import Json

SMALL = 1 << 20
"""Default limit for the small files lifecycle keeps (trackers, markers, summaries, manifests): 1 MiB."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: Path, mode: int, *, writing: bool = False) -> RunDirError:
    if writing:
        return refuse_write(path, mode)
    return RunDirError(f"{path}: is {_kind(mode)}, not a regular file; lifecycle never opens it (that could block "
                       f"forever): remove it or move it out of the run directory", path=str(path))


_HINT = "remove it (or move it away) if it was left there by mistake, or write elsewhere"


def refuse_write(path: Path, mode: int, hint: str = _HINT) -> RunDirError:
    """The error for a write to ``path`` whose ``lstat`` mode is not a regular file's; ``hint``: what to do."""
    what = _kind(mode)
    if stat.S_ISLNK(mode):
        what += f" (to {os.readlink(path)})"
    return RunDirError(f"{path}: is {what}, not a regular file; lifecycle writes only regular files and never "
                       f"replaces or writes through anything else: {hint}", path=str(path))


def check_writable(path: str | Path, *, replace: bool = True, hint: str = _HINT) -> None:
    """Raise :class:`RunDirError` unless ``path`` is missing or a regular file (or, when ``replace``, a symbolic
    link, which a replacing write replaces without touching its target). ``hint``: what the user should do."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (the write names a parent that is a file)
        return
    except OSError as exc:
        raise RunDirError(f"{path}: cannot be inspected ({exc.strerror or exc}); check the folders above it",
                          path=str(path)) from None
    if stat.S_ISDIR(mode):
        raise RunDirError(f"{path}: is a directory where lifecycle keeps a file; remove it", path=str(path))
    if not (stat.S_ISREG(mode) or (replace and stat.S_ISLNK(mode))):
        raise refuse_write(path, mode, hint)


_NOCTTY = getattr(os, "O_NOCTTY", 0)


def _writing(flags: int) -> bool:
    return bool(flags & (os.O_WRONLY | os.O_RDWR))


def _regular_fd(path: Path, flags: int) -> int:
    """``os.open(path, flags)`` without blocking; anything but a regular file is a :class:`RunDirError` naming it
    (``FileNotFoundError`` passes through). The descriptor is blocking again once it is known to be a file."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | _NOCTTY, 0o644)
    except FileNotFoundError:
        raise
    except OSError as exc:
        try:
            mode = os.lstat(path).st_mode if flags & os.O_NOFOLLOW else os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):  # e.g. a FIFO with no reader, opened for writing; a link not to be followed
            raise _refuse(path, mode, writing=_writing(flags)) from None
        raise RunDirError(f"{path}: cannot be opened ({exc.strerror or exc}); fix its permissions or remove it",
                          path=str(path)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(path, st.st_mode, writing=_writing(flags))
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
    """Replace ``path`` atomically with ``text`` (:func:`replacing`): a device, FIFO, socket or directory there is a
    :class:`RunDirError` naming it, and nothing is written."""
    write_bytes(path, text.encode(), fsync=fsync)


def write_bytes(path: str | Path, data: bytes, *, fsync: bool = False) -> None:
    """:func:`write_text` for bytes."""
    with replacing(path) as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[BinaryIO]:
    """A new temporary file beside ``path``, open for writing; it replaces ``path`` atomically when the block ends
    without an error, and is removed when it does not. Only a missing path, a regular file or a symbolic link (the
    link is replaced, its target untouched) can be replaced: anything else is a :class:`RunDirError`, before a byte
    is written. The temporary is created afresh, never through a link left at its name."""
    path = Path(path)
    check_writable(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        check_writable(path)  # made a device or FIFO meanwhile: still never replaced
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_new(path: str | Path, data: bytes) -> bool:
    """Write ``path`` atomically only when nothing is there yet, of any kind (a hard link of a complete temporary:
    never half a file, never over or through anything). Whether it was written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def open_rw(path: str | Path) -> int:
    """A file descriptor to read and write ``path`` (created when missing); anything but a regular file there, a
    symbolic link included (never written through), is a :class:`RunDirError` naming it, never a hang."""
    check_writable(path, replace=False)  # a device is not even opened
    return _regular_fd(Path(path), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW)


def open_append(path: str | Path) -> int:
    """A file descriptor to append to ``path`` (created when missing). Never blocks, never follows a symbolic link:
    anything but a regular file there is a :class:`RunDirError` naming it."""
    check_writable(path, replace=False)  # a device is not even opened
    return _regular_fd(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW)


STORAGE_ERRNOS = {errno.EROFS: ("is on a read-only file system", "remount it read-write"),
                  errno.ENOSPC: ("is on a full file system", "free space there"),
                  errno.EDQUOT: ("is over its disk quota", "free space there")}
"""Errors of the environment, not of the code, and only ever of a write: (what the folder is, what to do)."""


def storage_error(exc: BaseException, folders: Mapping[str, str | Path], fallback: str | None = None, *,
                  before_start: bool = False) -> StorageError | RunDirError | None:
    """``exc`` as one line when a file system refused a write (read-only, full, over its quota), naming
    the run's folder the file lies in (``folders``: policy key -> folder, the first that holds it; ``fallback``: the
    key when the error names no file); None for any other error. A :class:`StorageError` (the run failed: exit 4),
    or with ``before_start`` a :class:`RunDirError` (found before any rank started: exit 2)."""
    refused = _refused_write(exc)
    if refused is None:
        return None
    message, name = _storage_message(refused, folders, fallback)
    if before_start:
        return RunDirError(message, path=name)
    error = StorageError(f"{message}, then run again (committed checkpoints are untouched)", path=name)
    error.__cause__ = exc
    return error


def _storage_message(refused: OSError, folders: Mapping[str, str | Path], fallback: str | None
                     ) -> tuple[str, str | None]:
    what, fix = STORAGE_ERRNOS[refused.errno or 0]
    name = os.fsdecode(refused.filename) if isinstance(refused.filename, str | bytes) else None
    key = fallback if name is None else next((k for k, f in folders.items() if _inside(name, f)), None)
    if key is None:
        return f"{name or 'a file lifecycle writes'} {what} ({refused.strerror}); {fix} or use another folder", name
    failed = f"cannot write {name}" if name else "a write failed"
    return (f"{key} {folders[key]} {what}: {failed} ({refused.strerror}); {fix} or point {key} at another folder",
            name)


def _refused_write(exc: BaseException) -> OSError | None:
    """The storage OSError behind ``exc``: itself, or what it was raised from or while handling (torch.save on a full
    disk raises a RuntimeError in the handling of the OSError; a save handle wraps it in a PhaseError). An error of
    lifecycle's own that is not a plain PhaseError (a hang, a usage error) keeps its meaning and its exit code."""
    if isinstance(exc, LifecycleError) and type(exc) is not PhaseError:
        return None
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS:
            return seen
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return None


def _inside(name: str, folder: str | Path) -> bool:
    path, root = os.path.abspath(name), os.path.abspath(folder)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
