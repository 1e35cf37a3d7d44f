"""One launcher per run directory: an OS lock on the run directory itself, held for the holder's life.

Pure Python: no torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from lifecycle.rundir import LOCK, safeio


class RunLock:
    """The run directory's one launcher: an exclusive OS lock on the run directory itself, held for the holder's life
    (the kernel drops it when the process ends, however it ends). Locking the folder, not a file in it: a lock file
    can be deleted while its holder runs, and a second launcher would then lock a new file and take the directory.
    ``<run_dir>/.lock`` only carries the holder's host, pid and start time for the message a second launcher gets.
    Where the file system cannot lock a folder, the file is locked instead (as before)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None
        self._on_file = False
        self.took_over: str | None = None
        """The holder recorded by a launcher that is gone (its lock was taken over), else None."""

    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`~lifecycle.rundir.safeio.RunDirError` (exit 2) naming the live holder."""
        import fcntl
        import socket

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._lockable()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            holder = self._holder() or "a process that wrote nothing yet"
            raise safeio.RunDirError(f"run directory {self.path.parent} is in use by another launcher ({holder}); "
                                     f"wait for it to end, or give this run another run.dir or run.id",
                                     path=str(self.path)) from None
        self._fd = fd
        try:
            self.took_over = self._holder() or None
            info = {"host": socket.gethostname(), "pid": os.getpid(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            self._record(", ".join(f"{k} {v}" for k, v in info.items()) + "\n")
        except BaseException:
            self.release()
            raise
        return self

    def _lockable(self) -> int:
        """The run directory opened to be locked; the ``.lock`` file where the folder cannot be (some network file
        systems lock files only)."""
        import fcntl

        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a probe: folders lock here, and nobody holds it
            fcntl.flock(fd, fcntl.LOCK_UN)
            return fd
        except BlockingIOError:
            return fd  # held by another launcher: acquire() names it
        except OSError:
            os.close(fd)
            self._on_file = True
            return safeio.open_rw(self.path)

    def _record(self, text: str) -> None:
        """The holder's line into ``.lock``: in place when that file is what is locked (replacing it would drop the
        lock), else replaced atomically."""
        assert self._fd is not None
        if self._on_file:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text.encode(), 0)
        else:
            safeio.write_text(self.path, text)

    def _holder(self) -> str:
        try:
            return (safeio.read_text(self.path, limit=4096) or "").strip()
        except safeio.RunDirError:
            return ""

    def release(self) -> None:
        """Give the lock up (safe twice); the file stays, empty: nobody holds the run directory."""
        if self._fd is not None:
            try:
                self._record("")
            except (OSError, safeio.RunDirError):  # a full disk or a folder gone: the lock goes with the process
                pass
            finally:
                fd, self._fd = self._fd, None
                os.close(fd)
