"""Logging set-up for the command line and the ranks: one stderr handler with a ``[rank N]`` prefix, and standard
streams whose reader may leave (:func:`reader_may_leave`).

The library itself adds no handlers (``logging.getLogger(__name__)`` everywhere); the entry points call
:func:`setup_logging` once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import TextIO, cast


def setup_logging(verbose: bool = False) -> None:
    """One stderr handler on the ``lifecycle`` logger, prefixed with ``[rank N]`` when RANK is set."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("lifecycle")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


class _ReaderMayLeave:
    """A standard stream whose reader may leave (``lifecycle run | head``): at the first broken pipe its file
    descriptor is pointed at /dev/null, so that whatever writes next (torch's log tailer thread, the summary) goes
    nowhere instead of raising, and the job runs to its end with its own exit code. Nothing is said about it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._discard()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard()

    def _discard(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())  # what is still buffered is flushed there, at exit too
        except (OSError, ValueError):  # no file descriptor (a test's capture): every write fails quietly instead
            pass
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` survive a reader that leaves while the block runs (for commands that must
    finish their work whoever reads); enter it before anything keeps a reference to them (the log handler, torch's
    log tailer). They are flushed and restored at the end."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (cast(TextIO, _ReaderMayLeave(s)) for s in saved)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
